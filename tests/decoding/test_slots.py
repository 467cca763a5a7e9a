"""Tests for continuous batching's slots (lmhead/decoding/slots.py): rows
that enter and leave the slots between calls decode as a numpy reference
decodes each row by itself: the model's full forward pass (no cache), the
processors in float64, greedy or the draw with ``fold_in(fold_in(key, 0),
t)`` at step ``t`` (the key of sample 0, as ``generate`` folds it), the model's log-softmax and its top tokens."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import inference, kv_cache
from lmhead.lm import model as model_lib
from tests.decoding.references import (
    np_min_p_mask,
    np_openai_penalties,
    np_repetition_penalty,
    np_top_k_mask,
    np_top_p_mask,
    stop_step_on_bytes,
)
from tests.errors import assert_raises_exactly, keyword_rows
from tests.references import log_softmax as np_log_softmax

MAX_LEN = 24
VOCAB = 11
SLOTS = 3
TOP = 3


@pytest.fixture(scope="module")
def lm():
    model = model_lib.DecoderLM(
        vocab_size=VOCAB, num_layers=1, num_heads=2, d_model=16, mlp_dim=32,
        max_len=MAX_LEN,
    )  # fmt: skip
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))[
        "params"
    ]
    return model, params, inference.make_step_fn(model)


# (prompt, limit, knobs): greedy and sampled rows, each knob that reads the
# history or the counts, a bias.
ROWS = [
    ([1, 2, 3], 7, decoding.SamplingKnobs(temperature=0.0)),
    ([4], 3, decoding.SamplingKnobs(temperature=1.3, top_k=5)),
    ([5, 6, 7, 8, 9], 10, decoding.SamplingKnobs(top_p=0.9, repetition_penalty=1.4)),
    ([2, 2], 5, decoding.SamplingKnobs(presence_penalty=0.7, frequency_penalty=0.4)),
    ([3, 1, 4, 1], 6, decoding.SamplingKnobs(min_p=0.05, min_new_tokens=4)),
    (
        [7, 7, 7],
        8,
        decoding.SamplingKnobs(logit_bias=np.linspace(-2, 2, VOCAB, dtype=np.float32)),
    ),
]


# The model's tokens as bytes, for stop strings: strings split across tokens,
# end inside one ("c\n") and hold a character split in two ("é" = c3 a9).
TOKEN_BYTES = [
    b"a",
    b"b",
    b"ab",
    b"\n",
    b"c\n",
    b"\xc3",
    b"\xa9",
    b"de",
    b"e",
    b" ",
    b".",
]
STOP_CAPACITY = dict(max_bytes=6, max_strings=2)
ONE_STOP = decoding.encode_stop_strings([["ab"]], **STOP_CAPACITY)


def empty_slots(model, stops=False):
    """``SLOTS`` free slots (their keys are replaced when a row fills one),
    with a stop-string table of ``STOP_CAPACITY`` if ``stops``."""
    table = None
    if stops:
        table = decoding.StopStrings.build([[]] * SLOTS, TOKEN_BYTES, **STOP_CAPACITY)
    return decoding.empty_slots(
        kv_cache.init_cache(model, SLOTS), vocab_size=VOCAB, history_len=MAX_LEN,
        key=jax.random.key(0), stop=table,
    )  # fmt: skip


def np_processed(z, knobs, history, generated, eos_id):
    """The processors in their documented order, in float64: repetition
    penalty (prompt and generated tokens), presence and frequency penalties
    (generated), bias, EOS and the stop tokens banned before
    ``min_new_tokens``; temperature; top-k, top-p, min-p."""
    value = lambda name, neutral: neutral if getattr(knobs, name) is None else (
        np.asarray(getattr(knobs, name), np.float64)
    )  # fmt: skip
    z = np_repetition_penalty(z[None], [history], value("repetition_penalty", 1.0))
    z = np_openai_penalties(
        z, [generated], value("presence_penalty", 0.0),
        value("frequency_penalty", 0.0), value("logit_bias", 0.0),
    )[0]  # fmt: skip
    if len(generated) < (knobs.min_new_tokens or 0):
        z[list(np_stop_tokens(knobs)) + ([] if eos_id is None else [eos_id])] = -np.inf
    temperature = float(knobs.temperature)
    if temperature == 0:
        return z
    z = z / temperature
    for name, mask in (("top_k", np_top_k_mask), ("top_p", np_top_p_mask)):
        if getattr(knobs, name) is not None:
            z = np.where(mask(z[None], getattr(knobs, name))[0], z, -np.inf)
    if knobs.min_p is not None:
        z = np.where(np_min_p_mask(z[None], knobs.min_p)[0], z, -np.inf)
    return z


def np_stop_tokens(knobs):
    return () if knobs.stop_tokens is None else np.flatnonzero(knobs.stop_tokens)


def reference(lm, prompt, limit, knobs, key, eos_id=None):
    """The row decoded by itself in numpy (module docstring): its tokens,
    log-probs, top tokens and finish reason."""
    model, params, _ = lm
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
    sequence, out = list(prompt), dict(tokens=[], log_probs=[], top=[])
    reason = decoding.FINISHED_LENGTH
    for step in range(limit):
        padded = np.zeros([1, MAX_LEN], np.int32)
        padded[0, : len(sequence)] = sequence
        z = np.asarray(forward(padded)[0, len(sequence) - 1], np.float64)
        processed = np_processed(z, knobs, sequence, out["tokens"], eos_id)
        if float(knobs.temperature) == 0:
            token = int(np.argmax(processed))
        else:
            # Sample 0's key is fold_in(key, 0), as generate's for one sample.
            step_key = jax.random.fold_in(jax.random.fold_in(key, 0), step)
            token = int(jax.random.categorical(step_key, processed.astype(np.float32)))
        out["tokens"].append(token)
        out["log_probs"].append(np_log_softmax(z)[token])
        out["top"].append(np.argsort(-z, kind="stable")[:TOP].tolist())
        sequence.append(token)
        if token == eos_id:
            reason = decoding.FINISHED_EOS
            break
        if token in np_stop_tokens(knobs):
            reason = decoding.FINISHED_STOP
            break
    return out, reason


def run_slots(lm, rows, keys, *, num_steps, eos_id=None, stops=None):
    """Every row through the slots: waiting rows fill free slots (oldest
    first, two at most per fill) before each call, with their ``stops[i]``
    stop strings if given. Returns each row's tokens, log-probs, top tokens
    and finish reason, and the calls made."""
    model, params, step_fn = lm
    state = empty_slots(model, stops=stops is not None)
    waiting, holder = list(range(len(rows))), [None] * SLOTS
    out = {i: dict(tokens=[], log_probs=[], top=[], reason=None) for i in waiting}
    calls = 0
    while waiting or any(h is not None for h in holder):
        free = [s for s in range(SLOTS) if holder[s] is None]
        entering = waiting[: min(len(free), 2)]
        if entering:
            del waiting[: len(entering)]
            width = max(len(rows[i][0]) for i in entering)
            prompts = np.full([len(entering), width], -1, np.int32)
            for j, i in enumerate(entering):
                prompts[j, : len(rows[i][0])] = rows[i][0]
            lengths = np.array([len(rows[i][0]) for i in entering])
            logits, cache = inference.prefill(
                model, params, np.maximum(prompts, 0), lengths
            )
            full = [decoding.full_knobs(rows[i][2], 1, VOCAB) for i in entering]
            strings = None
            if stops is not None:
                strings = decoding.encode_stop_strings(
                    [stops[i] for i in entering], **STOP_CAPACITY
                )
            state = decoding.fill_slots(
                state, np.array(free[: len(entering)]), logits, cache,
                keys=keys[np.array(entering)],
                max_new_tokens=np.array([rows[i][1] for i in entering]),
                prompt_tokens=prompts,
                knobs=jax.tree.map(lambda *v: np.concatenate(v), *full),
                stop_strings=strings,
            )  # fmt: skip
            for slot, i in zip(free, entering):
                holder[slot] = i
        state, chunk = decoding.step_slots(
            step_fn, params, state, num_steps=num_steps, eos_id=eos_id,
            top_logprobs=TOP,
        )  # fmt: skip
        chunk = jax.device_get(chunk)
        calls += 1
        for slot, i in enumerate(holder):
            if i is None:
                continue
            n = int(chunk.emitted[slot].sum())
            assert chunk.emitted[slot, :n].all()  # emitted steps come first
            out[i]["tokens"] += chunk.tokens[slot, :n].tolist()
            out[i]["log_probs"] += chunk.log_probs[slot, :n].tolist()
            out[i]["top"] += chunk.top_tokens[slot, :n].tolist()
            if chunk.generated[slot] >= chunk.limits[slot]:
                out[i]["reason"] = int(chunk.finish_reasons[slot])
                holder[slot] = None
    return out, calls, state


@pytest.mark.parametrize("num_steps", [1, 4])
def test_rows_that_join_and_leave_decode_as_the_numpy_reference(lm, num_steps):
    keys = jax.random.split(jax.random.key(5), len(ROWS))
    out, calls, state = run_slots(lm, ROWS, keys, num_steps=num_steps)
    assert calls < sum(limit for _, limit, _ in ROWS)  # rows shared calls
    for i, (prompt, limit, knobs) in enumerate(ROWS):
        want, reason = reference(lm, prompt, limit, knobs, keys[i])
        assert out[i]["tokens"] == want["tokens"], i
        np.testing.assert_allclose(out[i]["log_probs"], want["log_probs"], atol=1e-5)
        assert out[i]["top"] == want["top"]
        assert out[i]["reason"] == reason == decoding.FINISHED_LENGTH
    # The freed slots' cache rows were emptied, not run past max_len.
    assert int(jnp.max(state.model_state.index)) <= MAX_LEN


def test_eos_ends_a_row_and_is_emitted(lm):
    keys = jax.random.split(jax.random.key(2), 2)
    rows = [ROWS[0], ROWS[4]]  # greedy; min_new_tokens 4 holds EOS back
    first, _ = reference(lm, *rows[0], keys[0])
    eos = first["tokens"][2]
    out, _, _ = run_slots(lm, rows, keys, num_steps=2, eos_id=eos)
    for i, row in enumerate(rows):
        want, reason = reference(lm, *row, keys[i], eos_id=eos)
        assert out[i]["tokens"] == want["tokens"]
        assert out[i]["reason"] == reason
    assert out[0]["tokens"][-1] == eos
    assert out[0]["reason"] == decoding.FINISHED_EOS


def test_each_rows_stop_tokens_end_it_after_min_new_tokens(lm):
    """The ``stop_tokens`` knob, one set per row (vLLM's ``stop_token_ids``,
    and EOS held per row): the row emits the token and stops; before
    ``min_new_tokens`` the tokens cannot be drawn."""
    keys = jax.random.split(jax.random.key(4), 3)
    first, _ = reference(lm, *ROWS[0], keys[0])
    stops = decoding.stop_token_mask(first["tokens"][:1], VOCAB)
    rows = [
        (ROWS[0][0], 7, decoding.SamplingKnobs(temperature=0.0, stop_tokens=stops)),
        (ROWS[0][0], 7, decoding.SamplingKnobs(temperature=0.0, stop_tokens=stops,
                                               min_new_tokens=5)),
        ROWS[1],  # sampled, no stop tokens beside the others
    ]  # fmt: skip
    out, _, _ = run_slots(lm, rows, keys, num_steps=2)
    for i, row in enumerate(rows):
        want, reason = reference(lm, *row, keys[i])
        assert out[i]["tokens"] == want["tokens"], i
        np.testing.assert_allclose(out[i]["log_probs"], want["log_probs"], atol=1e-5)
        assert out[i]["reason"] == reason
    assert out[0]["tokens"] == first["tokens"][:1]
    assert out[0]["reason"] == decoding.FINISHED_STOP
    assert len(out[1]["tokens"]) >= 5 and first["tokens"][0] not in out[1]["tokens"][:5]


def test_stop_strings_end_each_row_at_the_token_that_completes_one(lm):
    """Each row's own strings, matched in the step: the row emits the token
    that completes one (from ``min_new_tokens`` tokens on) and ends there,
    in the call it completes it, whatever other rows' strings; a row that
    fills a slot does not inherit its last holder's strings or bytes."""
    keys = jax.random.split(jax.random.key(6), 6)
    rows = [ROWS[1], ROWS[2], ROWS[3], ROWS[5], ROWS[4], ROWS[0]]
    plain = [reference(lm, *row, keys[i])[0]["tokens"] for i, row in enumerate(rows)]
    text = [b"".join(TOKEN_BYTES[t] for t in ids) for ids in plain]

    def piece(b, start, length):  # the first valid UTF-8 piece from start on
        for k in range(start, len(text[b])):
            with contextlib.suppress(UnicodeDecodeError):
                return text[b][k : k + length].decode()

    stops = [
        [piece(0, 0, 1)],
        [piece(1, 3, 3), "zz"],  # across tokens, ending inside one
        [],  # none: the slot of a row that had some
        [piece(3, 3, 3), "zz"],
        [piece(4, 0, 1)],  # before min_new_tokens 4: a later one, or none
        [piece(5, 0, 2)],
    ]
    out, _, _ = run_slots(lm, rows, keys, num_steps=3, stops=stops)
    ends = []
    for i, (row, ids) in enumerate(zip(rows, plain, strict=True)):
        min_new_tokens = int(row[2].min_new_tokens or 0)
        end = stop_step_on_bytes(ids, stops[i], TOKEN_BYTES, min_new_tokens)
        ends.append(end)
        length = len(ids) if end is None else end + 1
        assert out[i]["tokens"] == ids[:length], i
        reason = decoding.FINISHED_LENGTH if end is None else decoding.FINISHED_STOP
        assert out[i]["reason"] == reason, i
    cut = [end is not None and end + 1 < len(ids) for end, ids in zip(ends, plain)]
    assert sum(cut) >= 3, ends
    early = stop_step_on_bytes(plain[4], stops[4], TOKEN_BYTES)
    assert early is not None and early < 3 and ends[4] != early


def test_free_slots_stay_empty_and_freed_rows_stop(lm):
    model, params, step_fn = lm
    state = empty_slots(model)
    # More steps than max_len: each step of a free slot writes position 0.
    for _ in range(MAX_LEN // 4 + 1):
        state, chunk = decoding.step_slots(step_fn, params, state, num_steps=4)
        assert not np.asarray(chunk.emitted).any()
    np.testing.assert_array_equal(state.model_state.index, 1)
    logits, cache = inference.prefill(model, params, jnp.array([[1, 2], [3, 4]]))
    state = decoding.fill_slots(
        state, np.array([0, 1]), logits, cache,
        keys=jax.random.split(jax.random.key(1), 2),
        max_new_tokens=np.array([9, 9]), prompt_tokens=np.array([[1, 2], [3, 4]]),
        knobs=decoding.full_knobs(decoding.SamplingKnobs(), 2, VOCAB),
    )  # fmt: skip
    state, chunk = decoding.step_slots(step_fn, params, state, num_steps=4)
    state = decoding.free_slots(state, np.array([1, SLOTS]))  # SLOTS: ignored
    state, chunk = decoding.step_slots(step_fn, params, state, num_steps=4)
    np.testing.assert_array_equal(np.asarray(chunk.emitted).sum(1), [4, 0, 0])
    np.testing.assert_array_equal(chunk.generated, [8, 4, 0])
    np.testing.assert_array_equal(state.model_state.index, [10, 1, 1])


def test_free_slots_take_a_typed_or_a_raw_key(lm):
    """``empty_slots`` takes ``jax.random.PRNGKey``'s raw key data as it takes
    a typed key: a fill then starts a row in either, and it decodes alike."""
    model, params, step_fn = lm
    logits, cache = inference.prefill(model, params, jnp.array([[1, 2]]))
    chunks = []
    for key in (jax.random.key(0), jax.random.PRNGKey(0)):
        state = decoding.empty_slots(
            kv_cache.init_cache(model, SLOTS), vocab_size=VOCAB, history_len=MAX_LEN,
            key=key,
        )  # fmt: skip
        assert jnp.issubdtype(state.rows.key.dtype, jax.dtypes.prng_key)
        state = decoding.fill_slots(
            state, np.array([1]), logits, cache,
            keys=jax.random.split(jax.random.key(1), 1), max_new_tokens=np.array([5]),
            prompt_tokens=np.array([[1, 2]]),
            knobs=decoding.full_knobs(decoding.SamplingKnobs(temperature=1.0), 1, VOCAB),
        )  # fmt: skip
        chunks.append(decoding.step_slots(step_fn, params, state, num_steps=3)[1])
    np.testing.assert_array_equal(chunks[0].tokens, chunks[1].tokens)
    assert np.asarray(chunks[0].emitted)[1].all()
    for bad in (np.zeros((3,), np.uint32), jax.random.split(jax.random.key(0), 2)):
        with pytest.raises(ValueError, match="key must be one PRNG key"):
            decoding.empty_slots(
                kv_cache.init_cache(model, SLOTS), vocab_size=VOCAB,
                history_len=MAX_LEN, key=bad,
            )  # fmt: skip


def test_a_row_with_nonfinite_logits_ends_without_a_token(lm):
    """The documented rule: a running row whose logits hold a NaN (or are
    all -inf) emits nothing and ends (FINISHED_BAD_LOGITS, its limit set to
    what it has generated); the other rows decode on."""
    model, params, step_fn = lm
    prompts = np.array([[1, 2], [3, 4], [5, 6]])
    logits, cache = inference.prefill(model, params, prompts)
    logits = np.array(logits)
    logits[0, 3], logits[2] = np.nan, -np.inf
    state = decoding.fill_slots(
        empty_slots(model), np.arange(SLOTS), logits, cache,
        keys=jax.random.split(jax.random.key(1), SLOTS),
        max_new_tokens=np.array([5, 5, 5]), prompt_tokens=prompts,
        knobs=decoding.full_knobs(decoding.SamplingKnobs(temperature=0.0), 3, VOCAB),
    )  # fmt: skip
    _, chunk = decoding.step_slots(step_fn, params, state, num_steps=3, top_logprobs=2)
    np.testing.assert_array_equal(np.asarray(chunk.emitted).sum(1), [0, 3, 0])
    np.testing.assert_array_equal(chunk.generated, [0, 3, 0])
    np.testing.assert_array_equal(chunk.limits, [0, 5, 0])
    bad = decoding.FINISHED_BAD_LOGITS
    np.testing.assert_array_equal(chunk.finish_reasons, [bad, 0, bad])
    for silent in (0, 2):  # what a slot writes where it emits nothing
        assert not np.asarray(chunk.tokens[silent]).any()
        assert not np.asarray(chunk.log_probs[silent]).any()
        assert not np.asarray(chunk.top_tokens[silent]).any()
    want = np.argmax(logits[1])
    assert int(chunk.tokens[1, 0]) == want


def test_bad_input_names_the_argument(lm):
    model, params, step_fn = lm
    state = empty_slots(model)
    logits, cache = inference.prefill(model, params, jnp.array([[1, 2]]))
    good = dict(
        keys=jax.random.split(jax.random.key(1), 1),
        max_new_tokens=np.array([3]),
        prompt_tokens=np.array([[1, 2]]),
        knobs=decoding.full_knobs(decoding.SamplingKnobs(), 1, VOCAB),
    )
    fill = lambda slots=(0,), **changes: decoding.fill_slots(
        state, np.asarray(slots), logits, cache, **{**good, **changes}
    )
    step = lambda **arguments: decoding.step_slots(step_fn, params, state, **arguments)
    full = lambda **knobs: decoding.full_knobs(
        decoding.SamplingKnobs(**knobs), 1, VOCAB
    )
    # One key for every row would give every row the same draws.
    bad = (
        keyword_rows(
            "fill_slots",
            fill,
            [
                ("2 slots", dict(slots=np.array([0, 1])), ValueError),
                ("slot -1", dict(slots=np.array([-1])), ValueError),
                ("one key", dict(keys=jax.random.key(1)), ValueError),
                ("raw keys' shape", dict(keys=np.zeros((2,), np.uint32)), ValueError),
                ("limit 0", dict(max_new_tokens=np.array([0])), ValueError),
                ("float prompt", dict(prompt_tokens=np.array([[1.0]])), TypeError),
                ("knobs not full", dict(knobs=decoding.SamplingKnobs()), ValueError),
                (
                    "stop strings, no table",
                    dict(stop_strings=ONE_STOP),
                    ValueError,
                    "stop_strings",
                ),
            ],
        )
        + keyword_rows(
            "full_knobs",
            full,
            [
                ("static knob", dict(no_repeat_ngram_size=2), ValueError),
                ("top_p 2", dict(top_p=2.0), ValueError),
            ],
        )
        + keyword_rows(
            "step_slots",
            step,
            [
                ("num_steps 0", dict(num_steps=0), ValueError),
                ("eos_id = V", dict(num_steps=1, eos_id=VOCAB), ValueError, "eos_id"),
            ],
        )
    )
    for _, call, error, named in bad:
        assert_raises_exactly(call, error, named)
    # Past the table's capacity: refused by name, never cut.
    wide = decoding.encode_stop_strings([["a"]], max_bytes=7, max_strings=2)
    table = empty_slots(model, stops=True)
    assert_raises_exactly(
        lambda: decoding.fill_slots(table, np.array([0]), logits, cache, **good,
                                    stop_strings=wide),
        ValueError, "stop_strings",
    )  # fmt: skip
    assert_raises_exactly(
        lambda: decoding.encode_stop_strings([["abcdefg"]], **STOP_CAPACITY),
        ValueError, "max_bytes",
    )  # fmt: skip
    one_row = decoding.StopStrings.build([[]], TOKEN_BYTES, **STOP_CAPACITY)
    assert_raises_exactly(
        lambda: decoding.empty_slots(state.model_state, vocab_size=VOCAB,
                                     history_len=MAX_LEN, key=jax.random.key(0),
                                     stop=one_row),
        ValueError, "stop",
    )  # fmt: skip
