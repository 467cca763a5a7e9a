"""A smaller unembedding for inference: half precision, or int8 per-row.

:func:`quantize_unembedding` stores ``w: [V, D]`` in bfloat16 or float16, or
in int8 with one float32 scale per token; the result goes wherever a
``w: [V, D]`` goes at inference (``head.unembed``, ``modules.LMHead``).
``generation.quantize_for_decoding`` does it for a ``model.DecoderLM``;
docs/large_vocab.md gives the sizes, accuracy and speed.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks

DTYPES = ("bfloat16", "float16", "int8")
INT8_MAX = 127
# Rows of an int8 table converted at a time on CPU (see matmul_transposed).
CPU_BLOCK_ROWS = 4096


class QuantizedTable(NamedTuple):
    """An int8 unembedding with one scale per row (per token).

    Row ``v`` of the table it stands for is ``values[v] * scales[v]``. A
    pytree, so it passes through ``jit`` and sits in a params tree.

    Attributes:
        values: ``int8 [V, D]`` in ``[-127, 127]``.
        scales: ``float32 [V]``, ``max_d |w[v, d]| / 127`` (0 for a zero row).
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        """``(V, D)``, the shape of the table it stands for."""
        return tuple(np.shape(self.values))

    def as_shape(self) -> jax.ShapeDtypeStruct:
        """The float32 ``[V, D]`` table it stands for, as a shape (for checks)."""
        return jax.ShapeDtypeStruct(self.shape, jnp.float32)


def quantize_unembedding(
    w: jax.typing.ArrayLike, dtype: str = "int8"
) -> jax.Array | QuantizedTable:
    r"""The unembedding ``w: [V, D]`` in fewer bytes, for inference.

    ``"bfloat16"`` and ``"float16"`` round every entry (2 bytes each).
    ``"int8"`` rounds each row to 255 levels of its own range:

    .. math::
        s_v = \max_d |w_{vd}| / 127, \qquad
        q_{vd} = \mathrm{round}(w_{vd} / s_v) \in [-127, 127]

    so that :math:`|w_{vd} - s_v q_{vd}| \le s_v / 2`, in ``V (D + 4)``
    bytes. ``head.unembed`` computes :math:`(h\, q^\top) \cdot s` in float32.

    Args:
        w: ``[V, D]`` floating table (float32 or bfloat16, say).
        dtype: ``"bfloat16"``, ``"float16"`` or ``"int8"``.

    Returns:
        A ``[V, D]`` array of ``dtype`` for the half-precision types; a
        :class:`QuantizedTable` for ``"int8"``.

    Raises:
        ValueError: for another ``dtype``; for ``"float16"``, when a concrete
            entry exceeds its largest finite value, 65504 (inside ``jit``
            such an entry becomes ``inf``).

    Examples:
        >>> import jax.numpy as jnp
        >>> w = jnp.array([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]])
        >>> table = quantize_unembedding(w, "int8")
        >>> table.values
        Array([[  64, -127,   32],
               [   0,    0,    0]], dtype=int8)
        >>> table.scales
        Array([0.00787402, 0.        ], dtype=float32)
    """
    _checks.check_choice("dtype", dtype, DTYPES)
    _checks.check_floating("w", w)
    _checks.check_rank("w", w, 2, "[V, D]")
    if dtype == "float16" and not _checks.is_traced(w):
        largest = float(np.max(np.abs(np.asarray(w, np.float32)), initial=0.0))
        if largest > float(np.finfo(np.float16).max):
            raise ValueError(
                f"w has entries up to {largest:g}, beyond float16's largest finite value "
                "65504; use dtype='bfloat16' or 'int8'."
            )
    if dtype != "int8":
        return jnp.asarray(w, dtype)
    w = jnp.asarray(w, jnp.float32)
    scales = jnp.max(jnp.abs(w), axis=1) / INT8_MAX
    # A zero row keeps scale 0; dividing by 1 instead gives it zero values.
    divisor = jnp.where(scales > 0, scales, 1.0)[:, None]
    values = jnp.clip(jnp.round(w / divisor), -INT8_MAX, INT8_MAX)
    return QuantizedTable(values=values.astype(jnp.int8), scales=scales)


def dequantize(table: QuantizedTable) -> jax.Array:
    r"""The float32 ``[V, D]`` table that ``table`` stands for: :math:`s_v q_{vd}`.

    Examples:
        >>> import jax.numpy as jnp
        >>> dequantize(QuantizedTable(jnp.array([[2, -1]], jnp.int8),
        ...                           jnp.array([0.5])))
        Array([[ 1. , -0.5]], dtype=float32)
    """
    check_table(table)
    return jnp.asarray(table.values, jnp.float32) * table.scales[:, None]


def check_table(table: QuantizedTable) -> None:
    """Raises unless ``values`` is ``int8 [V, D]`` and ``scales`` is ``[V]`` float."""
    if jnp.result_type(table.values) != jnp.int8:
        raise TypeError(
            f"QuantizedTable.values must be int8; got {jnp.result_type(table.values)}."
        )
    _checks.check_rank("QuantizedTable.values", table.values, 2, "[V, D]")
    _checks.check_floating("QuantizedTable.scales", table.scales)
    if np.shape(table.scales) != table.shape[:1]:
        raise ValueError(
            f"QuantizedTable.scales must have shape [V] = "
            f"{table.shape[:1]}; got {np.shape(table.scales)}."
        )


def matmul_transposed(
    h: jax.Array, table: QuantizedTable, precision: jax.lax.PrecisionLike = None
) -> jax.Array:
    r"""``float32 [..., V]``: :math:`(h\, q^\top) \cdot s`, accumulated in float32.

    The int8 values are exact in any float type with at least 8 significant
    bits (bfloat16 included), so they are converted to ``h``'s dtype and the
    scale is applied once per logit rather than once per entry.

    Examples:
        >>> import jax.numpy as jnp
        >>> table = QuantizedTable(jnp.array([[2, -1], [0, 4]], jnp.int8),
        ...                        jnp.array([0.5, 0.25]))
        >>> matmul_transposed(jnp.array([[1.0, 2.0]]), table)
        Array([[0., 2.]], dtype=float32)
    """
    check_table(table)
    dtype = jnp.result_type(h)

    def product(values):
        return jnp.einsum(
            "...d,vd->...v",
            h,
            values.astype(dtype),
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    vocab_size, width = table.shape
    if jax.default_backend() != "cpu" or vocab_size <= CPU_BLOCK_ROWS:
        logits = product(table.values)
    else:
        # XLA:CPU converts the whole table slowly ahead of the matmul; a block
        # of rows at a time comes close to the float32 matmul's speed.
        blocks = -(-vocab_size // CPU_BLOCK_ROWS)
        values = jnp.pad(
            table.values, [(0, blocks * CPU_BLOCK_ROWS - vocab_size), (0, 0)]
        )
        logits = jax.lax.map(product, values.reshape(blocks, CPU_BLOCK_ROWS, width))
        logits = jnp.moveaxis(logits, 0, -2).reshape(*logits.shape[1:-1], -1)
        logits = logits[..., :vocab_size]
    return logits * jnp.asarray(table.scales, jnp.float32)
