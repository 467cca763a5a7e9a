"""Tests of the key/value cache: spans and pieces, slot writes and reads,
attention over the filled slots, and rows moved by pointers.

References: numpy written here (a plain [B, H, max_len, Dh] cache, indexed by
hand), and the model's own full forward pass (for cached decoding).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from lmhead.lm import inference, kv_cache
from tests.errors import bad_input_test
from tests.lm.tiny_decoder import (
    HEADS,
    MAX_LEN,
    WIDTH,
    forward,
    init_params,
    random_tokens,
    small_model,
)


@pytest.mark.parametrize("max_len", [1, 16, 64, 65, 100, 1000, 1024])
def test_spans_double_up_to_max_len_and_pieces_tile_them(max_len):
    spans = kv_cache.attention_spans(max_len)
    assert spans[0] == min(kv_cache.MIN_SPAN, max_len) and spans[-1] == max_len
    for shorter, longer in zip(spans, spans[1:]):
        assert longer == min(2 * shorter, max_len)
    np.testing.assert_array_equal(
        np.cumsum(kv_cache.cache_segments(max_len)), np.asarray(spans)
    )


def test_init_cache_is_empty_in_the_compute_dtype_with_distinct_arrays():
    model = small_model(max_len=256, dtype=jnp.bfloat16)
    cache = kv_cache.init_cache(model, 3)
    assert len(cache.keys) == len(cache.values) == model.num_layers
    for pieces in cache.keys + cache.values:
        assert [p.shape for p in pieces] == [
            (3, HEADS, size, WIDTH // HEADS) for size in (64, 64, 128)
        ]
        assert all(p.dtype == jnp.bfloat16 and not p.any() for p in pieces)
    np.testing.assert_array_equal(cache.index, [0, 0, 0])
    assert cache.index.dtype == jnp.int32 and cache.rows is None
    # Distinct buffers, so that a decoding loop may donate the cache.
    leaves = jax.tree.leaves((cache.keys, cache.values))
    assert len({id(leaf) for leaf in leaves}) == len(leaves)


def random_pieces(seed, batch=2, heads=2, sizes=(4, 4, 8), head_dim=3):
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal((batch, heads, n, head_dim)), jnp.float32)
        for n in sizes
    )


def joined(pieces):
    return np.concatenate([np.asarray(p) for p in pieces], axis=2)


def test_write_slots_writes_each_rows_positions_and_drops_those_past_the_end():
    pieces = random_pieces(0)
    new = np.random.default_rng(1).standard_normal((2, 3, 2, 3)).astype(np.float32)
    positions = np.array([[3, 4, 5], [14, 15, 16]])  # 16 is past the end
    written = kv_cache.write_slots(pieces, jnp.asarray(new), jnp.asarray(positions))
    assert [p.shape for p in written] == [p.shape for p in pieces]
    expected = joined(pieces)
    for b in range(2):
        for t in range(3):
            if positions[b, t] < 16:
                expected[b, :, positions[b, t]] = new[b, t]
    np.testing.assert_array_equal(joined(written), expected)


def numpy_attention(query, keys, values, rows, positions):
    """Softmax attention over a plain cache ``[M, H, S, Dh]`` whose row ``b``
    reads slot ``s`` from row ``rows[b, s]``."""
    slots = np.arange(keys.shape[2])
    k = keys[rows, :, slots].transpose(0, 2, 1, 3)  # [B, H, S, Dh]
    v = values[rows, :, slots].transpose(0, 2, 1, 3)
    scores = np.einsum("bthd,bhsd->bhts", query, k) / np.sqrt(query.shape[-1])
    visible = slots[None, None, None, :] <= positions[:, None, :, None]
    weights = special.softmax(np.where(visible, scores, -np.inf), axis=-1)
    return np.einsum("bhts,bhsd->bthd", weights, v)


@pytest.mark.parametrize("pointers", [False, True], ids=["own", "pointers"])
def test_attend_filled_matches_numpy_and_reads_only_the_span_it_needs(pointers):
    keys, values = random_pieces(2), random_pieces(3)
    query = np.random.default_rng(4).standard_normal((2, 2, 2, 3)).astype(np.float32)
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 2, (2, 16)).astype(np.int32) if pointers else None
    plain_rows = rows if pointers else np.repeat(np.arange(2)[:, None], 16, axis=1)
    attend = jax.jit(kv_cache.attend_filled, static_argnums=5)  # one compile
    for positions in ([[0, 1], [2, 3]], [[3, 7], [0, 5]], [[9, 15], [2, 12]]):
        positions = np.asarray(positions)
        got = attend(
            jnp.asarray(query),
            keys,
            values,
            None if rows is None else jnp.asarray(rows),
            jnp.asarray(positions),
            jnp.float32,
        )
        want = numpy_attention(
            query.astype(np.float64),
            joined(keys).astype(np.float64),
            joined(values).astype(np.float64),
            plain_rows,
            positions,
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Positions below 4 read the first piece only: NaN in the others is unread.
    nan_after = lambda pieces: pieces[:1] + tuple(p * np.nan for p in pieces[1:])
    got = attend(
        jnp.asarray(query),
        nan_after(keys),
        nan_after(values),
        None if rows is None else jnp.asarray(rows),
        jnp.array([[0, 3], [1, 2]]),
        jnp.float32,
    )
    assert np.all(np.isfinite(got))


def test_cached_keys_values_resolve_the_pointers():
    cache = kv_cache.DecodeCache(
        keys=(random_pieces(6, batch=3),),
        values=(random_pieces(7, batch=3),),
        index=jnp.array([5, 5, 5]),
        rows=jnp.asarray(np.random.default_rng(8).integers(0, 3, (3, 16)), jnp.int32),
    )
    keys, values = kv_cache.cached_keys_values(cache)
    slots = np.arange(16)
    for got, pieces in ((keys[0], cache.keys[0]), (values[0], cache.values[0])):
        want = joined(pieces)[np.asarray(cache.rows), :, slots].transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(got, want)


@pytest.fixture
def small_spans(monkeypatch):
    """Attention spans (4, 8, 16) instead of (16,), so that decoding crosses
    span boundaries; compiled steps are dropped before and after."""
    jax.clear_caches()
    monkeypatch.setattr(kv_cache, "MIN_SPAN", 4)
    yield
    jax.clear_caches()


@pytest.mark.parametrize("positions,tied", [("learned", True), ("rope", False)])
def test_cached_decoding_matches_recomputing_the_prefix(positions, tied, small_spans):
    """Rows of different lengths; the longest crosses the spans 4 and 8."""
    assert kv_cache.attention_spans(MAX_LEN) == (4, 8, 16)
    model = small_model(positions=positions, tied=tied)
    params = init_params(model, noise=0.2)
    lengths = np.array([5, 2, 3])
    num_steps = MAX_LEN - lengths.max()  # the longest row fills the cache
    prompt = random_tokens((3, 5), seed=1)  # positions past lengths are padding
    fed = random_tokens((3, num_steps), seed=2)
    logits, cache = inference.prefill(
        model, params, prompt, jnp.asarray(lengths), max_new_tokens=num_steps
    )
    step_fn = inference.make_step_fn(model)
    sequences = [list(np.asarray(prompt[b, :n])) for b, n in enumerate(lengths)]
    for step in range(num_steps + 1):
        padded = np.zeros((3, MAX_LEN), np.int32)
        for b, sequence in enumerate(sequences):
            padded[b, : len(sequence)] = sequence
        full = forward(model, params, jnp.asarray(padded))
        last = [len(sequence) - 1 for sequence in sequences]
        np.testing.assert_allclose(
            logits,
            full[np.arange(3), last],
            rtol=1e-5,
            atol=1e-5,
            err_msg=f"step {step}",
        )
        if step == num_steps:
            break
        logits, cache = step_fn(params, fed[:, step], cache)
        for b, sequence in enumerate(sequences):
            sequence.append(int(fed[b, step]))
    np.testing.assert_array_equal(cache.index, lengths + num_steps)


def test_cache_leaves_lead_with_the_batch_axis_and_rows_can_be_reordered(small_spans):
    """The pointer reorder reads as a copy of the rows, before and after
    steps that write past it, across the pieces of the cache (4, 4, 8)."""
    model = small_model()
    params = init_params(model, noise=0.2)
    logits, cache = inference.prefill(model, params, random_tokens((3, 5)))
    assert all(leaf.shape[0] == 3 for leaf in jax.tree.leaves(cache))
    assert [piece.shape for piece in cache.keys[0]] == [
        (3, HEADS, size, WIDTH // HEADS) for size in (4, 4, 8)
    ]
    step_fn = inference.make_step_fn(model)
    copied, reordered = cache, cache
    for step, order in enumerate(([1, 1, 0], [2, 0, 0], [0, 2, 1])):
        order = jnp.array(order)
        copied = jax.tree.map(lambda leaf: leaf[order], copied)
        reordered = step_fn.reorder(reordered, order)
        np.testing.assert_array_equal(reordered.index, copied.index)
        filled = 5 + step
        for got, want in zip(
            kv_cache.cached_keys_values(reordered),
            kv_cache.cached_keys_values(copied),
        ):
            for got_layer, want_layer in zip(got, want):
                np.testing.assert_array_equal(
                    got_layer[:, :, :filled], want_layer[:, :, :filled]
                )
        tokens = random_tokens((3,), seed=step)
        copied_logits, copied = step_fn(params, tokens, copied)
        reordered_logits, reordered = step_fn(params, tokens, reordered)
        np.testing.assert_allclose(
            reordered_logits, copied_logits, rtol=1e-6, atol=1e-6
        )


def test_repeat_cache_copies_or_shares_the_prefix():
    model = small_model()
    params = init_params(model, noise=0.2)
    logits, cache = inference.prefill(
        model, params, random_tokens((2, 5)), jnp.array([5, 3])
    )
    step_fn = inference.make_step_fn(model)
    tokens = random_tokens((4,), seed=3)
    want, _ = step_fn(
        params, tokens, jax.tree.map(lambda x: jnp.repeat(x, 2, 0), cache)
    )
    for source in (cache, kv_cache.reorder_cache(cache, jnp.arange(2))):
        repeated = step_fn.repeat(source, 2)
        assert (repeated.rows is None) == (source.rows is None)
        got, _ = step_fn(params, tokens, repeated)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_trim_cache_drops_the_pieces_no_step_reaches_and_decodes_the_same(
    small_spans,
):
    """Pieces (4, 4, 8): rows at 5 and 2 reach slot 7 in 3 steps (2 pieces)
    and slot 8 in 4 (all 3); decoding the 3 steps through the trimmed cache,
    with pointers too, gives the logits of the whole one."""
    model = small_model()
    params = init_params(model, noise=0.2)
    logits, cache = inference.prefill(
        model, params, random_tokens((2, 5)), jnp.array([5, 2])
    )
    sizes = lambda c: [piece.shape[2] for piece in c.keys[0]]
    assert sizes(kv_cache.trim_cache(cache, 4)) == [4, 4, 8]
    assert sizes(kv_cache.trim_cache(cache, 0)) == [4, 4]
    assert sizes(kv_cache.trim_cache(cache._replace(index=jnp.array([1, 2])), 2)) == [4]
    step_fn = inference.make_step_fn(model)
    for whole in (cache, kv_cache.reorder_cache(cache, jnp.arange(2))):
        trimmed = step_fn.trim(whole, 3)
        assert sizes(trimmed) == [4, 4]
        assert all(len(pieces) == 2 for pieces in trimmed.keys + trimmed.values)
        if whole.rows is not None:
            np.testing.assert_array_equal(trimmed.rows, whole.rows[:, :8])
        for step in range(3):
            tokens = random_tokens((2,), seed=10 + step)
            want, whole = step_fn(params, tokens, whole)
            got, trimmed = step_fn(params, tokens, trimmed)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Inside jit the reach is unknown: nothing is dropped.
    traced = jax.jit(lambda c: kv_cache.trim_cache(c, 0).keys[0][-1].shape[2])
    assert traced(cache) == 8


def empty_cache(index=(0, 0)):
    return kv_cache.init_cache(small_model(), 2)._replace(index=jnp.array(index))


BAD_INPUTS = [
    *[
        (f"repeat_cache repeats {r!r}", lambda r=r: kv_cache.repeat_cache(
            empty_cache(), r), error, "repeats")
        for r, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError),
                         ("2", TypeError))
    ],
    *[
        (f"trim_cache num_steps {n!r}", lambda n=n: kv_cache.trim_cache(
            empty_cache(), n), error, "num_steps")
        for n, error in ((-1, ValueError), (1.0, TypeError))
    ],
    ("reorder_cache rows of other lengths",
     lambda: kv_cache.reorder_cache(empty_cache((4, 2)), jnp.array([0, 0])),
     ValueError, ("rows", "same length")),
]  # fmt: skip
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
