"""The service tests' tiny run: its buckets, prompts, and a greedy reference."""

import jax
import numpy as np

from lmhead import decoding
from lmhead.lm import model as model_lib
from lmhead.serve import requests

BUCKETS = requests.Buckets(
    batch_sizes=(1, 4), prompt_lengths=(8,), new_tokens=(8,), beam_sizes=(2,)
)
PROMPTS = ["KING", "What", "Lord", "ROMEO:", "To be", "O", "He", "And so"]


def direct_greedy(run, prompt, max_new_tokens):
    model, params, tokenizer = run
    logits, cache = model_lib.prefill(
        model, params, tokenizer.encode_array(prompt)[None]
    )
    tokens, log_probs, *_ = decoding.generate(
        model_lib.make_step_fn(model),
        params,
        logits,
        cache,
        key=jax.random.key(0),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
    )
    return np.asarray(tokens[0]), np.asarray(log_probs[0])
