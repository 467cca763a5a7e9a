"""Using a trained run: loading it, continuing text window by window,
decoding with a quantized head, and generation timings.

References: the float32 model, the model's own full forward passes (for the
windows of ``continue_text``), and numpy's ``h @ dequantize(table).T`` on the
model's own final hidden states.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from lmhead import decoding, quantize
from lmhead.lm import checkpoints, configuration, data, generation, inference
from lmhead.lm import model as model_lib
from lmhead.lm import state as state_lib
from tests.errors import assert_raises_exactly, bad_input_test
from tests.lm.tiny_decoder import MAX_LEN, init_params, random_tokens, small_model

NEW = 11


def noisy(tied, seed):
    """A small model and random parameters far from init, so that the logits
    spread out."""
    model = small_model(tied=tied)
    return model, init_params(model, seed=seed, noise=0.3)


def perturbed(params, seed, noise=0.3):
    """``params`` plus N(0, noise^2) noise on every entry."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(x + noise * rng.standard_normal(x.shape), jnp.float32),
        params,
    )


PROMPT = random_tokens((3, 5))


def greedy(model, params):
    logits, cache = inference.prefill(model, params, PROMPT, max_new_tokens=NEW)
    tokens, *_ = decoding.generate(
        inference.make_step_fn(model),
        params,
        logits,
        cache,
        key=jax.random.key(0),
        max_new_tokens=NEW,
        temperature=0.0,
    )
    return logits, np.asarray(tokens)


@pytest.mark.parametrize(
    "tied,dtype",
    [(True, "int8"), (False, "int8"), (True, "bfloat16"), (True, "float16")],
)
def test_a_smaller_heads_logits_are_h_times_its_table(tied, dtype):
    model, params = noisy(tied, seed=1)
    small = generation.quantize_for_decoding(model, params, dtype)
    if tied:  # the lookup keeps the float table; the head reads the copy
        assert small["embed"]["embedding"] is params["embed"]["embedding"]
    table = small[model_lib.HEAD_TABLE] if tied else small["head"]["unembedding"]
    if dtype == "int8":
        assert isinstance(table, quantize.QuantizedTable)
        table = quantize.dequantize(table)
    assert table.dtype == jnp.dtype("float32" if dtype == "int8" else dtype)
    h = model.apply({"params": params}, PROMPT, method=model_lib.DecoderLM.hidden)
    expected = np.asarray(h[:, -1], np.float64) @ np.asarray(table, np.float64).T
    logits, _ = inference.prefill(model, small, PROMPT)
    full, _ = inference.prefill(model, params, PROMPT)
    scale = np.abs(full).max()
    tolerance = 1e-4 if dtype == "int8" else 1e-2 * scale
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=tolerance)
    difference = np.abs(np.asarray(logits) - np.asarray(full)).max()
    assert 0 < difference < (2e-2 if dtype == "int8" else 1e-2) * scale


@pytest.mark.parametrize("tied", [True, False])
def test_int8_greedy_decoding_agrees_with_float32(tied):
    model, params = noisy(tied, seed=2)
    small = generation.quantize_for_decoding(model, params, "int8")
    _, expected = greedy(model, params)
    _, got = greedy(model, small)
    # A flip would change every later token of its row: most must agree.
    assert np.mean(got == expected) >= 0.8, (got, expected)
    # The quantized model's own full forward pass argmaxes to the same tokens.
    sequence = jnp.concatenate([PROMPT, jnp.asarray(got)], axis=1)
    recomputed = jax.jit(model.apply)({"params": small}, sequence[:, :-1])
    np.testing.assert_array_equal(
        np.argmax(recomputed[:, PROMPT.shape[1] - 1 :], -1), got
    )


def test_a_second_quantized_parameter_set_reuses_the_compiled_loop():
    loop = decoding.sampling._sampling_loop
    model, params = noisy(True, seed=3)
    _, first = greedy(model, generation.quantize_for_decoding(model, params, "int8"))
    compiled = loop._cache_size()
    params = noisy(True, seed=4)[1]
    _, second = greedy(model, generation.quantize_for_decoding(model, params, "int8"))
    assert loop._cache_size() == compiled
    assert not np.array_equal(first, second)  # the new values were used


def test_beam_search_runs_with_an_int8_head():
    model, params = noisy(False, seed=6)
    step_fn = inference.make_step_fn(model)
    results = []
    for p in (params, generation.quantize_for_decoding(model, params, "int8")):
        logits, cache = inference.prefill(model, p, PROMPT, max_new_tokens=6)
        results.append(
            decoding.beam_search(
                step_fn, p, logits, cache, num_beams=3, max_new_tokens=6, eos_id=None
            )
        )
    (tokens, scores, _, _), (q_tokens, q_scores, _, _) = results
    assert q_tokens.shape == tokens.shape == (3, 1, 6)
    same = np.all(np.asarray(tokens) == np.asarray(q_tokens), axis=(1, 2))
    assert same.sum() >= 2
    np.testing.assert_allclose(
        np.asarray(q_scores)[same], np.asarray(scores)[same], rtol=2e-2, atol=2e-2
    )


def test_timings_exist_and_are_positive():
    model, params = noisy(True, seed=8)
    t = generation.time_generation(model, params, PROMPT, max_new_tokens=4, repeats=2)
    assert t.new_tokens == 4
    for name in ("compile_seconds", "prefill_ms", "first_step_ms", "ms_per_token"):
        assert np.isfinite(getattr(t, name)) and getattr(t, name) > 0, t
    assert t.time_to_first_token_ms == pytest.approx(t.prefill_ms + t.first_step_ms)
    line = generation.format_timings(t, batch_size=3)
    assert "time to first token" in line and "ms per new token over 4 tokens" in line


def test_timing_prompt_is_one_window_of_continue_text():
    model = small_model(tied=True)
    tokenizer = data.CharTokenizer("abcdefgh")
    rows, new = generation.timing_prompt(model, tokenizer, "aabbccddeeffgghh", 2, 100)
    assert rows.shape == (2, MAX_LEN // 2) and new == MAX_LEN - MAX_LEN // 2
    np.testing.assert_array_equal(rows[0], tokenizer.encode("eeffgghh"))
    rows, new = generation.timing_prompt(model, tokenizer, "abc", 1, 5)
    assert rows.shape == (1, 3) and new == 5


def write_run(workdir, end_of_text):
    """A run's workdir as training leaves it, written without training: the
    tiny config (``data.end_of_text`` as given), the character tokenizer of
    the corpus, and a checkpoint at step 10 of noisy parameters (far from
    init, so that greedy decoding has clear winners). Returns the workdir
    and the saved parameters."""
    config = default.get_config("tiny")
    config.data.end_of_text = end_of_text
    tokenizer = data.train_tokenizer(config.data)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    tokenizer.save(os.path.join(workdir, data.TOKENIZER_FILE))
    model = configuration.make_model(config, tokenizer.vocab_size)
    state = state_lib.create_train_state(model, config, jax.random.key(0))
    state = state.replace(
        params=perturbed(state.params, seed=9), step=jnp.array(10, jnp.int32)
    )
    manager = checkpoints.checkpoint_manager(workdir)
    checkpoints.save(manager, 10, state)
    manager.close()
    return workdir, jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run made before the end-of-text token (one token, one character:
    what the stop-string tests count on)."""
    return write_run(str(tmp_path_factory.mktemp("run")), end_of_text=False)


@pytest.fixture(scope="module")
def eot_run(tmp_path_factory):
    """A new run: its tokenizer has the end-of-text token."""
    return write_run(str(tmp_path_factory.mktemp("eot_run")), end_of_text=True)


def test_load_run(run):
    workdir, saved = run
    config, tokenizer, model, params = generation.load_run(workdir)
    assert config.model.d_model == 32 and tokenizer.vocab_size == 84
    assert tokenizer.eos_id is None  # saved without the token: as before
    assert params["embed"]["embedding"].shape == (84, 32)
    assert model.max_len == 16
    jax.tree.map(np.testing.assert_array_equal, params, saved)


def test_load_run_needs_a_checkpoint(run, tmp_path):
    workdir, _ = run
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    assert_raises_exactly(
        lambda: generation.load_run(str(copy)), FileNotFoundError, "checkpoints"
    )
    os.mkdir(copy / "checkpoints")
    assert_raises_exactly(
        lambda: generation.load_run(str(copy)), FileNotFoundError, "checkpoint"
    )


def test_greedy_text_matches_full_forward_passes(run):
    _, tokenizer, model, params = generation.load_run(run[0])
    text = generation.continue_text(
        model,
        params,
        tokenizer,
        "KING",
        key=jax.random.key(0),
        num_samples=2,
        max_new_tokens=20,
        temperature=0.0,
    )
    # The documented windows: the last max_len // 2 = 8 tokens (at first
    # the 4 of the prompt), extended by 8. The model is causal, so zero
    # padding after a context does not change the logits at its end.
    forward = jax.jit(lambda x: model.apply({"params": params}, x))
    ids = tokenizer.encode("KING")
    while len(ids) < 4 + 20:
        context = ids[-8:]
        for _ in range(8):
            padded = np.zeros((1, 16), np.int32)
            padded[0, : len(context)] = context
            next_id = int(np.argmax(forward(padded)[0, len(context) - 1]))
            context.append(next_id)
            ids.append(next_id)
    assert text == [tokenizer.decode(ids[: 4 + 20])] * 2


STOP_CASES = {
    # Windows add 8 tokens (characters): the greedy text's positions 6..9
    # span the first two windows' boundary, 11..12 lie inside the second.
    "across windows": (0.0, lambda greedy: [greedy[6:10]]),
    "inside a window": (0.0, lambda greedy: [greedy[11:13], "zzq"]),
    "sampled": (1.0, lambda greedy: ["a", "c", "v", "zzq"]),
}


@pytest.mark.parametrize("case", STOP_CASES)
def test_stop_strings_cut_the_text_where_the_plain_text_first_holds_one(run, case):
    temperature, make_stops = STOP_CASES[case]
    _, tokenizer, model, params = generation.load_run(run[0])
    greedy_text = generation.continue_text(
        model,
        params,
        tokenizer,
        "KING",
        key=jax.random.key(3),
        num_samples=1,
        max_new_tokens=30,
        temperature=0.0,
    )[0][4:]
    stops = make_stops(greedy_text)
    common = dict(key=jax.random.key(3), num_samples=3, max_new_tokens=30)
    plain, stopped = (
        generation.continuations(
            model, params, tokenizer, "KING", temperature=temperature, stop=s, **common
        )
        for s in (None, stops)
    )
    ends = []
    for before, after in zip(plain, stopped, strict=True):
        new_text = before.text[4:]
        # Reference: decode after every token, stop at the first that holds one.
        end = next(
            (
                t
                for t in range(len(before.tokens))
                if any(s in tokenizer.decode(before.tokens[: t + 1]) for s in stops)
            ),
            None,
        )
        ends.append(end)
        if end is None:
            assert after == before
            continue
        assert after.finish_reason == "stop" and before.finish_reason == "length"
        assert after.tokens == before.tokens[: end + 1]
        cut = min(new_text.find(s) for s in stops if s in new_text[: end + 1])
        assert after.text == "KING" + new_text[:cut]
    assert all(end is not None for end in ends), ends
    if case == "sampled":
        assert len(set(ends)) > 1, ends


def test_new_knob_values_reuse_the_compiled_window(run):
    """The sampling knobs are traced: other temperatures (greedy included)
    and top-p values run the program the first call compiled, and act."""
    _, tokenizer, model, params = generation.load_run(run[0])
    window = generation._continue_window
    texts = {}
    for temperature, top_p in ((0.7, 0.9), (1.3, 0.5), (0.0, 0.8)):
        texts[temperature, top_p] = generation.continue_text(
            model, params, tokenizer, "KING", key=jax.random.key(1), num_samples=3,
            max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=20,
        )  # fmt: skip
        if len(texts) == 1:
            compiled = window._cache_size()
    assert window._cache_size() == compiled
    assert len({tuple(t) for t in texts.values()}) == 3  # the values were used
    assert len(set(texts[0.0, 0.8])) == 1  # greedy: every sample alike


def likelier_eos(model, params, tokenizer, scale):
    """``params`` whose (tied) table row of the end-of-text token is
    ``scale`` times that of the token greedy decoding picks most often, so
    that the token comes up (the noisy parameters seldom draw it)."""
    greedy = generation.continuations(
        model,
        params,
        tokenizer,
        "KING",
        key=jax.random.key(0),
        num_samples=1,
        max_new_tokens=24,
        temperature=0.0,
        ignore_eos=True,
    )[0].tokens
    params = jax.tree.map(np.array, params)
    table = params["embed"]["embedding"]
    table[tokenizer.eos_id] = scale * table[max(set(greedy), key=greedy.count)]
    return params


def test_samples_end_at_the_end_of_text_token_unless_ignore_eos(eot_run):
    """The same key with ``ignore_eos`` draws the same tokens: each sample
    is that one cut after its first end-of-text token, whose literal is not
    in the text."""
    _, tokenizer, model, params = generation.load_run(eot_run[0])
    eos = tokenizer.eos_id
    assert (eos, tokenizer.vocab_size) == (84, 85)
    params = likelier_eos(model, params, tokenizer, 0.7)
    common = dict(key=jax.random.key(5), num_samples=12, max_new_tokens=40)
    ended = generation.continuations(model, params, tokenizer, "KING", **common)
    going = generation.continuations(
        model, params, tokenizer, "KING", ignore_eos=True, **common
    )
    cut = 0
    for after, before in zip(ended, going, strict=True):
        assert len(before.tokens) == 40 and before.finish_reason == "length"
        assert before.text == "KING" + tokenizer.decode(before.tokens)
        if eos not in before.tokens:
            assert after == before
            continue
        cut += 1
        end = before.tokens.index(eos)
        assert after.tokens == before.tokens[: end + 1]
        assert after.finish_reason == "stop"
        assert after.text == "KING" + tokenizer.decode(before.tokens[:end])
        assert data.END_OF_TEXT not in after.text
        assert after.top_logprobs == before.top_logprobs[: end + 1]
    assert 0 < cut < 12, cut  # some samples end at it, some do not


def test_beam_search_ends_at_the_end_of_text_token(eot_run):
    _, tokenizer, model, params = generation.load_run(eot_run[0])
    eos = tokenizer.eos_id
    params = likelier_eos(model, params, tokenizer, 1.2)
    common = dict(key=jax.random.key(0), num_samples=1, max_new_tokens=24)
    beams = {
        ignore: generation.continuations(
            model, params, tokenizer, "KING", num_beams=3, ignore_eos=ignore, **common
        )[0]
        for ignore in (False, True)
    }
    assert eos in beams[True].tokens  # the unstopped search goes past it
    ended = beams[False]
    assert ended.finish_reason == "stop" and ended.tokens[-1] == eos
    assert eos not in ended.tokens[:-1]
    assert ended.text == "KING" + tokenizer.decode(ended.tokens[:-1])


def test_no_window_runs_after_every_sample_stopped(run):
    # The first token of every greedy sample stops it: one window only, and
    # the text is the prompt alone.
    _, tokenizer, model, params = generation.load_run(run[0])
    common = dict(key=jax.random.key(0), num_samples=2, temperature=0.0)
    first = generation.continuations(
        model, params, tokenizer, "KING", max_new_tokens=1, **common
    )[0].text[4:]
    out = generation.continuations(
        model, params, tokenizer, "KING", max_new_tokens=200, stop=first, **common
    )
    assert [(c.text, c.tokens, c.finish_reason) for c in out] == [
        ("KING", tokenizer.encode(first), "stop")
    ] * 2


def test_top_logprobs_and_penalties(run):
    _, tokenizer, model, params = generation.load_run(run[0])
    common = dict(key=jax.random.key(0), num_samples=1, max_new_tokens=16)
    greedy = generation.continuations(
        model, params, tokenizer, "KING", temperature=0.0, top_logprobs=3, **common
    )[0]
    assert len(greedy.top_logprobs) == len(greedy.tokens) == 16
    for token, top in zip(greedy.tokens, greedy.top_logprobs, strict=True):
        texts, log_probs = zip(*top, strict=True)
        assert texts[0] == tokenizer.decode([token])  # greedy takes the likeliest
        assert list(log_probs) == sorted(log_probs, reverse=True)
        assert np.exp(log_probs).sum() <= 1 + 1e-5
    # A large frequency penalty forbids a repeat among a window's 8 tokens.
    penalized = generation.continuations(
        model, params, tokenizer, "KING", temperature=0.0, frequency_penalty=1e3,
        **common,
    )[0]  # fmt: skip
    for window in (penalized.tokens[:8], penalized.tokens[8:]):
        assert len(set(window)) == len(window)
    assert len(set(greedy.tokens[:8])) < 8  # the penalty changed something


TOKENIZER = data.CharTokenizer("abc")
ONE_SLOT = model_lib.DecoderLM(
    vocab_size=3, num_layers=1, num_heads=2, d_model=8, mlp_dim=16, max_len=1
)
KNOBS = dict(key=jax.random.key(0), num_samples=1, max_new_tokens=4)
# Refused before anything compiles (no parameters are given).
BAD_REQUESTS = [
    ("continue_text max_len 1",
     lambda: generation.continue_text(ONE_SLOT, None, TOKENIZER, "a", **KNOBS),
     ValueError, "max_len"),
    ("continue_text empty prompt",
     lambda: generation.continue_text(small_model(tied=True), None, TOKENIZER, "", **KNOBS),
     ValueError, "prompt"),
    ("continue_text top_p 1.5",  # the traced knobs are checked before the loop
     lambda: generation.continue_text(
         small_model(tied=True), None, TOKENIZER, "a", top_p=1.5, **KNOBS),
     ValueError, "top_p"),
    ("continue_text empty stop",
     lambda: generation.continue_text(
         small_model(tied=True), None, TOKENIZER, "a", stop=["b", ""], **KNOBS),
     ValueError, "stop"),
    ("timing_prompt empty prompt",
     lambda: generation.timing_prompt(small_model(tied=True), TOKENIZER, "", 1, 4),
     ValueError, "prompt"),
    ("time_generation max_new_tokens 0",
     lambda: generation.time_generation(
         small_model(tied=True), None, PROMPT, max_new_tokens=0),
     ValueError, "max_new_tokens"),
    ("time_generation past max_len",
     lambda: generation.time_generation(
         small_model(tied=True), None, PROMPT, max_new_tokens=MAX_LEN),
     ValueError, ("max_new_tokens", "max_len")),
    ("loss with a quantized head",
     lambda: small_model(tied=True).apply(
         {"params": generation.quantize_for_decoding(*noisy(True, 7), "int8")},
         PROMPT, PROMPT, method=model_lib.DecoderLM.loss),
     ValueError, "QuantizedTable"),
    ("time_generation repeats 0",
     lambda: generation.time_generation(
         small_model(tied=True), None, PROMPT, max_new_tokens=2, repeats=0),
     ValueError, "repeats"),
]  # fmt: skip

test_bad_requests_are_refused_exactly_naming_the_argument = bad_input_test(BAD_REQUESTS)


# ---------------------------------------------------------------------------
# token_bytes: the table StopStrings matches text stop strings on.

BPE_TEXT = "héllo wörld ☃ the cat sat\nROMEO: ô là\n\n" * 20


@pytest.fixture(scope="module")
def bpe():
    return data.BPETokenizer.train(BPE_TEXT, 300)


def test_bpe_token_bytes_join_to_the_decoded_text(bpe):
    table = data.token_bytes(bpe)
    assert len(table) == bpe.vocab_size
    # Some tokens hold part of a character: decoding one alone cannot give
    # its bytes, and the table does.
    partial = [
        b
        for b in table
        if b.decode("utf-8", errors="replace") != b.decode("utf-8", errors="ignore")
    ]
    assert partial
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, bpe.vocab_size, rng.integers(1, 12)).tolist()
        joined = b"".join(table[i] for i in ids)
        assert joined.decode("utf-8", errors="replace") == bpe.decode(ids)
    ids = bpe.encode(BPE_TEXT[:200])
    assert b"".join(table[i] for i in ids) == BPE_TEXT[:200].encode("utf-8")


def test_char_token_bytes_are_each_characters_utf8():
    tokenizer = data.CharTokenizer.train("aé☃\n")
    assert data.token_bytes(tokenizer) == [c.encode() for c in tokenizer.chars]
    tokenizer = data.CharTokenizer.train("aé☃\n", data.END_OF_TEXT)
    assert data.token_bytes(tokenizer) == [c.encode() for c in "\naé☃"] + [
        b"<|endoftext|>"
    ]


def test_bpe_stop_strings_match_decoding_after_every_step(bpe):
    """Stop strings across 2 and 3 BPE tokens and inside characters, on
    random token rows, against decoding each prefix and searching it."""
    stops = ["ROMEO:", "\n\n", "ö", "☃ t", "at s"]
    stop = decoding.StopStrings.build(stops, data.token_bytes(bpe))
    ids = np.array([bpe.encode(BPE_TEXT[k : k + 40])[:12] for k in range(0, 400, 13)])
    rng = np.random.default_rng(1)
    ids[::3] = rng.integers(0, bpe.vocab_size, ids[::3].shape)
    pieces = [len(bpe.encode(s)) for s in ["ROMEO:", "☃ t"]]
    assert max(pieces) >= 3, pieces
    update = jax.jit(lambda s, c, t, a: s.update(c, t, a))
    carry, first = stop.init(len(ids)), [None] * len(ids)
    for t in range(ids.shape[1]):
        active = jnp.array([f is None for f in first])
        carry, ended = update(stop, carry, jnp.asarray(ids[:, t]), active)
        for b in np.flatnonzero(np.asarray(ended)):
            first[b] = t
    expected = [
        next(
            (
                t
                for t in range(len(row))
                if any(s in bpe.decode(row[: t + 1].tolist()) for s in stops)
            ),
            None,
        )
        for row in ids
    ]
    assert sum(e is not None for e in expected) > len(ids) // 2
    assert first == expected
