"""Bad inputs, one table per layer: each case must raise exactly the expected
exception type (not a subclass, not an error from deeper down) with a message
that contains the given fragment, which names the argument or config key.

Layers: the pure functions (head, losses, fused, decoding), the Flax modules,
the config (checked by ``train.train_and_evaluate`` before it makes the
workdir), the data, a workdir that belongs to another run, and the
command-line programs. Config and data errors must come before anything is
compiled: those cases run with ``compile_steps`` and ``restore_or_init``
replaced by functions that fail the test.

Sweeps with a failing run are tested in test_sweeps.py (the others finish,
the run is marked FAILED) and test_report.py (the report lists it).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from configs import default
from lmhead import decoding
from lmhead import fused
from lmhead import generation
from lmhead import head
from lmhead import losses
from lmhead import model as model_lib
from lmhead import modules
from lmhead import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

H = jnp.ones((2, 3, 4))
W = jnp.ones((5, 4))
LOGITS = jnp.zeros((2, 5))
LABELS = jnp.zeros((2,), jnp.int32)
TABLE = jnp.log(jnp.full((5, 5), 0.2))
KEY = jax.random.key(0)


def markov(table, tokens, state):
    return table[tokens], state


def generate(**kwargs):
    return decoding.generate(markov, TABLE, LOGITS, (), key=KEY,
                             **{"max_new_tokens": 2, **kwargs})


def beam(**kwargs):
    return decoding.beam_search(markov, TABLE, LOGITS, (), **{
        "num_beams": 2, "max_new_tokens": 2, "eos_id": None, **kwargs})


def fused_ce(**kwargs):
    return fused.fused_cross_entropy(
        kwargs.pop("h", H[0]), kwargs.pop("w", W),
        kwargs.pop("labels", jnp.zeros((3,), jnp.int32)), **kwargs)


class Letters:
    def decode(self, ids):
        return "".join("abcde"[i] for i in ids)


PURE = [
    # head.py
    ("unembed integer h", lambda: head.unembed(H.astype(jnp.int32), W),
     TypeError, "h must have a floating-point dtype"),
    ("unembed w rank 1", lambda: head.unembed(H, W[0]),
     ValueError, "w must have shape [V, D]"),
    ("unembed D mismatch", lambda: head.unembed(jnp.ones((2, 3)), W),
     ValueError, "h must have shape [..., D] with D = w.shape[1] = 4"),
    ("unembed bias shape", lambda: head.unembed(H, W, jnp.zeros(4)),
     ValueError, "bias must have shape [V] = (5,)"),
    ("unembed scale 0", lambda: head.unembed(H, W, scale=0.0),
     ValueError, "scale must be in (0, inf]"),
    ("unembed softcap < 0", lambda: head.unembed(H, W, softcap=-1.0),
     ValueError, "softcap must be in (0, inf]"),
    ("log_probs integer logits", lambda: head.log_probs(LABELS),
     TypeError, "logits must have a floating-point dtype"),
    ("log_probs scalar logits", lambda: head.log_probs(jnp.float32(1.0)),
     ValueError, "logits must have shape [..., V]"),
    ("probs temperature 0", lambda: head.probs(LOGITS, 0.0),
     ValueError, "temperature must be > 0 for a distribution"),
    ("probs temperature < 0", lambda: head.probs(LOGITS, -1.0),
     ValueError, "temperature must be in (0, inf]"),
    ("output_distribution output", lambda: head.output_distribution(
        H, W, output="logit"), ValueError, "output must be one of"),
    ("last_positions h rank", lambda: head.last_positions(H[0], LABELS),
     ValueError, "h must have shape [B, T, D]"),
    ("last_positions float lengths", lambda: head.last_positions(
        H, jnp.ones(2)), TypeError, "lengths must have an integer dtype"),
    ("last_positions lengths shape", lambda: head.last_positions(
        H, jnp.ones(3, jnp.int32)), ValueError, "lengths must have shape [B] = (2,)"),
    ("last_positions length 0", lambda: head.last_positions(
        H, jnp.array([0, 1])), ValueError, "lengths must be in [1, 3]; got 0"),
    ("last_positions length > T", lambda: head.last_positions(
        H, jnp.array([1, 4])), ValueError, "lengths must be in [1, 3]; got 4"),
    # losses.py
    ("cross_entropy float labels", lambda: losses.cross_entropy(
        LOGITS, jnp.zeros(2)), TypeError, "labels must have an integer dtype"),
    ("cross_entropy labels shape", lambda: losses.cross_entropy(
        LOGITS, jnp.zeros(3, jnp.int32)), ValueError,
     "labels must have the leading shape of the logits"),
    ("cross_entropy weights shape", lambda: losses.cross_entropy(
        LOGITS, LABELS, weights=jnp.ones(3)), ValueError,
     "weights must have the shape of labels (2,)"),
    ("cross_entropy label = V", lambda: losses.cross_entropy(
        LOGITS, jnp.array([0, 5])), ValueError,
     "labels must be in [0, 5) wherever weights are nonzero; got 5"),
    ("cross_entropy label < 0", lambda: losses.cross_entropy(
        LOGITS, jnp.array([-1, 0])), ValueError, "labels must be in [0, 5)"),
    ("cross_entropy label_smoothing 1", lambda: losses.cross_entropy(
        LOGITS, LABELS, label_smoothing=1.0), ValueError,
     "label_smoothing must be in [0, 1)"),
    ("cross_entropy smoothing", lambda: losses.cross_entropy(
        LOGITS, LABELS, smoothing="soft"), ValueError, "smoothing must be one of"),
    ("cross_entropy z_loss < 0", lambda: losses.cross_entropy(
        LOGITS, LABELS, z_loss=-1e-4), ValueError, "z_loss must be in [0, inf]"),
    ("cross_entropy reduction", lambda: losses.cross_entropy(
        LOGITS, LABELS, reduction="avg"), ValueError, "reduction must be one of"),
    ("cross_entropy integer logits", lambda: losses.cross_entropy(
        LABELS[:, None], LABELS), TypeError, "logits must have a floating-point"),
    ("ece num_bins 0", lambda: losses.expected_calibration_error(
        LOGITS, LABELS, num_bins=0), ValueError, "num_bins must be an integer >= 1"),
    ("bits_per_character 0 chars", lambda: losses.bits_per_character(1.0, 0.0),
     ValueError, "chars_per_token must be in (0, inf]"),
    # fused.py
    ("fused chunk_size 0", lambda: fused_ce(chunk_size=0),
     ValueError, "chunk_size must be an integer >= 1 or None; got 0"),
    ("fused vocab_chunk_size float", lambda: fused_ce(vocab_chunk_size=2.5),
     ValueError, "vocab_chunk_size must be an integer >= 1 or None; got 2.5"),
    ("fused D mismatch", lambda: fused_ce(w=jnp.ones((5, 3))),
     ValueError, "h must have shape [..., D] with D = w.shape[1] = 3"),
    ("fused integer w", lambda: fused_ce(w=W.astype(jnp.int32)),
     TypeError, "w must have a floating-point dtype"),
    ("fused bias shape", lambda: fused_ce(bias=jnp.zeros(4)),
     ValueError, "bias must have shape [V] = (5,)"),
    ("fused labels shape", lambda: fused_ce(labels=LABELS),
     ValueError, "labels must have the leading shape"),
    ("fused label = V", lambda: fused_ce(labels=jnp.array([0, 1, 5])),
     ValueError, "labels must be in [0, 5)"),
    ("fused softcap 0", lambda: fused_ce(softcap=0.0),
     ValueError, "softcap must be in (0, inf]"),
    ("fused traced label_smoothing", lambda: jax.jit(
        lambda eps: fused_ce(label_smoothing=eps))(0.1),
     TypeError, "label_smoothing must be a concrete number"),
    # decoding.py
    ("generate logits rank", lambda: decoding.generate(
        markov, TABLE, LOGITS[None], (), key=KEY, max_new_tokens=2),
     ValueError, "logits must have shape [B, V]"),
    ("generate max_new_tokens 0", lambda: generate(max_new_tokens=0),
     ValueError, "max_new_tokens must be an integer >= 1"),
    ("generate max_new_tokens float", lambda: generate(max_new_tokens=2.0),
     TypeError, "max_new_tokens must be a Python integer"),
    ("generate num_samples 0", lambda: generate(num_samples=0),
     ValueError, "num_samples must be an integer >= 1"),
    ("generate temperature < 0", lambda: generate(temperature=-0.5),
     ValueError, "temperature must be in [0, inf]"),
    ("generate top_k < 0", lambda: generate(top_k=-1),
     ValueError, "top_k must be in [0, inf]"),
    ("generate top_p per row, wrong shape", lambda: generate(top_p=jnp.full(3, 0.9)),
     ValueError, "top_p must be a scalar or have one value per row, shape (2,)"),
    ("generate temperature per row < 0", lambda: generate(
        temperature=jnp.array([0.0, -1.0])), ValueError, "temperature must be in [0"),
    ("generate top_k float", lambda: generate(top_k=2.0),
     TypeError, "top_k must have an integer dtype"),
    ("generate top_p 0", lambda: generate(top_p=0.0),
     ValueError, "top_p must be in (0, 1]"),
    ("generate top_p > 1", lambda: generate(top_p=1.5),
     ValueError, "top_p must be in (0, 1]"),
    ("generate min_p > 1", lambda: generate(min_p=1.5),
     ValueError, "min_p must be in [0, 1]"),
    ("generate repetition_penalty 0", lambda: generate(
        repetition_penalty=0.0), ValueError, "repetition_penalty must be in (0"),
    ("generate no_repeat_ngram_size 0", lambda: generate(
        no_repeat_ngram_size=0), ValueError, "no_repeat_ngram_size must be an"),
    ("generate min_new_tokens < 0", lambda: generate(min_new_tokens=-1),
     ValueError, "min_new_tokens must be in [0, inf]"),
    ("generate eos_id = V", lambda: generate(eos_id=5),
     ValueError, "eos_id must be an integer in [0, V) = [0, 5)"),
    ("generate suppress_tokens", lambda: generate(suppress_tokens=[7]),
     ValueError, "suppress_tokens must be an integer in [0, V)"),
    ("generate state batch axis", lambda: decoding.generate(
        markov, TABLE, LOGITS, {"cache": jnp.zeros((3, 4))}, key=KEY, max_new_tokens=2),
     ValueError, "every leaf of state must have the batch axis B = 2 first"),
    ("generate prompt_tokens batch", lambda: generate(
        repetition_penalty=1.2, prompt_tokens=jnp.zeros((3, 2), jnp.int32)),
     ValueError, "prompt_tokens must have shape [B, P] with B = 2"),
    ("process_logits history missing", lambda: decoding.process_logits(
        LOGITS, repetition_penalty=1.2), ValueError, "history is required"),
    ("beam num_beams 0", lambda: beam(num_beams=0),
     ValueError, "num_beams must be an integer >= 1"),
    ("beam num_return_sequences > K", lambda: beam(num_return_sequences=3),
     ValueError, "num_return_sequences must be <= num_beams = 2"),
    ("beam penalty", lambda: beam(penalty="wu"),
     ValueError, "penalty must be one of"),
    ("beam length_penalty inf", lambda: beam(length_penalty=float("inf")),
     ValueError, "length_penalty must be finite"),
    ("beam eos_id < 0", lambda: beam(eos_id=-1),
     ValueError, "eos_id must be an integer in [0, V)"),
    ("detokenize no decode", lambda: decoding.detokenize([[0, 1]], object()),
     TypeError, "tokenizer must have a decode(ids: list[int]) -> str method"),
    ("detokenize float ids", lambda: decoding.detokenize([0.5], Letters()),
     TypeError, "ids must have an integer dtype"),
    ("detokenize scalar ids", lambda: decoding.detokenize(3, Letters()),
     ValueError, "ids must have shape [..., N]"),
]


def decoder(**overrides):
    return model_lib.DecoderLM(**{"vocab_size": 17, "num_layers": 1,
                                  "num_heads": 2, "d_model": 8, "mlp_dim": 16,
                                  "max_len": 8, **overrides})


def decoder_init(tokens, **overrides):
    return decoder(**overrides).init(KEY, tokens)


TOKENS = jnp.ones((1, 4), jnp.int32)

MODULES = [
    ("LMHead tied without embedding", lambda: modules.LMHead(5, tied=True).apply(
        {}, H), ValueError, "embedding is required when tied=True"),
    ("LMHead tied table shape", lambda: modules.LMHead(5, tied=True).apply(
        {}, H, jnp.ones((5, 3))), ValueError,
     "embedding must have shape [V, D] = (5, 4); got (5, 3)"),
    ("LMHead untied with embedding", lambda: modules.LMHead(5, tied=False).init(
        KEY, H, W), ValueError, "embedding must be None when tied=False"),
    ("LMHead loss_impl", lambda: modules.LMHead(5, tied=True).apply(
        {}, H, LABELS[None].repeat(3, 0).T, W, loss_impl="chunked",
        method="loss"), ValueError, "loss_impl must be one of"),
    ("DecoderLM num_heads", lambda: decoder_init(TOKENS, num_heads=3),
     ValueError, "num_heads must divide d_model"),
    ("DecoderLM positions", lambda: decoder_init(TOKENS, positions="alibi"),
     ValueError, "positions must be one of"),
    ("DecoderLM rope odd head", lambda: decoder_init(
        TOKENS, positions="rope", num_heads=8), ValueError,
     "positions='rope' needs an even head size"),
    ("DecoderLM dropout_rate 1", lambda: decoder_init(TOKENS, dropout_rate=1.0),
     ValueError, "dropout_rate must be in [0, 1)"),
    ("DecoderLM float tokens", lambda: decoder_init(jnp.ones((1, 4))),
     TypeError, "tokens must have an integer dtype"),
    ("DecoderLM token = V", lambda: decoder_init(jnp.full((1, 4), 17)),
     ValueError, "tokens must be in [0, 16]; got 17"),
    ("DecoderLM tokens past max_len", lambda: decoder_init(
        jnp.ones((1, 9), jnp.int32)), ValueError,
     "tokens has 9 positions but the model's max_len is 8"),
    # The check comes before the parameters are used.
    ("prefill prompt + max_new_tokens", lambda: model_lib.prefill(
        decoder(), None, TOKENS, max_new_tokens=5),
     ValueError, "prompt length 4 + max_new_tokens 5 = 9 exceeds"),
]


def assert_raises_exactly(call, error, *fragments):
    with pytest.raises(Exception) as raised:
        call()
    assert type(raised.value) is error, repr(raised.value)
    for fragment in fragments:
        assert fragment in str(raised.value), str(raised.value)


@pytest.mark.parametrize("call,error,fragment",
                         [pytest.param(*case[1:], id=case[0]) for case in PURE])
def test_pure_functions(call, error, fragment):
    assert_raises_exactly(call, error, fragment)


def test_generate_on_nonfinite_logits_ends_the_row_and_flags_it():
    """No error can be raised inside the loop: the documented rule ends a row
    whose logits are not finite, with pad_id and log-prob -inf."""
    bad_table = TABLE.at[1].set(jnp.nan)
    tokens, log_probs, lengths = decoding.generate(
        markov, bad_table, LOGITS.at[1, 1].set(9.0), (), key=KEY, max_new_tokens=3,
        temperature=0.0, pad_id=4)
    assert jnp.isneginf(log_probs).any(-1).tolist() == [False, True]
    assert tokens[1].tolist() == [1, 4, 4] and lengths.tolist() == [3, 1]


@pytest.mark.parametrize("call,error,fragment",
                         [pytest.param(*case[1:], id=case[0]) for case in MODULES])
def test_modules(call, error, fragment):
    assert_raises_exactly(call, error, fragment)


def tiny(corpus, **overrides):
    """The tiny config on ``corpus``, 10 steps; ``None`` deletes a key, and
    a key the config lacks is added (an unlocked, untyped copy)."""
    config = default.get_config("tiny")
    config.update_from_flattened_dict({
        "data.path": corpus, "train.steps": 10, "train.log_every": 5,
        "train.checkpoint_every": 5, "train.eval_every": 10,
        "train.eval_batches": 1, "optim.warmup_steps": 2,
        "sample.num_samples": 0})
    config = ml_collections.ConfigDict(config.to_dict(), type_safe=False)
    for name, value in overrides.items():
        section, key = name.split(".")
        if section not in config:
            config[section] = {}
        if value is None:
            del config[section][key]
        else:
            config[section][key] = value
    return config


@pytest.fixture
def nothing_compiles(monkeypatch):
    def compiled(*args, **kwargs):
        raise AssertionError("reached the compiler")
    monkeypatch.setattr(train, "compile_steps", compiled)
    monkeypatch.setattr(train, "restore_or_init", compiled)


NAN, INF = float("nan"), float("inf")

CONFIGS = [
    ("model.tyed", False, ValueError,
     "config.model.tyed is not a config key; did you mean config.model.tied"),
    ("trian.steps", 10, ValueError,
     "config.trian.steps is not a config key; did you mean config.train.steps"),
    ("train.stop_on_nonfinite", None, ValueError,
     "config.train.stop_on_nonfinite is missing"),
    ("train.batch_size", "8", TypeError,
     "config.train.batch_size must be int; got '8'"),
    ("train.stop_on_nonfinite", "yes", TypeError,
     "config.train.stop_on_nonfinite must be bool; got 'yes'"),
    ("loss.z_loss", "1e-4", TypeError,
     "config.loss.z_loss must be float; got '1e-4'"),
    ("model.head_scale", "0.5", TypeError,
     "config.model.head_scale must be float or None; got '0.5'"),
    ("optim.lr", NAN, ValueError, "config.optim.lr must be finite; got nan"),
    ("optim.grad_clip", INF, ValueError, "config.optim.grad_clip must be finite"),
    ("data.val_fraction", 1.0, ValueError,
     "config.data.val_fraction must be in (0.0, 1.0); got 1.0"),
    ("train.batch_size", 0, ValueError, "config.train.batch_size must be in [1"),
    ("train.seed", -1, ValueError, "config.train.seed must be in [0"),
    ("model.dropout_rate", 1.0, ValueError,
     "config.model.dropout_rate must be in [0.0, 1.0); got 1.0"),
    ("loss.label_smoothing", -0.1, ValueError, "config.loss.label_smoothing"),
    ("sample.temperature", -1.0, ValueError, "config.sample.temperature"),
    ("model.positions", "alibi", ValueError,
     "config.model.positions must be one of 'learned', 'rope'"),
    ("mesh.data", 3, ValueError, "mesh.data * mesh.model must equal the number"
                                 " of devices, 1; got 3 x 1 = 3"),
]


@pytest.mark.parametrize("name,value,error,fragment",
                         [pytest.param(*case, id=f"{case[0]}={case[1]!r}")
                          for case in CONFIGS])
def test_config_is_refused_before_anything(corpus, tmp_path, nothing_compiles,
                                           name, value, error, fragment):
    workdir = str(tmp_path / "run")
    assert_raises_exactly(
        lambda: train.train_and_evaluate(tiny(corpus, **{name: value}), workdir),
        error, fragment)
    assert not os.path.exists(workdir)  # refused before the workdir is made


def write(tmp_path, text, mode="w"):
    path = tmp_path / "corpus.txt"
    with open(path, mode) as f:
        f.write(text)
    return str(path)


DATA = [
    ("missing corpus", lambda tmp: str(tmp / "nowhere.txt"), FileNotFoundError,
     ("config.data.path=", "nowhere.txt': no such file.")),
    ("empty corpus", lambda tmp: write(tmp, ""), ValueError,
     ("config.data.path=", "corpus.txt' is empty.")),
    ("binary corpus", lambda tmp: write(tmp, b"\xff\xfe\x00", "wb"), ValueError,
     ("config.data.path=", "corpus.txt' is not UTF-8 text")),
    ("corpus shorter than a block", lambda tmp: write(tmp, "KING " * 3),
     ValueError, ("The training split has 13 tokens, fewer than "
                  "config.data.block_size + 1 = 17",)),
]


@pytest.mark.parametrize("make_path,error,fragments",
                         [pytest.param(*case[1:], id=case[0]) for case in DATA])
def test_data_is_refused_before_anything_compiles(tmp_path, nothing_compiles,
                                                  make_path, error, fragments):
    config = tiny("", **{"data.path": make_path(tmp_path)})
    assert_raises_exactly(
        lambda: train.train_and_evaluate(config, str(tmp_path / "run")),
        error, *fragments)


def test_prompt_outside_the_vocabulary_is_refused_before_compiling(
        corpus, tmp_path, nothing_compiles):
    assert_raises_exactly(lambda: train.train_and_evaluate(
        tiny(corpus, **{"sample.prompt": "KING\u20ac"}), str(tmp_path / "run")),
        ValueError, "config.sample.prompt='KING\u20ac': Characters outside the "
                    "vocabulary: ['\u20ac'].")


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """A finished 10-step run of ``tiny(corpus)``: checkpoints 5 and 10."""
    workdir = str(tmp_path_factory.mktemp("finished") / "run")
    train.train_and_evaluate(tiny(corpus), workdir)
    return workdir


@pytest.fixture
def copy_of(finished, tmp_path):
    workdir = str(tmp_path / "copy")
    shutil.copytree(finished, workdir)
    return workdir


@pytest.mark.parametrize("overrides,fragment", [
    ({"model.d_model": 64}, "model.d_model: 32 there, 64 now"),
    ({"train.steps": 20}, "train.steps: 10 there, 20 now"),
    ({"train.seed": 1, "optim.lr": 1e-3},
     "optim.lr: 0.003 there, 0.001 now; train.seed: 0 there, 1 now"),
])
def test_a_workdir_of_another_config_is_not_resumed(
        corpus, copy_of, nothing_compiles, overrides, fragment):
    assert_raises_exactly(
        lambda: train.train_and_evaluate(tiny(corpus, **overrides), copy_of),
        ValueError, f"holds checkpoints of another config, so it cannot be "
                    f"resumed with this one ({fragment})")


def test_harmless_changes_resume(corpus, finished, copy_of, monkeypatch):
    monkeypatch.setattr(train, "compile_steps", None)  # finished: nothing to do
    changes = {"train.log_every": 2, "train.eval_batches": 2,
               "loss.loss_impl": "fused", "loss.chunk_size": 64,
               "sample.num_samples": 3, "train.stop_on_nonfinite": False}
    summary = train.train_and_evaluate(tiny(corpus, **changes), copy_of)
    with open(os.path.join(finished, "summary.json")) as f:
        assert summary == json.load(f)


def drop_config_json(workdir):
    os.remove(os.path.join(workdir, "config.json"))


def edit_config_json(workdir, section, key, value):
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config[section][key] = value
    with open(path, "w") as f:
        json.dump(config, f)


def garble_checkpoints(workdir):
    for step in ("5", "10"):
        for root, _, files in os.walk(os.path.join(workdir, "checkpoints", step)):
            if os.path.basename(root) == "d":
                for name in files:
                    with open(os.path.join(root, name), "wb") as f:
                        f.write(b"junk")


WORKDIRS = [
    ("checkpoint of an untied model, tied config", lambda w: drop_config_json(w),
     lambda w, c: train.train_and_evaluate(tiny(c, **{"model.tied": False}), w),
     ValueError, "The checkpoint of step 10 in "),
    ("checkpoint of another width", lambda w: edit_config_json(
        w, "model", "d_model", 64), lambda w, c: generation.load_run(w),
     ValueError, "does not fit this config's model: "),
    ("no checkpoint restores", garble_checkpoints,
     lambda w, c: generation.load_run(w), RuntimeError, "/checkpoints restores: step 10"),
    ("load_run of an empty directory", lambda w: shutil.rmtree(w) or os.mkdir(w),
     lambda w, c: generation.load_run(w), FileNotFoundError, "config.json"),
]


@pytest.mark.parametrize("spoil,call,error,fragment",
                         [pytest.param(*case[1:], id=case[0]) for case in WORKDIRS])
def test_a_workdir_that_cannot_be_restored(corpus, copy_of, monkeypatch,
                                           spoil, call, error, fragment):
    monkeypatch.setattr(train, "compile_steps", None)
    spoil(copy_of)
    assert_raises_exactly(lambda: call(copy_of, corpus), error, fragment)


def test_incompatible_checkpoint_names_the_arrays(corpus, copy_of):
    drop_config_json(copy_of)
    with pytest.raises(ValueError) as raised:
        train.train_and_evaluate(tiny(corpus, **{"model.d_model": 64}), copy_of)
    message = str(raised.value)
    assert ("params/blocks_0/attention/out/kernel: (32, 32) in the checkpoint, "
            "(64, 64) in the model") in message
    assert re.search(r"\(and \d+ more\)\. It was written by another config; "
                     "use that config or a fresh workdir", message)


def run_program(script, *args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300)


CLI = [
    ("unknown key", ["--config.trian.steps=3"], "FATAL Flags parsing error: "
     "config.trian.steps is not a config key; did you mean config.train.steps"),
    ("not an int", ["--config.train.steps=ten"],
     "FATAL Flags parsing error: flag --config.train.steps=ten: invalid literal"),
    ("lr out of range", ["--config.optim.lr=-0.001"],
     "ValueError: config.optim.lr must be in (0.0, inf); got -0.001."),
]


@pytest.mark.parametrize("args,fragment",
                         [pytest.param(*case[1:], id=case[0]) for case in CLI])
def test_train_command_line(tmp_path, args, fragment):
    workdir = str(tmp_path / "run")
    result = run_program("train.py", "--config=configs/default.py:tiny",
                         f"--workdir={workdir}", *args)
    assert result.returncode == 1
    assert fragment in result.stderr, result.stderr[-2000:]
    assert not os.path.exists(workdir)


def test_generate_command_line_without_a_run(tmp_path):
    result = run_program("generate.py", f"--workdir={tmp_path}")
    assert result.returncode == 1
    assert "FileNotFoundError" in result.stderr
    assert os.path.join(str(tmp_path), "config.json") in result.stderr
