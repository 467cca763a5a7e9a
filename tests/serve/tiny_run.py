"""The service tests' tiny run: its buckets, prompts, and a greedy reference."""

import jax
import numpy as np

from lmhead import decoding
from lmhead.lm import model as model_lib
from lmhead.serve import requests

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


def direct_greedy(run, prompt, max_new_tokens):
    """``decoding.generate``'s greedy tokens and log-probs for ``prompt``
    alone, up to its end (EOS included)."""
    model, params, tokenizer = run
    logits, cache = model_lib.prefill(
        model, params, tokenizer.encode_array(prompt)[None]
    )
    tokens, log_probs, lengths, *_ = decoding.generate(
        model_lib.make_step_fn(model),
        params,
        logits,
        cache,
        key=jax.random.key(0),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        eos_id=eos_id(run),
        log_probs_from="model",
    )
    length = int(lengths[0])
    return np.asarray(tokens[0, :length]), np.asarray(log_probs[0, :length])
