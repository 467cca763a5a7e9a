"""Speculative decoding in the service's decode slots (lmhead/serve/continuous.py
with ``speculative``, lmhead/decoding/slots.py's ``step_slots``).

References: the same requests through the plain slots (greedy completions
token for token, stop strings where plain decoding cuts, log-probs to 1e-5,
streamed and not), and ``step_slots`` without a proposer on a Markov chain.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.serve import continuous
from tests.serve.test_continuous import assert_same, parse
from tests.serve.tiny_run import PROMPTS


@dataclasses.dataclass(frozen=True)
class MarkovStep:
    """A Markov chain as a step with verify and rewind (its state is unused)."""

    def __call__(self, table, tokens, state):
        return table[tokens], state

    def verify(self, table, tokens, state):
        return table[tokens], state

    def rewind(self, state, num_positions):
        return state


def slot_tokens(proposer, num_steps=6, top_logprobs=2):
    """Each slot's emitted tokens after ``num_steps`` calls of 2 steps."""
    table = jnp.log(jax.random.dirichlet(jax.random.key(0), jnp.full(6, 0.6), (6,)))
    state = decoding.empty_slots(
        jnp.zeros([3]), vocab_size=6, history_len=32, key=jax.random.key(0)
    )
    state = decoding.fill_slots(
        state, jnp.array([0, 1, 2]), table[jnp.array([0, 1, 2])], jnp.zeros([3]),
        keys=jax.random.split(jax.random.key(1), 3),
        max_new_tokens=jnp.array([9, 4, 12]),
        prompt_tokens=jnp.array([[0, 1], [1, -1], [2, 2]]),
        knobs=decoding.full_knobs(
            decoding.SamplingKnobs(temperature=0.0, repetition_penalty=1.3), 3, 6
        ),
    )  # fmt: skip
    got = [[] for _ in range(3)]
    for _ in range(num_steps):
        state, chunk = decoding.step_slots(
            MarkovStep(), table, state, num_steps=2, eos_id=5,
            top_logprobs=top_logprobs,
            speculative=proposer,
        )  # fmt: skip
        for slot in range(3):
            count = int(chunk.emitted[slot].sum())
            assert chunk.emitted[slot, :count].all()  # emitted tokens first
            got[slot] += chunk.tokens[slot, :count].tolist()
    return got, chunk


def test_speculative_slots_give_the_plain_slots_tokens():
    for proposer, top_logprobs in (
        (decoding.NGramProposer(3), 2),
        (decoding.NGramProposer(1), 0),  # no top tokens: the default
    ):
        plain, plain_chunk = slot_tokens(None, top_logprobs=top_logprobs)
        spec, chunk = slot_tokens(proposer, top_logprobs=top_logprobs)
        assert spec == plain
        np.testing.assert_array_equal(chunk.finish_reasons, plain_chunk.finish_reasons)
        assert chunk.tokens.shape[1] == 2 * (proposer.num_tokens + 1)
        assert chunk.top_tokens.shape[2] == top_logprobs


def run_requests(engine, bodies, **batcher):
    slots = continuous.SlotBatcher(engine, max_queue=16, **batcher)
    try:
        streamed, futures = [], []
        for body in bodies:
            request = parse(engine, **body)
            sent = []
            request.sink = lambda texts, sent=sent: sent.append(texts[0][1])
            streamed.append(sent)
            futures.append(slots.submit(request))
        return [f.result(timeout=120) for f in futures], streamed
    finally:
        slots.stop()


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_speculative_completions_equal_plain_ones(engine, steps_per_call):
    plain_text = run_requests(
        engine, [dict(prompt="ROMEO:", max_tokens=8, temperature=0)]
    )[0][0]["choices"][0]["text"]
    bodies = [
        dict(prompt=PROMPTS[:2], max_tokens=8, temperature=0, logprobs=3),
        dict(prompt="ROMEO:", max_tokens=8, temperature=0, stop=plain_text[2:4]),
        dict(prompt="To be", max_tokens=8, temperature=0, presence_penalty=0.4),
    ]
    plain, plain_streams = run_requests(engine, bodies, steps_per_call=steps_per_call)
    spec, spec_streams = run_requests(
        engine, bodies, steps_per_call=steps_per_call, speculative="ngram",
        num_speculative_tokens=3,
    )  # fmt: skip
    for got, want in zip(spec, plain, strict=True):
        assert_same(got, want)
    assert spec[1]["choices"][0]["finish_reason"] == "stop"
    for got, want in zip(spec_streams, plain_streams, strict=True):
        # Streamed pieces are prefixes of the same whole text.
        assert all(want[-1].startswith(piece) for piece in got), (got, want)


def test_the_batcher_refuses_speculation_by_its_flag(engine):
    with pytest.raises(ValueError, match="speculative='mtp'"):
        continuous.SlotBatcher(engine, max_queue=2, speculative="mtp")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        continuous.SlotBatcher(
            engine, max_queue=2, speculative="ngram", num_speculative_tokens=0
        )
