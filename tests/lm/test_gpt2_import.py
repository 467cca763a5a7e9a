"""Tests for lmhead/lm/gpt2_import.py and experiments/import_gpt2.py: a
random GPT-2-layout checkpoint in Hugging Face's files (tests/lm/gpt2_checkpoint.py),
imported into a run directory, against GPT-2's forward pass written in numpy
there: logits, greedy decoding, and the served completions; and the
checkpoints lmhead refuses, each with an error naming what is wrong.
"""

import json
import os
import tempfile

import jax
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import configuration, generation, gpt2_import, inference
from tests import run_experiment
from tests.errors import bad_input_test
from tests.lm.gpt2_checkpoint import (
    END_OF_TEXT,
    byte_level_tokenizer,
    gpt2_greedy,
    gpt2_log_softmax,
    gpt2_logits,
    imported_gpt2_run,
    write_gpt2_checkpoint,
)

# Encoded whole, as GPT-2's tokenizer does: "\n\n\n" is the merge "\n\n" and
# "\n", where encoding line by line would give three "\n".
TEXT = "To be, or not\n\n\nto be: the question"


def import_checkpoint(tmp_path, **options):
    """Writes a random checkpoint with ``options``, imports it; returns
    ``(fields, weights, load_run's (config, tokenizer, model, params))``."""
    fields, weights, workdir = imported_gpt2_run(str(tmp_path), **options)
    return fields, weights, generation.load_run(workdir)


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # GPT2LMHeadModel's names, tokenizer.json, gelu_new
        dict(prefix=False, vocab_files=True, activation_function="gelu"),
        dict(tie_word_embeddings=False, activation_function=..., n_inner=24),
    ],
    ids=["hf-names", "bare-names-vocab-files-exact-gelu", "untied"],
)
def test_imported_run_gives_gpt2s_logits(tmp_path, options):
    fields, weights, (config, tokenizer, model, params) = import_checkpoint(
        tmp_path, **options
    )
    assert model.tied == fields.get("tie_word_embeddings", True)
    assert config.model.activation == (
        "gelu" if fields.get("activation_function") == "gelu" else "gelu_tanh"
    )
    source = byte_level_tokenizer()
    assert tokenizer.encode(TEXT) == source.encode(TEXT).ids
    assert source.token_to_id("ĊĊ") in tokenizer.encode(TEXT)
    assert (
        tokenizer.eos_id == tokenizer.vocab_size - 1 == source.token_to_id(END_OF_TEXT)
    )
    assert tokenizer.encode("be" + END_OF_TEXT) == [*source.encode("be").ids, 296]
    assert tokenizer.decode(tokenizer.encode(TEXT + END_OF_TEXT)) == TEXT + END_OF_TEXT
    ids = tokenizer.encode(TEXT)[: model.max_len]
    got = jax.jit(model.apply)({"params": params}, np.asarray([ids]))[0]
    np.testing.assert_allclose(got, gpt2_logits(fields, weights, ids), atol=2e-5)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The GPT2LMHeadModel-named checkpoint, imported by the command."""
    folder = tmp_path_factory.mktemp("gpt2")
    fields, weights = write_gpt2_checkpoint(folder / "hf")
    result = run_experiment(
        "import_gpt2.py", f"--from={folder / 'hf'}", f"--workdir={folder / 'run'}"
    )
    assert result.returncode == 0, result.stderr
    assert "end-of-text id 296" in result.stdout and "n_ctx" in result.stdout
    return fields, weights, str(folder / "run")


def test_the_run_directory_records_the_import(imported):
    _, _, workdir = imported
    with open(os.path.join(workdir, gpt2_import.IMPORT_FILE)) as f:
        record = json.load(f)
    assert record["eos_id"] == 296 and record["weights"] == ["model.safetensors"]
    assert "resid_pdrop" in record["ignored"] and "n_embd" in record["read"]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0"]


def test_greedy_decoding_equals_gpt2s_in_numpy(imported):
    fields, weights, workdir = imported
    _, tokenizer, model, params = generation.load_run(workdir)
    prompt = tokenizer.encode("To be")
    logits, cache = inference.prefill(model, params, np.asarray([prompt]))
    tokens, *_ = decoding.generate(
        inference.make_step_fn(model),
        params,
        logits,
        cache,
        key=jax.random.key(0),
        max_new_tokens=10,
        temperature=0.0,
    )
    assert tokens[0].tolist() == gpt2_greedy(fields, weights, prompt, 10)


def test_served_completions_score_and_continue_as_gpt2(imported):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from lmhead.serve import engine as engine_lib
    from lmhead.serve import requests, web

    fields, weights, workdir = imported
    _, tokenizer, model, params = generation.load_run(workdir)
    buckets = requests.Buckets(batch_sizes=(1,), prompt_lengths=(16,), new_tokens=(8,))
    engine = engine_lib.Engine(model, params, tokenizer, buckets)
    app = web.make_app(engine, web.ServiceConfig(model_name="gpt2"))
    prompt = "To be, or not"
    ids = tokenizer.encode(prompt)
    with web.BackgroundServer(app) as url:
        info = httpx.get(url + "/tokenizer_info", timeout=60).json()
        scored, continued = (
            httpx.post(
                url + "/v1/completions",
                json={"model": "gpt2", "prompt": prompt, "temperature": 0, **body},
                timeout=120,
            ).json()["choices"][0]
            for body in (
                {"echo": True, "max_tokens": 0, "logprobs": 1},
                {"max_tokens": 6},
            )
        )
    assert info["eos_token"] == END_OF_TEXT
    log_probs = gpt2_log_softmax(fields, weights, ids)
    want = [log_probs[t - 1, ids[t]] for t in range(1, len(ids))]
    got = scored["logprobs"]["token_logprobs"]
    assert got[0] is None
    np.testing.assert_allclose(got[1:], want, atol=1e-5)
    greedy = gpt2_greedy(fields, weights, ids, 6)
    assert continued["text"] == tokenizer.decode(greedy)


def test_imported_head_quantizes_for_decoding(imported):
    fields, weights, workdir = imported
    _, tokenizer, model, params = generation.load_run(workdir)
    small = generation.quantize_for_decoding(model, params, "int8")
    ids = tokenizer.encode(TEXT)[: model.max_len]
    got = jax.jit(model.apply)({"params": small}, np.asarray([ids]))[0]
    want = gpt2_logits(fields, weights, ids)
    assert (np.argmax(got, -1) == np.argmax(want, -1)).mean() >= 0.9
    np.testing.assert_allclose(got, want, atol=0.1)


def test_sharded_weights_read_as_one_file(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_gpt2_checkpoint(tmp_path / "one")
    gpt2 = gpt2_import.read_config(str(tmp_path / "one"))
    config = gpt2_import.run_config(gpt2, gpt2.vocab_size)
    model = configuration.make_model(config, gpt2.vocab_size)
    shapes = gpt2_import.expected_shapes(model, gpt2_import.weight_paths(gpt2))
    tensors = load_file(str(tmp_path / "one" / "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    os.makedirs(tmp_path / "two")
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / "two" / shard))
    with open(tmp_path / "two" / gpt2_import.WEIGHTS_INDEX, "w") as f:
        json.dump({"weight_map": {k: s for s, ks in shards.items() for k in ks}}, f)
    one, two = (
        gpt2_import.read_weights(str(tmp_path / n), shapes, True)
        for n in ("one", "two")
    )
    assert sorted(one) == sorted(two) == sorted(shapes)
    for name in one:
        np.testing.assert_array_equal(one[name], two[name])


def bad_import(remove=None, twice=False, **options):
    """Imports a checkpoint written with ``options`` (less the file
    ``remove``) into a fresh folder, ``twice`` over the same run."""

    def call():
        folder = tempfile.mkdtemp()
        source = os.path.join(folder, "hf")
        write_gpt2_checkpoint(source, **options)
        if remove is not None:
            os.remove(os.path.join(source, remove))
        for _ in range(1 + twice):
            gpt2_import.import_gpt2(source, os.path.join(folder, "run"))

    return call


def without(name):
    return lambda tensors: tensors.pop(name)


def reshaped(name):
    def edit(tensors):
        tensors[name] = tensors[name][:, :-1]

    return edit


BAD_INPUTS = [
    ("missing field", bad_import(n_layer=...), ValueError, "n_layer"),
    ("relu", bad_import(activation_function="relu"), ValueError,
     "activation_function"),
    ("quick gelu", bad_import(activation_function="quick_gelu"), ValueError,
     "activation_function"),
    ("cross-attention", bad_import(add_cross_attention=True), ValueError,
     "add_cross_attention"),
    ("inverse layer scale", bad_import(scale_attn_by_inverse_layer_idx=True),
     ValueError, "scale_attn_by_inverse_layer_idx"),
    ("unscaled attention", bad_import(scale_attn_weights=False), ValueError,
     "scale_attn_weights"),
    ("epsilon", bad_import(layer_norm_epsilon=1e-6), ValueError,
     "layer_norm_epsilon"),
    ("another model", bad_import(model_type="gpt_neo"), ValueError, "model_type"),
    ("heads", bad_import(n_head=3), ValueError, "n_head"),
    ("not a count", bad_import(n_inner=0), ValueError, "n_inner"),
    ("vocabulary", bad_import(vocab_size=300), ValueError,
     "vocab_size"),
    ("eos", bad_import(eos_token_id=0), ValueError, "eos_token_id"),
    ("missing weight", bad_import(edit=without("transformer.h.1.mlp.c_fc.bias")),
     ValueError, "h.1.mlp.c_fc.bias"),
    ("shape", bad_import(edit=reshaped("transformer.h.0.attn.c_attn.weight")),
     ValueError, "transformer.h.0.attn.c_attn.weight"),
    ("unknown weight", bad_import(edit=lambda t: t.update(
        {"score.weight": np.zeros((2, 16), np.float32)})), ValueError,
     "score.weight"),
    ("twice", bad_import(edit=lambda t: t.update(
        {"ln_f.bias": t["transformer.ln_f.bias"]})), ValueError, "ln_f.bias"),
    ("integer weight", bad_import(edit=lambda t: t.update(
        {"transformer.ln_f.bias": np.zeros(16, np.int32)})), ValueError,
     "transformer.ln_f.bias"),
    ("untied head", bad_import(edit=lambda t: t.update(
        {"lm_head.weight": 2 * t["lm_head.weight"]})), ValueError,
     ("lm_head.weight", "tie_word_embeddings")),
    *((f"no {name}", bad_import(remove=name), FileNotFoundError, name)
      for name in ("config.json", "tokenizer.json", "model.safetensors")),
    ("imported twice", bad_import(twice=True), FileExistsError, "checkpoints"),
]  # fmt: skip

test_bad_checkpoint_raises_naming_the_field_or_weight = bad_input_test(BAD_INPUTS)
