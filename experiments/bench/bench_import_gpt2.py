r"""Imports a random GPT-2-small-shaped checkpoint and measures its int8 head.

    python experiments/bench/bench_import_gpt2.py                # GPT-2 small: 12 x 768, V = 50,257
    python experiments/bench/bench_import_gpt2.py --quick        # 2 layers, d_model 64, V = 1000: seconds

A Hugging Face GPT-2 directory at GPT-2's initialization with a synthetic
byte-level tokenizer, then the times of ``gpt2_import.import_gpt2`` and the
first ``generation.load_run``, the head's bytes in float32 and int8 and the
int8 head's top-1 agreement. ``docs/benchmarks.md`` says how;
``docs/gpt2_checkpoints.md`` has the results.
"""

import json
import os
import shutil
import tempfile
import time

import jax
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags, logging
from safetensors.numpy import save_file

from lmhead.lm import configuration, generation, gpt2_import
from lmhead.lm import model as model_lib

timing.cli.quick_flag()
flags.DEFINE_string("folder", None, "Where to write the checkpoint and the run; kept.")
flags.DEFINE_integer("windows", 4, "Windows of random tokens for the agreement.")
flags.DEFINE_integer("window", 256, "Tokens per window (at most n_positions).")
FLAGS = flags.FLAGS

GPT2_SMALL = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
QUICK = dict(vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=4)


def synthetic_vocabulary(size: int, seed: int = 0) -> tuple[dict, list[str]]:
    """A byte-level BPE vocabulary of ``size`` tokens: GPT-2's 256 byte
    characters, ``size - 257`` random merges of tokens made so far, and
    ``<|endoftext|>`` last (GPT-2's order)."""
    rng = np.random.default_rng(seed)
    tokens = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    tokens += [chr(c) for c in (*range(0xA1, 0xAD), *range(0xAE, 0x100))]
    tokens += [chr(256 + n) for n in range(256 - len(tokens))]
    known, merges = set(tokens), []
    while len(tokens) < size - 1:
        a, b = (tokens[i] for i in rng.integers(0, len(tokens), 2))
        if len(a + b) <= 12 and a + b not in known:
            tokens.append(a + b)
            known.add(a + b)
            merges.append(f"{a} {b}")
    tokens.append(gpt2_import.END_OF_TEXT)
    return {token: i for i, token in enumerate(tokens)}, merges


def write_checkpoint(folder: str, fields: dict, seed: int = 0) -> None:
    """A GPT2LMHeadModel-named checkpoint of ``fields`` at GPT-2's init."""
    os.makedirs(folder, exist_ok=True)
    fields = {**fields, "activation_function": "gelu_new", "model_type": "gpt2"}
    gpt2 = gpt2_import.parse_config(fields)
    config = gpt2_import.run_config(gpt2, gpt2.vocab_size)
    model = configuration.make_model(config, gpt2.vocab_size)
    shapes = gpt2_import.expected_shapes(model, gpt2_import.weight_paths(gpt2))
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("bias"):
            x = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            x = np.ones(shape, np.float32)
        else:
            x = rng.normal(0.0, 0.02, shape).astype(np.float32)
        tensors[f"transformer.{name}"] = x
    save_file(tensors, os.path.join(folder, "model.safetensors"), {"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**fields, "eos_token_id": gpt2.vocab_size - 1}, f)
    vocab, merges = synthetic_vocabulary(gpt2.vocab_size, seed)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")


def int8_agreement(workdir: str, windows: int, window: int) -> dict:
    """The head's bytes in float32 and int8, and the int8 head's top-1
    agreement with float32's over ``windows`` windows of random tokens."""
    _, _, model, params = generation.load_run(workdir)
    small = generation.quantize_for_decoding(model, params, "int8")
    tokens = np.random.default_rng(1).integers(
        0, model.vocab_size, (windows, min(window, model.max_len))
    )
    apply = jax.jit(model.apply)
    same = 0
    for row in tokens:
        full, fewer = (apply({"params": p}, row[None])[0] for p in (params, small))
        same += int(np.sum(np.argmax(full, -1) == np.argmax(fewer, -1)))
    table = small[model_lib.HEAD_TABLE]
    return {
        "float32 bytes": params["embed"]["embedding"].nbytes,
        "int8 bytes": sum(x.nbytes for x in jax.tree.leaves(table)),
        "top-1 agreement": same / tokens.size,
        "positions": tokens.size,
    }


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs each checkpoint
    f = FLAGS
    folder = f.folder or tempfile.mkdtemp(prefix="gpt2-import-")
    print(timing.machine(), flush=True)
    try:
        start = time.perf_counter()
        write_checkpoint(os.path.join(folder, "hf"), QUICK if f.quick else GPT2_SMALL)
        print(
            f"wrote the checkpoint in {time.perf_counter() - start:.1f} s", flush=True
        )
        run = gpt2_import.import_gpt2(
            os.path.join(folder, "hf"), os.path.join(folder, "run")
        )
        print(f"import: {run.seconds:.1f} s", flush=True)
        start = time.perf_counter()
        generation.load_run(run.workdir)
        print(f"load_run: {time.perf_counter() - start:.1f} s", flush=True)
        result = int8_agreement(run.workdir, f.windows, f.window)
        print(
            f"head table: float32 {result['float32 bytes'] / 2**20:.1f} MiB, int8 "
            f"{result['int8 bytes'] / 2**20:.1f} MiB "
            f"({result['int8 bytes'] / result['float32 bytes']:.3f} x); int8 top-1 "
            f"agreement {result['top-1 agreement']:.2%} over "
            f"{result['positions']} positions"
        )
    finally:
        if not f.folder:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
