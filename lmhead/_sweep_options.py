r"""The fused sweep's options, checked once, and the plan built from them.

Every fused loss takes the same options of the sweep -- the head's
``scale``, ``softcap`` and ``temperature``, the block sizes, the matmuls'
``precision``, skipping the tokens of weight 0, gradient filtering and how
``dw`` is summed -- as keywords, and builds one :class:`SweepOptions` of
them, whose construction checks them. From it and a rule, the sweep's
static :class:`Plan` is built once per call (per device when the
vocabulary is split, from the rows a device holds). docs/fused_loss.md says
how the block sizes were chosen and ("Gradient filtering and dw's
accumulation") derives the filter's bound and compares the accumulations.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lmhead import _checks

# The gradients a filtered tile leaves out; how dw is summed over chunks.
FILTER_TARGETS = ("both", "dh", "dw")
DW_ACCUMULATIONS = ("float32", "kahan", "input_dtype")
# filter_eps="auto": finfo(dtype).eps / AUTO_FILTER_DIVISOR, as CCE.
AUTO_FILTER_DIVISOR = 32

# Default block sizes by platform (``jax.default_backend()``): numbers in one
# chunk's kept logits, and vocabulary rows per block of the elementwise work
# and of each ``dw`` update (XLA does not accumulate into a matmul's output,
# so an update needs a ``[rows, D]`` temporary). docs/fused_loss.md says why.
BLOCK_ELEMENTS = {"cpu": 2**22, "gpu": 2**26, "tpu": 2**26}
VOCAB_BLOCK_ROWS = {"cpu": 1024, "gpu": 16384, "tpu": 16384}
MIN_CHUNK_SIZE = 128
MAX_CHUNK_SIZE = 1024


def default_chunk_size(width: int) -> int:
    """Tokens per chunk when a chunk's ``[width, chunk_size]`` logits are kept.

    ``BLOCK_ELEMENTS[platform] // width`` clipped to ``[MIN_CHUNK_SIZE,
    MAX_CHUNK_SIZE]``.

    Examples:
        >>> default_chunk_size(32768) == max(
        ...     MIN_CHUNK_SIZE, BLOCK_ELEMENTS[jax.default_backend()] // 32768)
        True
    """
    elements = BLOCK_ELEMENTS.get(jax.default_backend(), BLOCK_ELEMENTS["cpu"])
    return min(max(elements // width, MIN_CHUNK_SIZE), MAX_CHUNK_SIZE)


def block_sizes(
    num_tokens,
    num_rows,
    chunk_size,
    vocab_chunk_size,
    segment_length=None,
    chunk_factor=1,
):
    """``(chunk_size, block_rows, keep_logits)`` with the defaults filled in.

    ``num_tokens`` and ``num_rows`` are those of ``h`` and ``w`` on a device;
    the default chunk is that of logits ``chunk_factor`` times narrower (a
    rule's :attr:`~lmhead._fused_rule.Rule.chunk_factor`); with
    ``segment_length`` (:class:`Plan`'s) no longer than a chunk, the chunk
    holds whole segments.
    """
    platform = jax.default_backend()
    keep_logits = vocab_chunk_size is None or vocab_chunk_size >= num_rows
    width = num_rows if keep_logits else int(vocab_chunk_size)
    if chunk_size is None:
        chunk_size = default_chunk_size(max(1, width // chunk_factor))
    if segment_length is not None and segment_length <= chunk_size:
        chunk_size = chunk_size // segment_length * segment_length
    rows = (
        VOCAB_BLOCK_ROWS.get(platform, VOCAB_BLOCK_ROWS["cpu"])
        if keep_logits
        else width
    )
    return min(int(chunk_size), num_tokens), min(rows, num_rows), keep_logits


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static part of a call: the rule, block sizes, vocabulary split."""

    rule: Any  # a lmhead._fused_rule.Rule
    num_rows: int  # rows of w on this device: V, or V / devices along vocab_axis
    vocab_axis: str | None  # the mesh axis w's rows are split over, if any
    chunk_size: int
    block_rows: int  # vocabulary rows per block
    keep_logits: bool  # a chunk's [V, Nc] logits computed once and kept
    scale: float | None
    softcap: float | None
    precision: jax.lax.PrecisionLike
    grads_in_forward: bool
    # Chunks of weight-0 tokens are skipped, weighted tokens packed first.
    skip_zero_weights: bool = False
    filter_eps: float | None = None  # SweepOptions' gradient options
    filter_target: str = "both"
    dw_accumulation: str = "float32"
    # Tokens [s L, (s + 1) L) are segment s of a segment objective (Rule),
    # never packed; a chunk holds whole segments or lies within one.
    segment_length: int | None = None

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.block_rows)

    def first_row(self) -> jax.Array | int:
        """The vocabulary id of this device's first row of ``w``."""
        if self.vocab_axis is None:
            return 0
        return lax.axis_index(self.vocab_axis) * self.num_rows

    def dot(self, a, b, dims):
        return lax.dot_general(
            a, b, dims, precision=self.precision, preferred_element_type=jnp.float32
        )


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    r"""How the fused sweep computes a loss through the head, checked when built.

    The options every fused loss takes by keyword (``fused.fused_cross_entropy``
    documents each); a fused loss builds one of its keywords, which checks
    them, and the sweep's :class:`Plan` is built from it. Frozen and
    hashable, so it can be a static argument of ``jax.jit``. Numbers are
    compiled into the sweep, so they must be concrete.

    Attributes:
        scale, softcap: of the logits ``softcap(scale * h @ w.T + bias)``,
            as in ``head.unembed``: numbers > 0, or None.
        temperature: ``T > 0`` divides those logits, as a sampler at
            temperature ``T`` does (a distillation's temperature is its
            loss's, not this).
        chunk_size: tokens per chunk, an integer >= 1, or None for the
            default (:func:`default_chunk_size`).
        vocab_chunk_size: None keeps a chunk's logits for the whole
            vocabulary; an integer >= 1 computes them that many rows at a
            time, twice.
        precision: of the matmuls, as in ``head.unembed``.
        skip_zero_weights: True skips the chunks of tokens of weight 0.
        filter_eps, filter_target, dw_accumulation: the gradient's options
            (:meth:`gradient_options`).

    Raises:
        ValueError, TypeError: naming the option, when one is out of range,
            of the wrong type or traced.

    Examples:
        >>> options = SweepOptions(chunk_size=256, filter_eps="auto")
        >>> options.gradient_options(jnp.bfloat16)["filter_eps"]
        0.000244140625
        >>> SweepOptions(softcap=0.0)
        Traceback (most recent call last):
        ...
        ValueError: softcap must be in (0, inf]; got 0.0.
    """

    scale: float | None = None
    softcap: float | None = None
    temperature: float = 1.0
    chunk_size: int | None = None
    vocab_chunk_size: int | None = None
    precision: jax.lax.PrecisionLike = None
    skip_zero_weights: bool = False
    filter_eps: float | str | None = None
    filter_target: str = "both"
    dw_accumulation: str = "float32"

    def __post_init__(self):
        numbers = dict(
            scale=self.scale, softcap=self.softcap, temperature=self.temperature
        )
        _checks.check_concrete("the fused sweep", **numbers)
        for name, value in numbers.items():
            if value is None and name == "temperature":
                raise TypeError("temperature must be a number > 0; got None.")
            _checks.check_in_range(name, value, low=0.0, low_open=True)
            # Python floats, so that equal options are equal and hash alike.
            object.__setattr__(self, name, None if value is None else float(value))
        for name in ("chunk_size", "vocab_chunk_size"):
            _checks.check_count(name, getattr(self, name), optional=True)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        if not isinstance(self.skip_zero_weights, bool):
            raise TypeError(
                "skip_zero_weights must be True or False; got "
                f"{self.skip_zero_weights!r}."
            )
        eps = self.filter_eps
        if isinstance(eps, str):
            if eps != "auto":
                raise ValueError(
                    f"filter_eps must be None, a number >= 0 or 'auto'; got {eps!r}."
                )
        elif eps is not None:
            if isinstance(eps, bool) or _checks.is_traced(eps):
                raise TypeError(
                    "filter_eps must be None, a concrete number >= 0 or 'auto'; "
                    f"got {eps!r}."
                )
            _checks.check_in_range("filter_eps", eps, low=0.0)
            object.__setattr__(self, "filter_eps", float(eps))
        _checks.check_choice("filter_target", self.filter_target, FILTER_TARGETS)
        _checks.check_choice("dw_accumulation", self.dw_accumulation, DW_ACCUMULATIONS)

    def gradient_options(self, dtype) -> dict:
        r"""The :class:`Plan` fields of the gradient's options, for inputs of ``dtype``.

        ``filter_eps``: None (exact), a number ``>= 0``, or ``"auto"``,
        ``finfo(dtype).eps / 32`` of the inputs' dtype. A tile (a chunk's
        tokens x a vocabulary block) is skipped when each entry of its
        coefficient :math:`g = \partial L / \partial u` (the rule's
        ``dlogits`` after the softcap's derivative) is 0 or :math:`|g_{ti}|
        < \epsilon \sigma_t`, with :math:`\sigma_t = \max_k |c_{tk}|` the
        token's largest coefficient: for the cross-entropy :math:`g_{ti} /
        \sigma_t = p_{ti} - [i = y_t]`, whatever the token's weight or the
        reduction. A skipped tile adds nothing to ``dh`` (``filter_target``
        ``"both"`` or ``"dh"``) and ``dw`` (``"both"`` or ``"dw"``);
        ``dbias`` and the outputs stay exact. With the scale :math:`s` and
        the objective's cotangent :math:`c` (``1 / sum(weights)`` for a
        mean), :math:`S_t` (:math:`S_i`) the rows (tokens) of token ``t``'s
        (row ``i``'s) skipped tiles, or all of them:

        .. math::
            |\Delta dh_{td}| \le |s| c \epsilon \sigma_t \sum_{i \in S_t}
            |w_{id}|, \qquad |\Delta dw_{id}| \le |s| c \epsilon
            \sum_{t \in S_i} \sigma_t |h_{td}|.

        ``dw_accumulation``: ``"float32"`` (default) sums the chunks' ``dw``
        in float32; ``"kahan"`` adds a float32 Kahan compensation (a second
        ``[V, D]`` array), so the sum's error does not grow with the chunks;
        ``"input_dtype"`` sums in the inputs' dtype (bf16: half the memory).

        Examples:
            >>> SweepOptions(filter_eps="auto", filter_target="dh").gradient_options(
            ...     jnp.bfloat16)
            {'filter_eps': 0.000244140625, 'filter_target': 'dh', 'dw_accumulation': 'float32'}

        References:
            Wijmans et al., `Cut Your Losses in Large-Vocabulary Language
            Models <https://arxiv.org/abs/2411.09009>`_, 2024 (gradient
            filtering); Kahan, `Further remarks on reducing truncation errors
            <https://doi.org/10.1145/363707.363723>`_, 1965.
        """
        eps = self.filter_eps
        if eps == "auto":
            eps = float(jnp.finfo(dtype).eps) / AUTO_FILTER_DIVISOR
        return dict(
            filter_eps=eps,
            filter_target=self.filter_target,
            dw_accumulation=self.dw_accumulation,
        )

    def tempered_bias(self, bias):
        """``bias / temperature``: the bias of the logits the rule sees."""
        if bias is None or self.temperature == 1.0:
            return bias
        return bias / self.temperature

    def plan(
        self,
        rule,
        num_tokens,
        num_rows,
        dtype,
        *,
        grads_in_forward,
        vocab_axis=None,
        segment_length=None,
    ) -> Plan:
        """The :class:`Plan` of ``rule`` over ``num_tokens`` tokens of ``h``
        and ``num_rows`` rows of ``w`` (a device's), inputs of ``dtype``.

        A temperature ``T`` is folded into the scale and the cap:
        ``c tanh(u / c) / T = (c / T) tanh((u / T) / (c / T))``, so dividing
        the pre-softcap logits ``u`` and the cap by ``T`` (and the bias,
        :meth:`tempered_bias`) divides the logits by it.
        """
        scale, softcap = self.scale, self.softcap
        if self.temperature != 1.0:
            scale = (1.0 if scale is None else scale) / self.temperature
            softcap = None if softcap is None else softcap / self.temperature
        chunk_size, block_rows, keep_logits = block_sizes(
            num_tokens,
            num_rows,
            self.chunk_size,
            self.vocab_chunk_size,
            segment_length,
            rule.chunk_factor,
        )
        return Plan(
            rule,
            num_rows,
            vocab_axis,
            chunk_size,
            block_rows,
            keep_logits,
            scale,
            softcap,
            self.precision,
            grads_in_forward=grads_in_forward,
            skip_zero_weights=self.skip_zero_weights,
            **self.gradient_options(dtype),
            segment_length=segment_length,
        )
