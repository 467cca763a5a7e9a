"""What the decoding tests share: numpy references (float64) and the
second-order Markov chain the decoders run on.

The chain's next logits depend on the token fed in *and* on the one before
it, which lives in the state, so a beam search that reorders the state
wrongly gets wrong logits. The chain's table is the step function's
``params``.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import decoding
from tests.references import log_softmax as np_log_softmax


def np_top_k_mask(z, k):
    keep = np.zeros(z.shape, bool)
    for row, values in enumerate(z):
        keep[row, np.argsort(-values, kind="stable")[:k]] = True
    return keep


def np_top_p_mask(z, p):
    """Walks down the sorted probabilities until the mass reaches p."""
    probs = np.exp(np_log_softmax(z))
    keep = np.zeros(z.shape, bool)
    for row in range(z.shape[0]):
        mass = 0.0
        for token in np.argsort(-z[row], kind="stable"):
            keep[row, token] = True
            mass += probs[row, token]
            if mass >= p:
                break
    return keep


def np_min_p_mask(z, min_p):
    probs = np.exp(np_log_softmax(z))
    return probs >= min_p * probs.max(-1, keepdims=True)


def np_sampling_probs(logits, temperature, top_k, top_p, min_p):
    """The processed distribution: temperature, then top-k, top-p, min-p."""
    z = np.asarray(logits, np.float64) / temperature
    for keep in (
        lambda z: np_top_k_mask(z, top_k) if top_k else np.ones(z.shape, bool),
        lambda z: np_top_p_mask(z, top_p),
        lambda z: np_min_p_mask(z, min_p),
    ):
        z = np.where(keep(z), z, -np.inf)
    return np.exp(np_log_softmax(z))


def np_repetition_penalty(z, history, penalty):
    """CTRL's rule, row by row; ``penalty`` a scalar or one per row."""
    z = np.array(z, np.float64)
    penalty = np.broadcast_to(np.asarray(penalty, np.float64), z.shape[:1])
    for row, tokens in enumerate(history):
        for token in {int(t) for t in tokens if t >= 0}:
            value, theta = z[row, token], penalty[row]
            z[row, token] = value * theta if value < 0 else value / theta
    return z


def np_ngram_banned(history, n):
    """Tokens t such that (last n-1 tokens, t) already occurs in history."""
    history = [int(t) for t in history if t >= 0]
    prefix = history[len(history) - n + 1 :] if n > 1 else []
    return {
        history[j + n - 1]
        for j in range(len(history) - n + 1)
        if history[j : j + n - 1] == prefix
    }


def np_divisor(length, alpha, penalty):
    return ((5 + length) / 6) ** alpha if penalty == "gnmt" else length**alpha


def markov_step(table, tokens, state):
    """A second-order chain: next logits = table[previous token, token]."""
    return table[state["prev"], tokens], {**state, "prev": tokens}


# Run-time calls of counted_markov_step (a debug callback runs on every call,
# not only when traced). Module-level functions share compiled loops.
CALLS = []


def counted_markov_step(table, tokens, state):
    jax.debug.callback(lambda: CALLS.append(1))
    return markov_step(table, tokens, state)


class MarkovChain:
    """Random logits after each prompt, and a random second-order table."""

    def __init__(self, seed, vocab_size, batch, eos_boost=0.0, eos_id=0):
        rng = np.random.default_rng(seed)
        self.table = 2.0 * rng.standard_normal((vocab_size,) * 3).astype(np.float32)
        self.table[..., eos_id] += eos_boost
        self.logits = (2.0 * rng.standard_normal((batch, vocab_size))).astype(
            np.float32
        )
        self.logits[:, eos_id] += eos_boost
        self.prev = rng.integers(0, vocab_size, batch).astype(np.int32)
        self.vocab_size = vocab_size

    def state(self):
        return {"prev": jnp.asarray(self.prev)}

    def log_probs(self, row, sequence):
        """Per-token log-probs of a continuation of prompt ``row``."""
        out, prev, logits = [], self.prev[row], self.logits[row]
        for token in sequence:
            out.append(np_log_softmax(logits)[token])
            logits, prev = self.table[prev, token], token
        return out


def np_greedy(
    chain,
    row,
    max_new_tokens,
    *,
    eos_id=None,
    pad_id=0,
    prompt=(),
    repetition_penalty=None,
    ngram=None,
    suppress=(),
    min_new_tokens=0,
    presence=0.0,
    frequency=0.0,
    allowed=None,
    stops=(),
    limit=None,
):
    """Greedy decoding of one row in numpy: the raw-logit processors
    (``presence`` and ``frequency`` over the generated tokens' counts), then
    ``allowed(step, tokens) -> bool [V]`` if given; the row stops after an
    EOS id (``eos_id``: an id or ids), after a stop sequence of generated
    tokens, or after ``limit`` tokens. Returns the tokens and log-probs
    padded to ``max_new_tokens``, the length and the finish reason."""
    eos = set() if eos_id is None else set(np.atleast_1d(eos_id).tolist())
    history = [int(t) for t in prompt if t >= 0]
    tokens, log_probs, reason = [], [], decoding.FINISHED_LENGTH
    counts = np.zeros(chain.vocab_size)
    prev, logits = chain.prev[row], chain.logits[row].astype(np.float64)
    for step in range(max_new_tokens if limit is None else limit):
        z = logits[None]
        if repetition_penalty is not None:
            z = np_repetition_penalty(z, [history], repetition_penalty)
        z = z[0] - presence * (counts > 0) - frequency * counts
        if ngram is not None:
            z[list(np_ngram_banned(history, ngram))] = -np.inf
        z[list(suppress)] = -np.inf
        if step < min_new_tokens:
            z[list(eos)] = -np.inf
        if allowed is not None:
            z = np.where(allowed(step, tokens), z, -np.inf)
        if np.all(np.isneginf(z)):
            token, log_prob = int(np.argmax(logits)), 0.0
        else:
            token = int(np.argmax(z))
            log_prob = np_log_softmax(z)[token]
        tokens.append(token)
        log_probs.append(log_prob)
        history.append(token)
        counts[token] += 1
        if token in eos:
            reason = decoding.FINISHED_EOS
            break
        if any(tokens[-len(s) :] == list(s) for s in stops if len(tokens) >= len(s)):
            reason = decoding.FINISHED_STOP
            break
        logits, prev = chain.table[prev, token].astype(np.float64), token
    pad = max_new_tokens - len(tokens)
    return tokens + [pad_id] * pad, log_probs + [0.0] * pad, len(tokens), reason


def assert_greedy(chain, out, of_row=None, samples=1, reasons=True, **settings):
    """``generate``'s greedy ``out`` against :func:`np_greedy` row by row
    (``settings``, and ``of_row(row)``'s for prompt row ``row``; output row
    ``r`` is sample ``r % samples`` of prompt ``r // samples``): tokens,
    log-probs, lengths and, if ``reasons``, finish reasons."""
    for r in range(out.tokens.shape[0]):
        row = r // samples
        tokens, log_probs, length, reason = np_greedy(
            chain,
            row,
            out.tokens.shape[1],
            **settings,
            **(of_row(row) if of_row else {}),
        )
        np.testing.assert_array_equal(out.tokens[r], tokens, err_msg=f"row {r}")
        np.testing.assert_allclose(out.log_probs[r], log_probs, rtol=1e-5, atol=1e-6)
        assert int(out.lengths[r]) == length, r
        assert not reasons or int(out.finish_reasons[r]) == reason, r


def run_chain(chain, rows=None, step_fn=markov_step, **kwargs):
    """``decoding.generate`` on the chain's prompts ``rows`` (default all),
    with ``max_new_tokens=6`` and ``key(0)`` unless given."""
    rows = np.arange(len(chain.prev)) if rows is None else np.asarray(rows)
    return decoding.generate(
        step_fn,
        chain.table,
        chain.logits[rows],
        {"prev": jnp.asarray(chain.prev[rows])},
        **{"max_new_tokens": 6, "key": jax.random.key(0), **kwargs},
    )


def generate_greedy(chain, max_new_tokens, **kwargs):
    """``decoding.generate`` at temperature 0 on the chain's prompts."""
    return run_chain(chain, max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


def beam_chain(chain, step_fn=markov_step, **kwargs):
    """``decoding.beam_search`` on the chain's prompts."""
    return decoding.beam_search(
        step_fn, chain.table, chain.logits, chain.state(), **kwargs
    )


# A uniform chain over 5 tokens, for the cases of BAD_INPUTS.
UNIFORM_TABLE = jnp.log(jnp.full((5, 5), 0.2))
UNIFORM_LOGITS = jnp.zeros((2, 5))


def uniform_markov(table, tokens, state):
    return table[tokens], state


def np_openai_penalties(z, generated, presence, frequency, bias=None):
    """OpenAI's rule, row by row in float64: ``z - presence * [c > 0] -
    frequency * c + bias``, with ``c`` counted from each row's generated
    tokens (a list per row); ``presence``, ``frequency`` scalars or one per
    row, ``bias`` None, ``[V]`` or ``[B, V]``."""
    z = np.array(z, np.float64)
    presence = np.broadcast_to(np.asarray(presence, np.float64), z.shape[:1])
    frequency = np.broadcast_to(np.asarray(frequency, np.float64), z.shape[:1])
    for row, tokens in enumerate(generated):
        for token, count in collections.Counter(int(t) for t in tokens).items():
            z[row, token] -= presence[row] + frequency[row] * count
    if bias is not None:
        z = z + np.broadcast_to(np.asarray(bias, np.float64), z.shape)
    return z


def np_counts(generated, vocab_size):
    """``int32 [B, V]``: how often each token occurs in each row's list."""
    counts = np.zeros((len(generated), vocab_size), np.int32)
    for row, tokens in enumerate(generated):
        for token in tokens:
            counts[row, token] += 1
    return counts


def stop_step_on_bytes(ids, stops, token_bytes, min_new_tokens=0):
    """The first step t, from ``min_new_tokens - 1`` on, whose token's bytes
    complete a stop string: the bytes of tokens 0..t (``token_bytes[id]``
    each) hold one that ends past those of tokens 0..t-1; None if none."""
    encoded = [s.encode() for s in stops]
    for t in range(max(min_new_tokens - 1, 0), len(ids)):
        text = b"".join(token_bytes[i] for i in ids[: t + 1])
        before = len(text) - len(token_bytes[ids[t]])
        if any(text.find(s, max(0, before - len(s) + 1)) >= 0 for s in encoded):
            return t
    return None
