r"""The cost of structured output: a JSON Schema's mask per decoding step, its
compile, and no compile at request time.

    python experiments/bench/bench_structured.py           # docs/decoding.md's table
    python experiments/bench/bench_structured.py --quick   # tiny models, 4 new tokens

For each vocabulary (characters, V = 85; byte-level BPE trained on the
corpus, V = 2048; a random GPT-2-small checkpoint imported as
``bench_import_gpt2.py`` makes it, V = 50257) and ``--batch`` rows, times
``decoding.generate`` of ``--new_tokens`` tokens at temperature 1 with no
constraint, a JSON Schema on every row and on one row, side by side
(``timing.alternate``); the schema is an array of at least 64 digits, so
that no row ends inside the loop and every variant runs the same steps.
Then: the host's share alone (``GrammarMasker.advance`` of the rows), a
new schema's compile against the vocabulary and the cached one, the
compiles of the loop across new constraints (0), and the validity of
samples of an object schema that end (``jsonschema``). ``docs/benchmarks.md``
says how; ``docs/decoding.md`` has the numbers.
"""

import json
import os
import shutil
import tempfile
import time

import bench_import_gpt2  # experiments/bench/, beside this file
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags, logging

from lmhead import decoding
from lmhead.lm import (
    configuration,
    constraints,
    data,
    generation,
    gpt2_import,
    inference,
)

# --quick comes with bench_import_gpt2, whose checkpoint this reuses.
flags.DEFINE_integer("batch", 16, "Rows decoded together.", lower_bound=1)
flags.DEFINE_integer("new_tokens", 32, "Tokens per row.", lower_bound=1)
flags.DEFINE_integer("rounds", 5, "Timed rounds (median).", lower_bound=1)
flags.DEFINE_integer("schemas", 8, "New schemas compiled per vocabulary.")
timing.cli.matmul_size_flag(1024)
FLAGS = flags.FLAGS

PROMPT = "ROMEO:\n"
# No row of this ends inside a short loop: every variant runs its steps.
LONG = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 64,
}
# A schema whose samples end (for validity), and its family of new ones.
OBJECT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def new_schema(i: int) -> dict:
    """A schema not compiled before (its text differs)."""
    schema = json.loads(json.dumps(OBJECT))
    schema["properties"][f"field_{i}"] = {"enum": [f"value {i}", "other"]}
    return schema


def vocabularies(folder: str):
    """``(name, model, params, tokenizer)`` of each vocabulary."""
    text = data.shakespeare_text()
    config = configuration.load_config()
    tiny = dict(num_layers=1, num_heads=2, d_model=32, mlp_dim=64)
    for name, make in (
        ("characters", lambda: data.CharTokenizer.train(text, data.END_OF_TEXT)),
        (
            "BPE",
            lambda: data.BPETokenizer.train(
                text[: 200_000 if FLAGS.quick else 2_000_000], 2048, data.END_OF_TEXT
            ),
        ),
    ):
        tokenizer = make()
        model = configuration.make_model(config, tokenizer.vocab_size)
        model = model.clone(max_len=128, **(tiny if FLAGS.quick else {}))
        params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        yield name, model, params["params"], tokenizer
    fields = bench_import_gpt2.QUICK if FLAGS.quick else bench_import_gpt2.GPT2_SMALL
    fields = {**fields, "vocab_size": 50257}
    bench_import_gpt2.write_checkpoint(os.path.join(folder, "hf"), fields)
    run = gpt2_import.import_gpt2(
        os.path.join(folder, "hf"), os.path.join(folder, "run")
    )
    _, tokenizer, model, params = generation.load_run(run.workdir)
    yield "GPT-2 layout", model, params, tokenizer


def prefilled(model, params, tokenizer, batch: int, new: int):
    ids = np.asarray(tokenizer.encode(PROMPT), np.int32)
    return inference.prefill(
        model, params, np.tile(ids, (batch, 1)), max_new_tokens=new
    )


def time_steps(model, params, tokenizer, masker, matmul) -> dict:
    """Per-step times of the loop without and with the long schema."""
    batch, new = FLAGS.batch, FLAGS.new_tokens
    logits, cache = prefilled(model, params, tokenizer, batch, new)
    step_fn = inference.make_step_fn(model)
    long = constraints.Constraint.json_schema(LONG)
    keys = jax.random.split(jax.random.key(0), batch)

    def loop(constraint=None):
        return decoding.generate(
            step_fn, params, logits, cache, key=keys, max_new_tokens=new,
            temperature=1.0, eos_id=tokenizer.eos_id, constraint=constraint,
        ).tokens  # fmt: skip

    made = []

    def rows(count):
        def setup():
            for ids in made:
                masker.release(ids)
            made.clear()
            row = constraints.row_constraint(
                masker, [long] * count + [None] * (batch - count)
            )
            made.append(row.ids.tolist())
            return (row,)

        return setup

    loop()
    for count in (batch, 1):
        loop(*rows(count)())  # compiles once for every constraint
    compiled = decoding.sampling._sampling_loop._cache_size()
    times = timing.alternate(
        {"plain": loop, "every row": loop, "one row": loop},
        matmul,
        FLAGS.rounds,
        setups={"every row": rows(batch), "one row": rows(1)},
    )
    host = host_seconds(masker, long, batch, new)
    return {
        "plain": times["plain"][0] / new,
        "every row": times["every row"][0] / new,
        "one row": times["one row"][0] / new,
        "host": host,
        "new compiles": decoding.sampling._sampling_loop._cache_size() - compiled,
    }


def host_seconds(masker, constraint, batch: int, steps: int) -> float:
    """The host's share of a step alone: ``masker.advance`` of ``batch``
    rows, each taking the first token its automaton allows (found first,
    untimed), per step."""
    taken, nothing = np.ones(batch, bool), np.zeros(batch, np.int32)
    ids = constraints.row_constraint(masker, [constraint]).ids
    words, tokens = masker.advance(ids, nothing[:1], ~taken[:1]), []
    for _ in range(steps):
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        tokens.append(int(np.argmax(bits[: masker.vocab_size])))
        words = masker.advance(ids, np.asarray(tokens[-1:], np.int32), taken[:1])
    masker.release(ids.tolist())
    ids = constraints.row_constraint(masker, [constraint] * batch).ids
    masker.advance(ids, nothing, ~taken)
    start = time.perf_counter()
    for token in tokens:
        masker.advance(ids, np.full(batch, token, np.int32), taken)
    seconds = (time.perf_counter() - start) / steps
    masker.release(ids.tolist())
    return seconds


def compile_times(masker) -> tuple[float, float]:
    """The median seconds of a new schema's compile, and of a cached one's."""
    new, cached = [], []
    base = time.time_ns()
    for i in range(FLAGS.schemas):
        constraint = constraints.Constraint.json_schema(new_schema(base + i))
        start = time.perf_counter()
        masker.compile(constraint)
        new.append(time.perf_counter() - start)
        start = time.perf_counter()
        masker.start(constraint)
        cached.append(time.perf_counter() - start)
    return float(np.median(new)), float(np.median(cached))


def validity(model, params, tokenizer, masker) -> tuple[int, int]:
    """``(ended, valid)`` of ``--batch`` samples of :data:`OBJECT`."""
    batch, new = FLAGS.batch, 64
    logits, cache = prefilled(model, params, tokenizer, batch, new)
    row = constraints.row_constraint(
        masker, [constraints.Constraint.json_schema(OBJECT)] * batch
    )
    out = jax.device_get(
        decoding.generate(
            inference.make_step_fn(model), params, logits, cache,
            key=jax.random.split(jax.random.key(1), batch), max_new_tokens=new,
            temperature=1.0, eos_id=tokenizer.eos_id, constraint=row,
        )
    )  # fmt: skip
    masker.release(row.ids.tolist())
    ended = valid = 0
    for tokens, length, reason in zip(out.tokens, out.lengths, out.finish_reasons):
        if reason != decoding.FINISHED_EOS:
            continue
        ended += 1
        try:
            jsonschema.validate(
                json.loads(tokenizer.decode(tokens[: length - 1])), OBJECT
            )
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ended, valid


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs each checkpoint
    if FLAGS.quick:
        FLAGS.new_tokens, FLAGS.rounds, FLAGS.schemas = 4, 2, 2
    print(timing.machine(), f"load average {os.getloadavg()[0]:.1f}", flush=True)
    matmul = timing.Matmul(FLAGS.matmul_size)
    folder = tempfile.mkdtemp(prefix="bench-structured-")
    rows = []
    try:
        for name, model, params, tokenizer in vocabularies(folder):
            start = time.perf_counter()
            masker = constraints.GrammarMasker(tokenizer)
            vocabulary_s = time.perf_counter() - start
            new_s, cached_s = compile_times(masker)
            steps = time_steps(model, params, tokenizer, masker, matmul)
            ended, valid = validity(model, params, tokenizer, masker)
            plain = steps["plain"]
            rows.append([
                name, tokenizer.vocab_size, f"{1e3 * plain:.2f}",
                f"{1e3 * steps['every row']:.2f} ({steps['every row'] / plain - 1:+.1%})",
                f"{1e3 * steps['one row']:.2f} ({steps['one row'] / plain - 1:+.1%})",
                f"{1e3 * steps['host']:.3f}", f"{1e3 * new_s:.1f}",
                f"{1e3 * cached_s:.2f}", f"{vocabulary_s:.2f}",
                steps["new compiles"], f"{valid}/{ended}",
            ])  # fmt: skip
            print(f"{name}: done", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"batch {FLAGS.batch}, {FLAGS.new_tokens} new tokens, temperature 1; ms "
        f"per step (median of {FLAGS.rounds}); load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        timing.table(
            ["vocabulary", "V", "plain", "schema, every row", "schema, one row",
             "host, every row", "new schema", "cached", "vocabulary (s)",
             "new compiles", "valid / ended"],
            rows,
        )
    )  # fmt: skip


if __name__ == "__main__":
    app.run(main)
