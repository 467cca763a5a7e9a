"""The tying study's four arms: their shapes, solved for matched parameter counts.

Four arms per vocabulary (``V`` tokens, base width ``D``):

* ``a``: tied, the base shape;
* ``b``: untied, the base shape (``V * D`` more parameters than ``a``);
* ``c``: untied, *narrower*, matched to ``a``: the ``d_model`` (a multiple of
  ``num_heads``) whose model with the base MLP ratio is nearest ``a``'s count,
  then ``mlp_dim`` solved so that the counts agree;
* ``d``: tied, *deeper*, matched to ``b``: the ``V * D`` that tying saves
  buys whole blocks of the base shape, and the rest widens every block's MLP.

Counts come from :func:`count_params`, a closed form of ``model.DecoderLM``'s
parameter tree (the tests check it against ``jax.eval_shape`` of the model's
init), so the matched shapes are solved (:func:`arm_shapes`), not typed in,
at the number of tokens the tokenizer has (``study.Design.vocab_sizes``):
byte-level BPE trained on a short text runs out of pairs to merge before the
size asked for. The grid of cells and the learning-rate choice are in
``study.py`` here.
"""

import dataclasses
from typing import Any

ARMS = {
    "a": "tied",
    "b": "untied, same shape",
    "c": "untied, narrower, matched to a",
    "d": "tied, deeper, matched to b",
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


def deeper_tied(
    vocab_size: int, base: Shape, target: int, arch: Architecture = Architecture()
) -> Shape:
    """Arm ``d``: tied, ``base.d_model``, deeper, ``target`` parameters.

    Adds as many whole blocks of the base shape as fit under ``target``,
    then widens every block's MLP by the remainder.
    """
    tied = dataclasses.replace(base, tied=True)
    one_block = count_params(
        vocab_size, dataclasses.replace(tied, num_layers=2), arch
    ) - count_params(vocab_size, dataclasses.replace(tied, num_layers=1), arch)
    extra = max(0, (target - count_params(vocab_size, tied, arch)) // one_block)
    deeper = dataclasses.replace(tied, num_layers=base.num_layers + extra)
    return _require_matched_count(
        vocab_size, _solve_mlp_dim(vocab_size, deeper, target, arch), target, arch
    )


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
    """The four arms' shapes at ``vocab_size``, keyed ``"a"`` .. ``"d"``.

    Examples:
        >>> shapes = arm_shapes(2048, Shape(True, 128, 4, 512))
        >>> shapes["c"]
        Shape(tied=False, d_model=112, num_layers=4, mlp_dim=436)
        >>> shapes["d"]
        Shape(tied=True, d_model=128, num_layers=5, mlp_dim=563)
    """
    tied = dataclasses.replace(base, tied=True)
    untied = dataclasses.replace(base, tied=False)
    return {
        "a": tied,
        "b": untied,
        "c": narrower_untied(
            vocab_size, base, count_params(vocab_size, tied, arch), arch
        ),
        "d": deeper_tied(
            vocab_size, base, count_params(vocab_size, untied, arch), arch
        ),
    }


def head_share(vocab_size: int, d_model: int, num_params: int) -> float:
    """The ``[V, D]`` unembedding's share of a model's parameters (the tied
    table counts: it is the head's matrix too).

    Examples:
        >>> round(head_share(8192, 128, 2_000_000), 4)
        0.5243
    """
    return vocab_size * d_model / num_params
