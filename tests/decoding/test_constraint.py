"""Constraints in the one decoding step: packed masks against numpy, greedy
under a constraint against the argmax of the masked logits, sampling inside
the allowed sets, end-of-text only where the automaton accepts, rows the
constraint blocks, the slots, and no compile for a new constraint."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.decoding import constraint as constraint_lib

V, EOS = 7, 6


def markov_step(table, tokens, state):
    """A first-order chain: the next logits are the row of the token fed."""
    return table[tokens], state


class TableMasker:
    """A deterministic automaton per id over V tokens, in numpy: ``table[q,
    t]`` is the state after token ``t`` in state ``q`` (-1: not allowed);
    EOS is allowed in the ``accept`` states. Records every call."""

    def __init__(self, table, accept, eos=EOS):
        self.table, self.accept, self.eos = np.asarray(table), accept, eos
        self.states, self.calls, self.taken = {}, 0, {}

    def add(self, row):
        self.states[row], self.taken[row] = 0, []
        return row

    def allowed(self, row):
        state = self.states[row]
        if state < 0:
            return np.zeros(self.table.shape[1], bool)
        mask = self.table[state] >= 0
        mask[self.eos] = self.accept[state]
        return mask

    def advance(self, ids, tokens, emitted):
        self.calls += 1
        out = np.ones((len(ids), self.table.shape[1]), bool)
        for b, row in enumerate(ids):
            if row not in self.states:
                continue
            if emitted[b]:
                self.taken[row].append(int(tokens[b]))
                state = self.states[row]
                self.states[row] = (
                    -1 if tokens[b] == self.eos else self.table[state, tokens[b]]
                )
            out[b] = self.allowed(row)
        return decoding.pack_token_mask(out)


def digits_then_end():
    """Two or three tokens of {1, 2, 3} alternating with {4, 5}, then EOS:
    states 0 (start), 1 (after a low token), 2 (after a high one), 3 (three)."""
    table = -np.ones((4, V), int)
    table[0, 1:4] = 1
    table[1, 4:6] = 2
    table[2, 1:4] = 3
    return TableMasker(table, accept=[False, False, True, True])


def test_pack_and_unpack_agree_with_numpy():
    rng = np.random.default_rng(0)
    for vocab_size in (1, 31, 32, 33, 85, 2048):
        allowed = rng.random((3, vocab_size)) < 0.4
        words = decoding.pack_token_mask(allowed)
        assert words.shape == (3, decoding.mask_width(vocab_size))
        assert words.dtype == np.int32
        bits = [[(int(w) >> j) & 1 for w in row for j in range(32)] for row in words]
        np.testing.assert_array_equal(np.asarray(bits)[:, :vocab_size], allowed)
        assert not np.asarray(bits)[:, vocab_size:].any()
        unpacked = decoding.unpack_token_mask(words, vocab_size)
        np.testing.assert_array_equal(unpacked, allowed)


class TestApplyTokenMask(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_removes_what_the_mask_does_not_allow(self):
        rng = np.random.default_rng(1)
        logits = rng.normal(size=(4, 40)).astype(np.float32)
        allowed = rng.random((4, 40)) < 0.5
        got = self.variant(decoding.apply_token_mask)(
            logits, decoding.pack_token_mask(allowed)
        )
        np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))


def test_a_mask_of_the_wrong_shape_is_refused_by_name():
    with pytest.raises(ValueError, match=r"allowed must be .* \(2, 2\)"):
        decoding.apply_token_mask(jnp.zeros((2, 40)), jnp.zeros((2, 1), jnp.int32))


def test_process_logits_masks_before_the_filters_and_falls_back_inside_the_mask():
    logits = jnp.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    allowed = decoding.pack_token_mask(
        np.array([[False, False, True, True, False, True]])
    )
    # top_k 1 after the mask keeps the best allowed token, not token 0.
    got = decoding.process_logits(logits, top_k=1, allowed=allowed)
    np.testing.assert_array_equal(np.isfinite(got[0]), [0, 0, 1, 0, 0, 0])
    # min_new_tokens removes EOS (5), the one allowed token: the mask wins.
    only_eos = decoding.pack_token_mask(np.eye(6, dtype=bool)[5][None])
    got = decoding.process_logits(
        logits, min_new_tokens=3, num_generated=0, eos_id=5, allowed=only_eos
    )
    np.testing.assert_array_equal(np.isfinite(got[0]), [0, 0, 0, 0, 0, 1])


def markov_rows(seed, rows):
    table = jax.random.normal(jax.random.key(seed), (V, V))
    first = jax.random.normal(jax.random.key(seed + 1), (rows, V))
    return table, first


def np_masked_greedy(table, first, masker, row, max_new_tokens):
    """The argmax of the masked logits at each step, in numpy, along the
    masker's own automaton."""
    reference = TableMasker(masker.table, masker.accept)
    reference.add(0)
    logits, tokens = np.asarray(first[row], np.float64), []
    for _ in range(max_new_tokens):
        allowed = reference.allowed(0)
        if not allowed.any():
            break
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        tokens.append(token)
        if token == EOS:
            break
        reference.advance([0], [token], [True])
        logits = np.asarray(table[token], np.float64)
    return tokens


def test_greedy_under_a_constraint_is_the_argmax_of_the_masked_logits():
    table, first = markov_rows(0, 3)
    masker = digits_then_end()
    ids = jnp.array([masker.add(10), -1, masker.add(11)])
    out = decoding.generate(
        markov_step, table, first, (), key=jax.random.key(0), max_new_tokens=6,
        temperature=0.0, eos_id=EOS,
        constraint=decoding.TokenConstraint(ids, masker),
    )  # fmt: skip
    for row in (0, 2):
        want = np_masked_greedy(table, first, masker, row, 6)
        np.testing.assert_array_equal(out.tokens[row, : len(want)], want)
        assert out.lengths[row] == len(want)
        assert out.finish_reasons[row] == decoding.FINISHED_EOS
    # The unconstrained row is plain greedy.
    plain = decoding.generate(
        markov_step, table, first[1:2], (), key=jax.random.key(0), max_new_tokens=6,
        temperature=0.0, eos_id=EOS,
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens[1], plain.tokens[0])


def test_sampled_rows_stay_in_the_language_and_end_only_where_it_accepts():
    table, first = markov_rows(2, 16)
    masker = digits_then_end()
    ids = jnp.array([masker.add(row) for row in range(16)])
    out = decoding.generate(
        markov_step, table, first, (), key=jax.random.split(jax.random.key(3), 16),
        max_new_tokens=8, temperature=1.5, top_k=3, eos_id=EOS,
        constraint=decoding.TokenConstraint(ids, masker),
    )  # fmt: skip
    for row in range(16):
        tokens = out.tokens[row, : out.lengths[row]].tolist()
        assert tokens == masker.taken[row]
        assert tokens[-1] == EOS and len(tokens) in (3, 4)
        body = tokens[:-1]
        assert all(t in (1, 2, 3) for t in body[0::2])
        assert all(t in (4, 5) for t in body[1::2])
    # Log-probs are renormalized over the allowed tokens: the only allowed
    # token (EOS after three) has probability 1.
    three = [row for row in range(16) if out.lengths[row] == 4]
    np.testing.assert_allclose(np.exp(out.log_probs[three, 3]), 1.0, rtol=1e-6)


def test_a_row_whose_constraint_allows_nothing_ends_without_a_token():
    table, first = markov_rows(4, 2)
    masker = digits_then_end()
    masker.accept = [False, False, False, False]  # three tokens, then nothing
    ids = jnp.array([masker.add(0), -1])
    out = decoding.generate(
        markov_step, table, first, (), key=jax.random.key(0), max_new_tokens=6,
        temperature=0.0, constraint=decoding.TokenConstraint(ids, masker),
    )  # fmt: skip
    assert out.lengths[0] == 3
    assert out.finish_reasons[0] == decoding.FINISHED_STOP
    assert out.finish_reasons[1] == decoding.FINISHED_LENGTH


def test_stops_and_the_length_still_end_a_constrained_row():
    table, first = markov_rows(5, 2)
    masker = digits_then_end()
    ids = jnp.array([masker.add(0), masker.add(1)])
    out = decoding.generate(
        markov_step, table, first, (), key=jax.random.key(0), max_new_tokens=2,
        temperature=0.0, eos_id=EOS, stop_sequences=[[[4]], []],
        constraint=decoding.TokenConstraint(ids, masker),
    )  # fmt: skip
    reasons = out.finish_reasons.tolist()
    stopped = out.tokens[0, 1] == 4
    assert reasons[0] == (
        decoding.FINISHED_STOP if stopped else decoding.FINISHED_LENGTH
    )
    assert reasons[1] == decoding.FINISHED_LENGTH and out.lengths[1] == 2


def test_a_new_constraint_compiles_nothing_and_calls_the_host_once_a_step():
    table, first = markov_rows(6, 2)
    loop = decoding.sampling._sampling_loop
    masker = digits_then_end()
    outs = []
    for start in (0, 10):
        ids = jnp.array([masker.add(start), masker.add(start + 1)])
        calls = masker.calls
        outs.append(
            decoding.generate(
                markov_step,
                table,
                first,
                (),
                key=jax.random.key(start),
                max_new_tokens=5,
                temperature=1.0,
                eos_id=EOS,
                constraint=decoding.TokenConstraint(ids, masker),
            )  # fmt: skip
        )
        steps = int(outs[-1].lengths.max())
        # One call for the first masks, one per step whose tokens it takes.
        assert masker.calls - calls == 1 + steps
        if start == 0:
            compiled = loop._cache_size()
    assert loop._cache_size() == compiled


def test_streamed_chunks_of_a_constrained_loop_equal_one_call():
    table, first = markov_rows(7, 4)
    keys = jax.random.split(jax.random.key(8), 4)

    def run(**extra):
        masker = digits_then_end()
        ids = jnp.array([masker.add(row) for row in range(4)])
        settings = dict(
            key=keys, max_new_tokens=6, temperature=1.0, eos_id=EOS,
            constraint=decoding.TokenConstraint(ids, masker),
        )  # fmt: skip
        if not extra:
            return decoding.generate(markov_step, table, first, (), **settings)
        chunks = list(
            decoding.generate_stream(markov_step, table, first, (), **settings, **extra)
        )
        return jnp.concatenate([c.tokens for c in chunks], axis=1)

    np.testing.assert_array_equal(run(chunk_steps=2), run().tokens)


def test_slots_constrain_their_rows_and_compile_once():
    table, first = markov_rows(9, 3)
    masker = digits_then_end()
    state = decoding.empty_slots(
        jnp.zeros([3]), vocab_size=V, history_len=16, key=jax.random.key(0),
        masker=masker,
    )  # fmt: skip
    state = decoding.fill_slots(
        state, jnp.array([0, 2]), first[:2], jnp.zeros([2]),
        keys=jax.random.split(jax.random.key(1), 2), max_new_tokens=jnp.array([6, 6]),
        prompt_tokens=jnp.array([[0], [1]]),
        knobs=decoding.full_knobs(decoding.SamplingKnobs(temperature=0.0), 2, V),
        constraint_ids=jnp.array([masker.add(0), -1]),
    )  # fmt: skip
    step = markov_step
    tokens = []
    for _ in range(3):
        state, chunk = decoding.step_slots(step, table, state, num_steps=3, eos_id=EOS)
        tokens.append(np.where(chunk.emitted, chunk.tokens, -1))
    tokens = np.concatenate(tokens, axis=1)
    want = np_masked_greedy(table, first, masker, 0, 6)
    np.testing.assert_array_equal(tokens[0, : len(want)], want)
    assert (tokens[0, len(want) :] == -1).all()
    assert (tokens[1] == -1).all()  # a free slot emits nothing
    assert (tokens[2] != -1).sum() == 6  # the unconstrained row runs to its limit
    # A second fill with a new constraint reuses the compiled fill and step.
    compiled = decoding.slots._step_slots._cache_size()
    state = decoding.fill_slots(
        state, jnp.array([1, 3]), first[1:3], jnp.zeros([2]),
        keys=jax.random.split(jax.random.key(2), 2), max_new_tokens=jnp.array([6, 1]),
        prompt_tokens=jnp.array([[0], [1]]),
        knobs=decoding.full_knobs(decoding.SamplingKnobs(temperature=0.0), 2, V),
        constraint_ids=jnp.array([masker.add(1), -1]),
    )  # fmt: skip
    row = []
    for _ in range(2):
        state, chunk = decoding.step_slots(step, table, state, num_steps=3, eos_id=EOS)
        row += chunk.tokens[1][chunk.emitted[1]].tolist()
    assert row == masker.taken[1] and row[-1] == EOS
    assert decoding.slots._step_slots._cache_size() == compiled


def test_a_constraint_of_the_wrong_rows_is_refused_by_name():
    table, first = markov_rows(0, 2)
    masker = digits_then_end()
    with pytest.raises(ValueError, match=r"constraint.ids must have .* \(4,\)"):
        decoding.generate(
            markov_step, table, first, (), key=jax.random.key(0), max_new_tokens=2,
            num_samples=2, constraint=decoding.TokenConstraint(jnp.array([0, 1]), masker),
        )  # fmt: skip
    with pytest.raises(TypeError, match="constraint.masker"):
        constraint_lib.TokenConstraint(jnp.array([0, 1]), object()).check(2)
