"""The service tests' tiny run: its buckets, prompts, and the reference
decoder, ``decoding.generate`` on one prompt at a time."""

import jax
import numpy as np

from lmhead import decoding
from lmhead.lm import inference
from lmhead.serve import requests
from tests import references

BUCKETS = requests.Buckets(
    batch_sizes=(1, 4), prompt_lengths=(8, 16), new_tokens=(8,), beam_sizes=(2,)
)
PROMPTS = ["KING", "What", "Lord", "ROMEO:", "To be", "O", "He", "And so"]


def eos_id(run):
    """The run's end-of-text id (None for a tokenizer without one)."""
    return getattr(run[2], "eos_id", None)


def text_of(run, tokens):
    """The completion text of ``tokens``: cut before EOS, as the service's."""
    return decoding.detokenize(np.asarray(tokens, np.int32), run[2], eos_id=eos_id(run))


def numpy_log_softmax(run, ids):
    """The model's log-softmax at each position of ``ids``, in float64 numpy."""
    model, params, _ = run
    logits = jax.jit(model.apply)({"params": params}, np.asarray([ids]))[0]
    return references.log_softmax(logits)


def reference(run, prompt, max_new_tokens, *, keys=None, knobs=None, top=5, stop=None):
    """``decoding.generate`` (numpy arrays) on ``prompt`` (a text or token
    ids) alone, one row per key (default: one greedy row), with the
    model's log-probs and ``top`` top log-probs, ending at EOS (and at
    ``stop``, a stop condition, if given)."""
    model, params, tokenizer = run
    ids = tokenizer.encode_array(prompt) if isinstance(prompt, str) else prompt
    rows = 1 if keys is None else len(keys)
    logits, cache = inference.prefill(
        model, params, np.repeat(np.asarray(ids, np.int32)[None], rows, 0)
    )
    result = decoding.generate(
        inference.make_step_fn(model),
        params,
        logits,
        cache,
        key=jax.random.key(0) if keys is None else keys,
        max_new_tokens=max_new_tokens,
        knobs=knobs or decoding.SamplingKnobs(temperature=0.0),
        top_logprobs=top,
        log_probs_from="model",
        eos_id=eos_id(run),
        stop=stop,
    )
    return jax.device_get(result)


def greedy_tokens(run, prompt, max_new_tokens, **knobs):
    """The greedy tokens of :func:`reference` with ``knobs``, up to the end."""
    want = reference(
        run, prompt, max_new_tokens,
        knobs=decoding.SamplingKnobs(temperature=0.0, **knobs), top=0,
    )  # fmt: skip
    return want.tokens[0, : want.lengths[0]].tolist()
