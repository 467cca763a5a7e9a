"""Tests for lmhead/lm/configuration.py and configs/default.py: the config
file's arguments, the checks of every key, refusing a run's bad config
before anything happens, and which changes a workdir may be resumed with."""

import json
import os

import ml_collections
import pytest

from configs import default
from lmhead.lab import sweeps
from lmhead.lm import configuration, train
from lmhead.lm import model as model_lib
from tests.errors import assert_raises_exactly
from tests.lab.sweep_helpers import parsed_train_config
from tests.lm.conftest import tiny_config

NAN, INF = float("nan"), float("inf")


class TestDefaultConfig:
    def test_arguments(self):
        assert default.get_config("untied").model.tied is False
        config = default.get_config("nanogpt,untied,bpe=2048,steps=300")
        assert (config.data.tokenizer, config.data.vocab_size) == ("bpe", 2048)
        assert config.train.steps == 300 and not config.model.tied

    def test_nanogpt_cpu_example(self):
        flat = configuration.flatten(default.get_config("nanogpt,tied"))
        expected = {
            "model.num_layers": 4, "model.num_heads": 4, "model.d_model": 128,
            "model.mlp_dim": 512, "data.block_size": 64, "train.batch_size": 12,
            "train.steps": 2000, "optim.lr": 1e-3, "optim.min_lr": 1e-4,
            "optim.b2": 0.99, "model.dropout_rate": 0.0, "data.tokenizer": "char",
            "data.val_fraction": 0.1,
        }  # fmt: skip
        assert {k: flat[k] for k in expected} == expected

    @pytest.mark.parametrize(
        "arg,match",
        [
            ("tidy", "Unknown config argument 'tidy'"),
            ("bpe", "write it as bpe=N"),
            ("tied=1", "write it as tied"),
            ("steps=ten", "N must be an integer"),
        ],
    )
    def test_bad_arguments(self, arg, match):
        with pytest.raises(ValueError, match=match):
            default.get_config(arg)

    @pytest.mark.parametrize(
        "arg,warmup",
        [
            ("nanogpt,tied,steps=40", 20),  # half the steps
            ("nanogpt,steps=199", 99),
            ("nanogpt,steps=200", 100),  # the configured warmup fits: kept
            ("nanogpt,steps=5000", 100),
            ("tiny,steps=10", 5),
            ("steps=40,nanogpt", 100),  # nanogpt's 2000 steps come after
        ],
    )
    def test_a_short_steps_argument_shortens_the_warmup(self, arg, warmup):
        config = default.get_config(arg)
        assert config.optim.warmup_steps == warmup
        configuration.validate_config(config)

    def test_an_explicit_warmup_wins_and_a_long_one_is_refused_by_flag(
        self, monkeypatch
    ):
        argv = ["--config=configs/default.py:nanogpt,steps=40"]
        flat = parsed_train_config(
            [*argv, "--config.optim.warmup_steps=5"], monkeypatch
        )
        assert flat["optim.warmup_steps"] == 5 and flat["train.steps"] == 40
        config = default.get_config("nanogpt")
        config.train.steps = 40  # --config.train.steps=40: the warmup stays 100
        with pytest.raises(ValueError, match="set --config.optim.warmup_steps below"):
            configuration.validate_config(config)

    def test_study_keys_default_to_todays_behaviour(self):
        expected = {"data.split": "tail", "data.train_fraction": 1.0}
        expected |= {"train.patience": 0, "train.eval_train_batches": 0}
        expected |= {"train.test_eval": None}
        for arg in ("nanogpt", "compare", "tiny"):
            flat = configuration.flatten(default.get_config(arg))
            assert {k: flat[k] for k in expected} == expected, arg

    def test_new_runs_have_the_end_of_text_token_committed_runs_do_not(self):
        for arg in ("", "tied", "nanogpt", "tiny", "tiny,bpe=512"):
            assert default.get_config(arg).data.end_of_text is True, arg
        # make compare's and the tying study's committed runs had none.
        assert default.get_config("compare").data.end_of_text is False
        path = os.path.join(configuration.REPOSITORY, "configs/sweeps/tying_study.py")
        shared = sweeps.load_module(path).get_study("tiny").shared
        assert shared["data.end_of_text"] is False

    def test_locked(self):
        with pytest.raises(AttributeError):
            default.get_config().train.stpes = 3

    def test_every_argument_validates(self):
        for arg in ("tied", "untied", "nanogpt", "compare", "tiny", "tiny,bpe=512"):
            configuration.validate_config(default.get_config(arg))


class TestValidateConfig:
    @pytest.mark.parametrize(
        "name,value,error,match",
        [
            (
                "data.block_size",
                1,
                ValueError,
                r"config.data.block_size must be in \[2",
            ),
            ("data.tokenizer", "word", ValueError, "'char', 'bpe'"),
            ("data.vocab_size", 500, ValueError, "tokenizer='bpe' only"),
            ("model.num_heads", 3, ValueError, "must divide"),
            ("model.dtype", "float16", ValueError, "'float32', 'bfloat16'"),
            ("loss.smoothing", "soft", ValueError, "config.loss.smoothing"),
            ("loss.chunk_size", 64, ValueError, "not used by loss_impl='materialized'"),
            ("loss.filter_eps", -1.0, ValueError, r"filter_eps must be in \[0.0"),
            ("loss.filter_eps", INF, ValueError, "filter_eps must be finite"),
            ("loss.filter_eps", "eps", TypeError, "a number >= 0 or 'auto'"),
            ("loss.filter_eps", True, TypeError, "a number >= 0 or 'auto'"),
            ("loss.filter_eps", "auto", ValueError, "loss_impl='fused' only"),
            ("loss.filter_target", "dx", ValueError, "'both', 'dh', 'dw'"),
            ("mesh.model", 0, ValueError, "config.mesh.model must be a number"),
            ("optim.min_lr", 1.0, ValueError, "config.optim.min_lr"),
            ("optim.b2", 1.0, ValueError, r"config.optim.b2 must be in \[0.0, 1.0\)"),
            ("optim.warmup_steps", 40, ValueError, "config.optim.warmup_steps"),
            ("sample.top_p", 0.0, ValueError, "config.sample.top_p"),
            ("sample.prompt", "", ValueError, "must not be empty"),
            ("data.split", "plays", ValueError, "'tail', 'works'"),
            ("data.train_fraction", 0.0, ValueError, "config.data.train_fraction"),
            ("data.test_fraction", 0.9, ValueError, "config.data.test_fraction"),
            ("train.patience", -1, ValueError, "config.train.patience"),
            ("train.test_eval", True, ValueError, "needs a test split"),
        ],
    )
    def test_validation(self, name, value, error, match):
        config = tiny_config(**{"loss.loss_impl": "materialized", name: value})
        with pytest.raises(error, match=match):
            configuration.validate_config(config)

    @pytest.mark.parametrize(
        "name,value,match",
        [
            ("train.steps", 2.5, "config.train.steps must be int; got 2.5"),
            ("model.tied", 1, "config.model.tied must be bool; got 1"),
            ("optim.lr", "fast", "config.optim.lr must be float; got 'fast'"),
        ],
    )
    def test_validation_types(self, name, value, match):
        config = ml_collections.ConfigDict(tiny_config().to_dict(), type_safe=False)
        section, key = name.split(".")
        config[section][key] = value
        with pytest.raises(TypeError, match=match):
            configuration.validate_config(config)

    def test_bpe_config_validates(self):
        configuration.validate_config(default.get_config("tiny,bpe=512"))
        with pytest.raises(ValueError, match="data.vocab_size"):
            configuration.validate_config(default.get_config("tiny,bpe=100"))


class TestKeys:
    def test_a_key_far_from_every_other_lists_its_section(self):
        with pytest.raises(ValueError, match="valid keys: train.seed, train.steps"):
            configuration.check_config_keys(
                ["train.xxxxxxxxxxxx"], {"train.steps", "train.seed", "model.tied"}
            )

    def test_default_types_are_the_defaults(self):
        types = configuration.default_types()
        assert set(types) == set(configuration.flatten(default.get_config()))
        assert types["train.steps"] == (int, False)
        assert types["model.head_scale"] == (float, True)

    def test_load_config_of_a_missing_file(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="no such config file"):
            configuration.load_config("tiny", str(tmp_path / "nope.py"))

    def test_make_model(self):
        config = tiny_config(**{"model.dtype": "bfloat16", "model.tied": False})
        model = configuration.make_model(config, vocab_size=84)
        assert isinstance(model, model_lib.DecoderLM)
        assert (model.vocab_size, model.max_len, model.tied) == (84, 16, False)
        assert model.dtype == configuration.DTYPES["bfloat16"]


# A run refuses a bad config before it makes the workdir, with exactly this
# error. The key is named as a user writes it on the command line; a
# misspelled one comes with the closest real key.
CONFIGS = [
    ("model.tyed", False, ValueError, ("config.model.tyed", "config.model.tied")),
    ("trian.steps", 10, ValueError, ("config.trian.steps", "config.train.steps")),
    ("train.stop_on_nonfinite", None, ValueError, "config.train.stop_on_nonfinite"),
    ("train.batch_size", "8", TypeError, "config.train.batch_size"),
    ("train.stop_on_nonfinite", "yes", TypeError, "config.train.stop_on_nonfinite"),
    ("loss.z_loss", "1e-4", TypeError, "config.loss.z_loss"),
    ("model.head_scale", "0.5", TypeError, "config.model.head_scale"),
    ("optim.lr", NAN, ValueError, "config.optim.lr"),
    ("optim.grad_clip", INF, ValueError, "config.optim.grad_clip"),
    ("data.val_fraction", 1.0, ValueError, "config.data.val_fraction"),
    ("train.batch_size", 0, ValueError, "config.train.batch_size"),
    ("train.seed", -1, ValueError, "config.train.seed"),
    ("model.dropout_rate", 1.0, ValueError, "config.model.dropout_rate"),
    ("loss.label_smoothing", -0.1, ValueError, "config.loss.label_smoothing"),
    ("sample.temperature", -1.0, ValueError, "config.sample.temperature"),
    (
        "model.positions",
        "alibi",
        ValueError,
        ("config.model.positions", "'learned'", "'rope'"),
    ),
    ("mesh.data", 3, ValueError, ("mesh.data", "mesh.model")),
    (
        "model.activation",
        "relu",
        ValueError,
        ("config.model.activation", "'gelu'", "'gelu_tanh'"),
    ),
    (
        "model.attention_implementation",
        "flash",
        ValueError,
        ("config.model.attention_implementation", "'xla'", "'cudnn'"),
    ),
    (
        "model.attention_implementation",
        "cudnn",
        ValueError,
        ("attention_implementation='cudnn' needs", "dtype='float32'"),
    ),
]


@pytest.mark.parametrize(
    "name,value,error,named",
    [pytest.param(*case, id=f"{case[0]}={case[1]!r}") for case in CONFIGS],
)
def test_config_is_refused_before_anything(
    short_config, tmp_path, nothing_compiles, name, value, error, named
):
    workdir = str(tmp_path / "run")
    assert_raises_exactly(
        lambda: train.train_and_evaluate(short_config(**{name: value}), workdir),
        error,
        named,
    )
    assert not os.path.exists(workdir)  # refused before the workdir is made


# The message names every key that differs.
@pytest.mark.parametrize(
    "overrides,named",
    [
        ({"model.d_model": 64}, "model.d_model"),
        ({"train.steps": 20}, "train.steps"),
        ({"train.seed": 1, "optim.lr": 1e-3}, ("optim.lr", "train.seed")),
    ],
)
def test_a_workdir_of_another_config_is_not_resumed(
    short_config, copy_of_finished_run, nothing_compiles, overrides, named
):
    assert_raises_exactly(
        lambda: train.train_and_evaluate(
            short_config(**overrides), copy_of_finished_run
        ),
        ValueError,
        named,
    )


def test_harmless_changes_resume(
    short_config, finished_run, copy_of_finished_run, monkeypatch
):
    monkeypatch.setattr(train, "compile_steps", None)  # finished: nothing to do
    changes = {
        "train.log_every": 2,
        "train.eval_batches": 2,
        "loss.loss_impl": "fused",
        "loss.chunk_size": 64,
        "sample.num_samples": 3,
        "train.stop_on_nonfinite": False,
        "model.attention_implementation": "xla",
    }
    summary = train.train_and_evaluate(short_config(**changes), copy_of_finished_run)
    with open(os.path.join(finished_run, "summary.json")) as f:
        assert summary == json.load(f)


def test_a_workdir_without_checkpoints_is_not_checked(short_config, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(short_config().to_json())
    configuration.check_resumable(short_config(**{"model.d_model": 64}), str(workdir))
