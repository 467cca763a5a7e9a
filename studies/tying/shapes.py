"""The tying study's arms (:data:`ARMS`: a tied; b untied; c untied,
narrower to a's count; d tied, deeper by whole blocks to at most b's; e b's
shape, tied then untied), their shapes solved for matched parameter counts
(:func:`arm_shapes`) from :func:`count_params`, a closed form of
``model.DecoderLM``'s parameter tree.
"""

import dataclasses
from typing import Any

ARMS = {
    "a": "tied",
    "b": "untied, same shape",
    "c": "untied, narrower, matched to a",
    "d": "tied, deeper by whole blocks",
    "e": "tied, then untied",
}
# Parameter counts of matched arms may differ by at most this fraction.
MATCH_TOLERANCE = 0.02


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model keys an arm sets (``config.model.*``)."""

    tied: bool
    d_model: int
    num_layers: int
    mlp_dim: int

    def overrides(self) -> dict[str, Any]:
        """The ``--config.model.*`` overrides, in a fixed order (for run names)."""
        return {
            "model.tied": self.tied,
            "model.d_model": self.d_model,
            "model.num_layers": self.num_layers,
            "model.mlp_dim": self.mlp_dim,
        }


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What every arm shares: ``config.model`` / ``config.data`` values."""

    num_heads: int = 4
    max_len: int = 64  # data.block_size
    positions: str = "learned"
    use_bias: bool = False
    head_bias: bool = False


def count_params(
    vocab_size: int, shape: Shape, arch: Architecture = Architecture()
) -> int:
    r"""Parameters of ``model.DecoderLM`` with ``shape`` and ``arch``.

    With :math:`V` tokens, width :math:`D`, :math:`L` blocks, MLP width
    :math:`F`, :math:`T` learned positions and :math:`\beta = 1` when the
    blocks and norms have biases (else 0):

    .. math::
        N = V D\,(2 - \text{tied}) + T D + L\,(4 D^2 + 2 D F + (2 + 2\beta) D
            + \beta(5 D + F)) + (1 + \beta) D + V\,\text{head\_bias}

    (per block: qkv :math:`3D^2`, out :math:`D^2`, the MLP :math:`2DF`, two
    LayerNorms; then the final LayerNorm.)

    Examples:
        >>> count_params(17, Shape(True, 8, 1, 16), Architecture(2, 8, use_bias=True))
        816
    """
    d, f, beta = shape.d_model, shape.mlp_dim, int(arch.use_bias)
    tables = vocab_size * d * (1 if shape.tied else 2)
    positions = arch.max_len * d if arch.positions == "learned" else 0
    block = 4 * d * d + 2 * d * f + (2 + 2 * beta) * d + beta * (5 * d + f)
    return (
        tables
        + positions
        + shape.num_layers * block
        + (1 + beta) * d
        + (vocab_size if arch.head_bias else 0)
    )


def _solve_mlp_dim(
    vocab_size: int, shape: Shape, target: int, arch: Architecture
) -> Shape:
    """``shape`` with the ``mlp_dim`` whose count is nearest ``target``
    (the count is linear in ``mlp_dim``)."""
    at_zero = count_params(vocab_size, dataclasses.replace(shape, mlp_dim=0), arch)
    per_unit = (
        count_params(vocab_size, dataclasses.replace(shape, mlp_dim=1), arch) - at_zero
    )
    mlp_dim = max(1, round((target - at_zero) / per_unit))
    return dataclasses.replace(shape, mlp_dim=mlp_dim)


def narrower_untied(
    vocab_size: int, base: Shape, target: int, arch: Architecture = Architecture()
) -> Shape:
    """Arm ``c``: untied, ``base.num_layers`` blocks, narrower, ``target`` parameters.

    ``d_model`` is the multiple of ``num_heads`` (at most ``base.d_model``)
    whose model with ``mlp_dim = d_model * base.mlp_dim / base.d_model`` has
    the count nearest ``target``; then ``mlp_dim`` is solved for ``target``.
    """
    ratio = base.mlp_dim / base.d_model
    widths = range(arch.num_heads, base.d_model + 1, arch.num_heads)

    def scaled(d):
        return Shape(False, d, base.num_layers, max(1, round(ratio * d)))

    d_model = min(
        widths, key=lambda d: abs(count_params(vocab_size, scaled(d), arch) - target)
    )
    return _require_matched_count(
        vocab_size,
        _solve_mlp_dim(vocab_size, scaled(d_model), target, arch),
        target,
        arch,
    )


def block_params(shape: Shape, arch: Architecture = Architecture()) -> int:
    """Parameters of one block of ``shape`` (the count's step per layer).

    Examples:
        >>> block_params(Shape(True, 128, 4, 512), Architecture(use_bias=False))
        196864
    """
    one = count_params(1, dataclasses.replace(shape, num_layers=1), arch)
    return count_params(1, dataclasses.replace(shape, num_layers=2), arch) - one


def deeper_tied(
    vocab_size: int, base: Shape, arch: Architecture = Architecture()
) -> Shape | None:
    """Arm ``d``: tied, ``base`` plus ``k = floor(V D / block)`` whole blocks,
    the blocks the untied head's ``V D`` parameters pay for; ``None`` when
    ``k = 0`` (the saved parameters are less than one block).

    Examples:
        >>> arch = Architecture(use_bias=False)
        >>> deeper_tied(8192, Shape(True, 128, 4, 512), arch)
        Shape(tied=True, d_model=128, num_layers=9, mlp_dim=512)
        >>> deeper_tied(512, Shape(True, 128, 4, 512), arch) is None
        True
    """
    tied = dataclasses.replace(base, tied=True)
    extra = vocab_size * base.d_model // block_params(tied, arch)
    if extra == 0:
        return None
    return dataclasses.replace(tied, num_layers=base.num_layers + extra)


def _require_matched_count(vocab_size, shape, target, arch) -> Shape:
    count = count_params(vocab_size, shape, arch)
    if abs(count - target) > MATCH_TOLERANCE * target:
        raise ValueError(
            f"No shape matches {target:,} parameters within "
            f"{MATCH_TOLERANCE:.0%} at vocab_size={vocab_size}: the "
            f"nearest, {shape}, has {count:,}."
        )
    return shape


def arm_shapes(
    vocab_size: int, base: Shape, arch: Architecture = Architecture()
) -> dict[str, Shape]:
    """The arms' shapes at ``vocab_size``, keyed ``"a"`` .. ``"e"``; no
    ``"d"`` where the saved parameters pay for no whole block.

    Examples:
        >>> arch = Architecture(use_bias=False)
        >>> shapes = arm_shapes(2048, Shape(True, 128, 4, 512), arch)
        >>> shapes["c"]
        Shape(tied=False, d_model=112, num_layers=4, mlp_dim=436)
        >>> shapes["d"]
        Shape(tied=True, d_model=128, num_layers=5, mlp_dim=512)
        >>> "d" in arm_shapes(512, Shape(True, 128, 4, 512), arch)
        False
    """
    tied = dataclasses.replace(base, tied=True)
    untied = dataclasses.replace(base, tied=False)
    arms = {
        "a": tied,
        "b": untied,
        "c": narrower_untied(
            vocab_size, base, count_params(vocab_size, tied, arch), arch
        ),
        "d": deeper_tied(vocab_size, base, arch),
        "e": untied,
    }
    return {arm: shape for arm, shape in arms.items() if shape is not None}


def flops_per_token(
    vocab_size: int, shape: Shape, arch: Architecture = Architecture()
) -> int:
    r"""Training FLOPs per token, :math:`6 N_\text{matmul} + 6 L T D`
    (Kaplan et al. 2020's :math:`C \approx 6N` per token, with the
    attention scores' :math:`2 \cdot 2 T D` forward per layer at context
    :math:`T`, times 3 for the backward pass). :math:`N_\text{matmul}`
    counts the weights a token multiplies by: every block's dense kernels and
    the ``[V, D]`` head once, tied or not (embedding lookups and norms are
    not matmuls).

    Examples:
        >>> flops_per_token(2048, Shape(True, 128, 4, 512), Architecture(use_bias=False))
        6488064
    """
    d, f = shape.d_model, shape.mlp_dim
    matmul = shape.num_layers * (4 * d * d + 2 * d * f) + vocab_size * d
    return 6 * matmul + 6 * shape.num_layers * arch.max_len * d


def head_share(vocab_size: int, d_model: int, num_params: int) -> float:
    """The ``[V, D]`` unembedding's share of a model's parameters (the tied
    table counts: it is the head's matrix too).

    Examples:
        >>> round(head_share(8192, 128, 2_000_000), 4)
        0.5243
    """
    return vocab_size * d_model / num_params
