"""Loading a trained run, generating text with it, writing its samples.

Shared by ``experiments/generate.py``, the training loop's samples and the
notebook: :func:`load_run` gives a run's ``(config, tokenizer, model,
params)``, :func:`generate_text` continues a prompt with it.
"""

import functools
import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np

from lmhead import checkpoints
from lmhead import data
from lmhead import decoding
from lmhead import model as model_lib
from lmhead import train

SAMPLE_SEPARATOR = "\n---------------\n"


def load_run(workdir: str):
    """A trained run's ``(config, tokenizer, model, params)``, newest checkpoint."""
    with open(os.path.join(workdir, "config.json")) as f:
        config = ml_collections.ConfigDict(json.load(f))
    tokenizer = data.load_tokenizer(os.path.join(workdir, data.TOKENIZER_FILE))
    model = train.make_model(config, tokenizer.vocab_size)
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise FileNotFoundError(f"{workdir} has no checkpoints/.")
    manager = checkpoints.checkpoint_manager(workdir)
    if manager.latest_step() is None:
        raise FileNotFoundError(f"{workdir}/checkpoints holds no checkpoint.")
    state = train.restore_or_init(manager, model, config, jax.random.key(0))
    manager.close()
    return config, tokenizer, model, state.params


def generate_text(model: model_lib.DecoderLM, params: Any, tokenizer: data.Tokenizer,
                  prompt: str, *, key: jax.Array, num_samples: int,
                  max_new_tokens: int, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None,
                  num_beams: int | None = None) -> list[str]:
    """``num_samples`` continuations of ``prompt``, each with the prompt.

    The cache holds ``max_len`` positions, so the text is made window by
    window, as nanoGPT crops its context: each window is prefilled with the
    last ``C = max_len // 2`` tokens so far (at first the prompt, cropped to
    ``C`` and right-padded) and adds ``max_len - C`` tokens; the last window's
    surplus is cut off. Every window has the same shapes, so it compiles once.
    Beam search, too, runs per window and keeps the best beam.
    ``temperature=0`` is greedy.
    """
    if model.max_len < 2:
        raise ValueError("generate_text needs a model with max_len >= 2.")
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ValueError("prompt must encode to at least one token.")
    context_len = model.max_len // 2
    ids = [np.tile(np.asarray(prompt_ids[-context_len:], np.int32), (num_samples, 1))]
    lengths = np.full([num_samples], ids[0].shape[1], np.int32)
    generated = 0
    while generated < max_new_tokens:
        context = np.concatenate(ids, axis=1)[:, -context_len:]
        context = np.pad(context, [(0, 0), (0, context_len - context.shape[1])])
        key, window_key = jax.random.split(key)
        ids.append(np.asarray(_continue(
            model, params, context, lengths, window_key,
            max_new_tokens=model.max_len - context_len, temperature=temperature,
            top_k=top_k, top_p=top_p, num_beams=num_beams)))
        generated += ids[-1].shape[1]
        lengths[:] = context_len
    new_ids = np.concatenate(ids[1:], axis=1)[:, :max_new_tokens]
    return [prompt + tokenizer.decode(row) for row in new_ids]


@functools.partial(jax.jit, static_argnums=0, static_argnames=(
    "max_new_tokens", "temperature", "top_k", "top_p", "num_beams"))
def _continue(model, params, context, lengths, key, *, max_new_tokens,
               temperature, top_k, top_p, num_beams):
    """``[B, max_new_tokens]`` tokens after ``context[b, :lengths[b]]``."""
    logits, cache = model_lib.prefill(model, params, context, lengths)
    step_fn = model_lib.make_step_fn(model)
    if num_beams:
        tokens, _, _ = decoding.beam_search(
            step_fn, params, logits, cache, num_beams=num_beams,
            max_new_tokens=max_new_tokens, eos_id=None)
        return tokens[:, 0]
    tokens, _, _ = decoding.generate(
        step_fn, params, logits, cache, key=key, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p)
    return tokens


def write_samples(config, model, params, tokenizer, key, workdir) -> None:
    """Writes ``config.sample``'s continuations to ``workdir/samples.txt`` and prints them."""
    texts = generate_text(
        model, params, tokenizer, config.sample.prompt, key=key,
        num_samples=config.sample.num_samples,
        max_new_tokens=config.sample.max_new_tokens,
        temperature=config.sample.temperature, top_k=config.sample.top_k,
        top_p=config.sample.top_p)
    joined = SAMPLE_SEPARATOR.join(texts)
    with open(os.path.join(workdir, "samples.txt"), "w", encoding="utf-8") as f:
        f.write(joined + "\n")
    print(joined, flush=True)
