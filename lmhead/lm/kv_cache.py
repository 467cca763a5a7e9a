"""The key/value cache of :class:`lmhead.lm.model.DecoderLM`: pieces and pointers.

:class:`DecodeCache` holds each layer's keys and values in pieces of 64, 64,
128, 256, ... slots (:func:`cache_segments`), of which attention reads the
shortest span that holds the longest row (:func:`attend_filled`), so that a
step costs what the cache holds, not its capacity. Rows may keep a pointer
per slot (``rows``), so that beam search reorders pointers, not keys and
values (:func:`reorder_cache`). docs/decoding.md, "The KV cache", gives the
design and its measurements.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks
from lmhead.lm.attention import softmax_weights

# The shortest span of cache slots that cached attention reads; the others
# double up to max_len.
MIN_SPAN = 64


class DecodeCache(NamedTuple):
    """Key/value cache of a :class:`~lmhead.lm.model.DecoderLM`; every leaf
    has leading axis B (docs/decoding.md, "The KV cache").

    Attributes:
        keys: ``num_layers`` tuples of arrays ``[B, H, n_j, Dh]`` (compute
            dtype), the pieces of :func:`cache_segments` in order: each layer's
            attention keys at every position written so far, slot ``s`` in the
            piece that covers it. Slots at or after ``index[b]`` are unused.
            :func:`cached_keys_values` joins them.
        values: the values, stored as ``keys``.
        index: ``int32[B]``: how many positions of row ``b`` are in the cache,
            which is also the position of the row's next token.
        rows: None (every row's slots are its own), or ``int32[B, max_len]``:
            row ``b``'s key and value at slot ``s`` are those that cache row
            ``rows[b, s]`` holds at slot ``s``.
        hidden: None, or (a cache of the MTP depths, ``init_cache(...,
            mtp=True)``) ``float32 [B, max_len, k + 1, D]``: at each fed
            position the trunk's residual stream and each depth's (the
            streams the depths' proposals start from). ``keys`` and
            ``values`` then hold ``num_layers + k`` layers, the depths' last.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    index: jax.Array
    rows: jax.Array | None = None
    hidden: jax.Array | None = None


def attention_spans(max_len: int) -> tuple[int, ...]:
    """The cache lengths cached attention may read: ``MIN_SPAN`` doubling to ``max_len``.

    Examples:
        >>> attention_spans(1024), attention_spans(100), attention_spans(16)
        ((64, 128, 256, 512, 1024), (64, 100), (16,))
    """
    spans = [min(MIN_SPAN, max_len)]
    while spans[-1] < max_len:
        spans.append(min(2 * spans[-1], max_len))
    return tuple(spans)


def cache_segments(max_len: int) -> tuple[int, ...]:
    """The lengths of the pieces a layer's cache is stored in: the first
    span, then what each next span adds (:func:`attention_spans`).

    Examples:
        >>> cache_segments(1024), cache_segments(100), cache_segments(16)
        ((64, 64, 128, 256, 512), (64, 36), (16,))
    """
    spans = attention_spans(max_len)
    return spans[:1] + tuple(b - a for a, b in zip(spans, spans[1:]))


def init_cache(model: Any, batch_size: int, *, mtp: bool = False) -> DecodeCache:
    """An empty :class:`DecodeCache` for ``batch_size`` rows (zeros, index 0,
    every row's slots its own) of ``model``, a
    :class:`~lmhead.lm.model.DecoderLM` (its ``num_layers``, ``num_heads``,
    ``d_model``, ``max_len`` and ``dtype`` give the shapes). ``mtp=True``
    adds the layers of its ``mtp_heads`` depths and their ``hidden``
    streams, which the model's steps then run (speculative decoding from the
    MTP heads); it needs ``mtp_heads >= 1``.

    Examples:
        >>> from lmhead.lm.model import DecoderLM
        >>> cache = init_cache(DecoderLM(vocab_size=17, num_layers=2, max_len=256), 3)
        >>> len(cache.keys), [piece.shape for piece in cache.keys[0]]
        (2, [(3, 4, 64, 32), (3, 4, 64, 32), (3, 4, 128, 32)])
        >>> cache.index, cache.rows
        (Array([0, 0, 0], dtype=int32), None)
    """
    depths = getattr(model, "mtp_heads", 0) if mtp else 0
    if mtp and not depths:
        raise ValueError(
            "mtp=True needs a model with MTP heads (mtp_heads >= 1); this one has none."
        )
    head_dim = model.d_model // model.num_heads
    # Distinct arrays for keys and values, so that the cache can be donated.
    layers = lambda: tuple(
        tuple(
            jnp.zeros((batch_size, model.num_heads, size, head_dim), model.dtype)
            for size in cache_segments(model.max_len)
        )
        for _ in range(model.num_layers + depths)
    )
    hidden = None
    if depths:
        shape = (batch_size, model.max_len, depths + 1, model.d_model)
        hidden = jnp.zeros(shape, jnp.float32)
    return DecodeCache(
        keys=layers(),
        values=layers(),
        index=jnp.zeros((batch_size,), jnp.int32),
        hidden=hidden,
    )


def write_slots(
    pieces: tuple[jax.Array, ...], new: jax.Array, positions: jax.Array
) -> tuple[jax.Array, ...]:
    """``pieces`` (``[B, H, n_j, Dh]``, :func:`cache_segments`) with ``new [B,
    T, H, Dh]`` written at slots ``positions [B, T]`` of each row; slots past
    the end are dropped.

    Examples:
        >>> pieces = (jnp.zeros((1, 1, 2, 1)), jnp.zeros((1, 1, 2, 1)))
        >>> new = jnp.array([[[[1.0]], [[2.0]], [[3.0]]]])  # [1, 3, 1, 1]
        >>> written = write_slots(pieces, new, jnp.array([[1, 2, 4]]))
        >>> [piece[0, 0, :, 0].tolist() for piece in written]  # slot 4 dropped
        [[0.0, 1.0], [2.0, 0.0]]
    """
    rows = jnp.arange(new.shape[0])[:, None]
    written, start = [], 0
    for piece in pieces:
        size = piece.shape[2]
        inside = (positions >= start) & (positions < start + size)
        # Slot `size` is out of bounds: positions in other pieces are dropped.
        local = jnp.where(inside, positions - start, size)
        written.append(piece.at[rows, :, local].set(new, mode="drop"))
        start += size
    return tuple(written)


def _gather_slots(piece: jax.Array, rows: jax.Array) -> jax.Array:
    """``piece [M, H, S, Dh]`` read through slot pointers ``rows [B, S]``:
    ``out[b, :, s] = piece[rows[b, s], :, s]``, ``[B, H, S, Dh]``."""
    heads = jnp.arange(piece.shape[1])[None, :, None]
    return piece[rows[:, None, :], heads, jnp.arange(piece.shape[2])]


def attend_filled(
    query: jax.Array,
    keys: tuple[jax.Array, ...],
    values: tuple[jax.Array, ...],
    rows: jax.Array | None,
    positions: jax.Array,
    dtype: Any,
) -> jax.Array:
    r"""Attention of ``query [B, T, H, Dh]`` at ``positions [B, T]`` over the
    cache slots ``<=`` each position: ``[B, T, H, Dh]``.

    .. math::
        \mathrm{out}_{bth} = \sum_{s \le p_{bt}} w_{bhts}\, v_{bsh}, \qquad
        w = \mathrm{softmax\_weights}(q, k, s \le p_{bt})

    ``keys`` and ``values`` are one layer's pieces (:func:`cache_segments`),
    already holding the positions being attended from; with ``rows`` (see
    :class:`DecodeCache`) row ``b``'s slot ``s`` is read from cache row
    ``rows[b, s]``. Only the first pieces, whole, that make the shortest span
    holding the longest row are read (docs/decoding.md, "The KV cache", says why).
    Weights are cast to ``dtype`` before they mix the values. A query at a
    negative position (an MTP depth's before its first, ``lmhead.lm.mtp``,
    whose output nothing reads) sees slot 0, so that its softmax is defined.

    Examples:
        >>> empty = (jnp.zeros((1, 1, 4, 2)),)  # B = 1, H = 1, 4 slots, Dh = 2
        >>> at = jnp.array([[0, 1]])
        >>> keys = write_slots(empty, jnp.ones((1, 2, 1, 2)), at)
        >>> values = write_slots(empty, jnp.array([[[[1.0, 0.0]], [[0.0, 1.0]]]]), at)
        >>> attend_filled(jnp.ones((1, 1, 1, 2)), keys, values, None,
        ...               jnp.array([[1]]), jnp.float32)  # equal keys: the mean
        Array([[[[0.5, 0.5]]]], dtype=float32)
    """
    sizes = [piece.shape[2] for piece in keys]
    starts = np.cumsum([0] + sizes[:-1])

    def read_piece(pieces, j):
        if rows is None:
            return pieces[j]
        # [B, H, n_j, Dh]: row b's own slots, wherever they lie.
        return _gather_slots(pieces[j], rows[:, starts[j] : starts[j] + sizes[j]])

    def attend_over(count):
        def first_pieces():
            span = starts[count - 1] + sizes[count - 1]
            visible = jnp.arange(span) <= jnp.maximum(positions, 0)[:, :, None]
            weights = softmax_weights(
                query, [read_piece(keys, j) for j in range(count)], visible, "bhsd"
            )
            weights = weights.astype(dtype)
            return sum(
                jnp.einsum(
                    "bhts,bhsd->bthd",
                    weights[..., starts[j] : starts[j] + sizes[j]],
                    read_piece(values, j).astype(dtype),
                )
                for j in range(count)
            )

        return first_pieces

    if len(sizes) == 1:
        return attend_over(1)()
    needed = jnp.max(positions) + 1
    spans = jnp.asarray(starts[1:].tolist() + [starts[-1] + sizes[-1]])
    which = jnp.minimum(jnp.searchsorted(spans, needed), len(sizes) - 1)
    return jax.lax.switch(
        which, [attend_over(count) for count in range(1, len(sizes) + 1)]
    )


def _slot_pointers(cache: DecodeCache) -> jax.Array:
    """``cache.rows``, or the pointers of a cache whose every row owns its slots."""
    if cache.rows is not None:
        return cache.rows
    batch, max_len = cache.index.shape[0], sum(p.shape[2] for p in cache.keys[0])
    return jnp.broadcast_to(
        jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, max_len)
    )


def reorder_cache(cache: DecodeCache, rows: jax.Array) -> DecodeCache:
    """The cache with its rows reordered: row ``i`` continues row ``rows[i]``.

    Beam search's reorder. No key or value moves: row ``i`` takes row
    ``rows[i]``'s ``index`` and slot pointers (:attr:`DecodeCache.rows`,
    made if the cache has none). Row ``i``'s next tokens are written into its
    own slots from ``index[rows[i]]`` on, which is safe when each row
    continues a row of its own length, ``index[rows] == index`` (as in beam
    search, where a prompt's beams all have the same length): no other row
    points at those slots yet. This is checked outside ``jit``.
    :func:`cached_keys_values` reads the result as a plainly reordered cache.

    Args:
        cache: a :class:`DecodeCache` of ``M`` rows.
        rows: ``int32 [M]``, the row each new row continues.

    Raises:
        ValueError: outside ``jit``, if ``index[rows] != index``.

    Examples:
        >>> from lmhead.lm.model import DecoderLM
        >>> model = DecoderLM(vocab_size=17, num_layers=1, d_model=8, num_heads=2,
        ...                   max_len=8)
        >>> cache = init_cache(model, 2)._replace(index=jnp.array([3, 3]))
        >>> cache = cache._replace(keys=((cache.keys[0][0].at[0].set(1.0),),))
        >>> moved = reorder_cache(cache, jnp.array([0, 0]))
        >>> moved.index, moved.rows[:, :4]
        (Array([3, 3], dtype=int32), Array([[0, 0, 0, 0],
               [0, 0, 0, 0]], dtype=int32))
        >>> keys, _ = cached_keys_values(moved)
        >>> keys[0][:, 0, :3, 0]
        Array([[1., 1., 1.],
               [1., 1., 1.]], dtype=float32)
    """
    if not _checks.is_traced(cache.index) and not _checks.is_traced(rows):
        index, order = np.asarray(cache.index), np.asarray(rows)
        if np.any(index[order] != index):
            raise ValueError(
                "rows must map each row to a row of the same length "
                f"(index[rows] == index); got index {index} and "
                f"rows {order}."
            )
    return cache._replace(
        index=jnp.take(cache.index, rows),
        rows=jnp.take(_slot_pointers(cache), rows, axis=0),
        hidden=None if cache.hidden is None else jnp.take(cache.hidden, rows, axis=0),
    )


def trim_cache(cache: DecodeCache, num_steps: int) -> DecodeCache:
    """The cache without the pieces that ``num_steps`` more tokens per row
    cannot reach (docs/decoding.md, "The KV cache").

    Row ``b``'s next ``num_steps`` tokens take slots ``index[b]`` to
    ``index[b] + num_steps - 1``; the pieces of :func:`cache_segments` that
    start at or after ``max(index) + num_steps`` hold nothing and are dropped
    (the first piece is always kept), with the slot pointers past them. The
    cache then reads, and decodes those steps, as before. With a traced
    ``index`` (inside ``jit``) the cache is returned as it is.

    Args:
        cache: a :class:`DecodeCache`.
        num_steps: an integer ``>= 0``.

    Raises:
        TypeError: ``num_steps`` is not an integer.
        ValueError: ``num_steps < 0``.

    Examples:
        >>> from lmhead.lm.model import DecoderLM
        >>> cache = init_cache(DecoderLM(vocab_size=17, num_layers=1, max_len=1024), 2)
        >>> cache = cache._replace(index=jnp.array([16, 30]))
        >>> [piece.shape[2] for piece in trim_cache(cache, 48).keys[0]]  # 30 + 48
        [64, 64]
        >>> [piece.shape[2] for piece in trim_cache(cache, 20).keys[0]]
        [64]
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)):
        raise TypeError(f"num_steps must be an integer >= 0; got {num_steps!r}.")
    if num_steps < 0:
        raise ValueError(f"num_steps must be an integer >= 0; got {num_steps}.")
    if _checks.is_traced(cache.index):
        return cache
    reach = int(np.max(np.asarray(cache.index), initial=0)) + num_steps
    starts = np.cumsum((0,) + tuple(piece.shape[2] for piece in cache.keys[0]))
    kept = max(1, int(np.sum(starts[:-1] < reach)))
    return cache._replace(
        keys=tuple(pieces[:kept] for pieces in cache.keys),
        values=tuple(pieces[:kept] for pieces in cache.values),
        rows=None if cache.rows is None else cache.rows[:, : starts[kept]],
    )


def rewind_cache(cache: DecodeCache, num_positions: jax.Array) -> DecodeCache:
    """The cache without each row's last ``num_positions[b]`` positions
    (``int32 [B]``, ``0 <= n_b <= index[b]``): ``index - num_positions``.

    Speculative decoding feeds a row its proposals and then keeps the
    accepted ones. What the dropped slots hold stays, unread: attention
    reads only the slots up to a query's position, each written by the
    call that feeds it before it is read; so do the MTP depths' layers, and
    ``hidden`` is read at ``index - 1``.

    Examples:
        >>> from lmhead.lm.model import DecoderLM
        >>> cache = init_cache(DecoderLM(vocab_size=17, num_layers=1, max_len=8), 2)
        >>> cache = cache._replace(index=jnp.array([5, 7]))
        >>> rewind_cache(cache, jnp.array([2, 0])).index
        Array([3, 7], dtype=int32)
    """
    return cache._replace(index=(cache.index - num_positions).astype(jnp.int32))


def reset_rows(cache: DecodeCache, rows: jax.typing.ArrayLike) -> DecodeCache:
    """The cache with the rows where ``rows`` is True emptied: their
    ``index`` back to 0, so that their next token takes position 0 (what the
    slots held stays, unread: attention reads only the slots before
    ``index``). Continuous batching (:mod:`lmhead.decoding.slots`) resets the
    rows no request holds, which would otherwise step past ``max_len``.

    Args:
        cache: a :class:`DecodeCache` without slot pointers (``rows`` None).
        rows: ``bool [B]``.

    Examples:
        >>> from lmhead.lm.model import DecoderLM
        >>> cache = init_cache(DecoderLM(vocab_size=17, num_layers=1, max_len=8), 3)
        >>> cache = cache._replace(index=jnp.array([5, 7, 2]))
        >>> reset_rows(cache, jnp.array([False, True, False])).index
        Array([5, 0, 2], dtype=int32)
    """
    if cache.rows is not None:
        raise ValueError("reset_rows needs a cache without slot pointers (rows None).")
    if jnp.shape(rows) != cache.index.shape:
        raise ValueError(
            f"rows must have shape [B] = {cache.index.shape}; got {jnp.shape(rows)}."
        )
    return cache._replace(index=jnp.where(rows, 0, cache.index).astype(jnp.int32))


def repeat_cache(cache: DecodeCache, repeats: int) -> DecodeCache:
    """Each row repeated ``repeats`` times: row ``b * repeats + k`` continues row ``b``.

    A cache without pointers (``rows`` None) is copied, row by row. With
    pointers, the copies share their prefix instead: keys and values are
    written once, into row ``b * repeats``, every copy's pointers lead there,
    and the other rows start empty, for the slots each copy will write.
    Sampling's ``num_samples`` and beam search use it (through
    ``inference.DecodeStep``'s ``repeat``; beam search adds pointers first).

    Raises:
        ValueError: ``repeats`` is not an integer ``>= 1``.

    Examples:
        >>> from lmhead.lm.model import DecoderLM
        >>> cache = init_cache(DecoderLM(vocab_size=17, num_layers=1, max_len=4), 2)
        >>> cache = cache._replace(index=jnp.array([1, 2]))
        >>> repeat_cache(cache, 2).index
        Array([1, 1, 2, 2], dtype=int32)
        >>> repeat_cache(reorder_cache(cache, jnp.arange(2)), 2).rows
        Array([[0, 0, 0, 0],
               [0, 0, 0, 0],
               [2, 2, 2, 2],
               [2, 2, 2, 2]], dtype=int32)
    """
    _checks.check_count("repeats", repeats)
    if cache.rows is None:
        return jax.tree.map(lambda x: jnp.repeat(x, repeats, axis=0), cache)

    def spread(x):
        empty = jnp.zeros((x.shape[0], repeats - 1) + x.shape[1:], x.dtype)
        both = jnp.concatenate([x[:, None], empty], axis=1)
        return both.reshape((x.shape[0] * repeats,) + x.shape[1:])

    return DecodeCache(
        keys=jax.tree.map(spread, cache.keys),
        values=jax.tree.map(spread, cache.values),
        index=jnp.repeat(cache.index, repeats),
        rows=jnp.repeat(cache.rows, repeats, axis=0) * repeats,
        hidden=None if cache.hidden is None else jnp.repeat(cache.hidden, repeats, 0),
    )


def cached_keys_values(
    cache: DecodeCache,
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Each row's keys and values, pieces joined and pointers resolved.

    ``keys[l][b, :, s]`` is the key that attention reads for row ``b`` at
    slot ``s``: slot ``s`` of cache row ``cache.rows[b, s]`` (of row ``b``
    without pointers); the same of the values. Slots at or after ``index[b]``
    hold whatever is stored there.

    Returns:
        ``(keys, values)``, each ``num_layers`` arrays ``[B, H, max_len, Dh]``.

    Examples:
        >>> from lmhead.lm.model import DecoderLM
        >>> cache = init_cache(DecoderLM(vocab_size=17, num_layers=1, max_len=128), 2)
        >>> keys, values = cached_keys_values(cache)
        >>> keys[0].shape
        (2, 4, 128, 32)
    """
    rows = _slot_pointers(cache)
    resolve = lambda pieces: _gather_slots(jnp.concatenate(pieces, axis=2), rows)
    return (tuple(map(resolve, cache.keys)), tuple(map(resolve, cache.values)))
