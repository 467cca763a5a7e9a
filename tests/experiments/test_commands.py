"""The command-line programs, end to end on the tiny config, in subprocesses."""

import json
import os
import re

import jax
import numpy as np
import pytest

from tests import run_experiment


def run(script, *args):
    result = run_experiment(script, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("cli") / "run")
    stdout = run(
        "train.py",
        "--config=configs/default.py:tiny,untied",
        f"--workdir={workdir}",
        "--config.train.steps=20",
        "--config.optim.warmup_steps=2",
        "--config.sample.num_samples=1",
    )
    return workdir, stdout


def test_train(workdir):
    workdir, stdout = workdir
    assert "step 20/20" in stdout and "eval/loss" in stdout and "tokens/s" in stdout
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    assert config["train"]["steps"] == 20 and config["model"]["tied"] is False
    with open(os.path.join(workdir, "versions.json")) as f:
        versions = json.load(f)
    assert versions["jax"] == jax.__version__
    assert versions["backend"] == jax.default_backend()
    assert versions["numpy"] == np.__version__
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 20
    assert summary["num_head_params"] == 85 * 32  # the untied [V, D], end of text
    with open(os.path.join(workdir, "samples.txt")) as f:
        assert f.read().startswith("KING") and "KING" in stdout


def test_generate_beams_with_an_int8_head_reports_timings(workdir):
    workdir, _ = workdir
    result = run_experiment(
        "generate.py",
        f"--workdir={workdir}",
        "--prompt=ROMEO:",
        "--max_new_tokens=12",
        "--num_beams=2",
        "--num_samples=2",
        "--ignore_eos",  # else a short run's beams end at the end-of-text token
        "--quantize=int8",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = result.stdout.rstrip("\n").split("\n---------------\n")
    assert first.startswith("ROMEO:") and len(first) == 6 + 12
    assert first == second  # beam search is deterministic
    timings = re.search(
        r"time to first token (\S+) ms .* (\S+) ms per new token", result.stderr
    )
    assert timings and float(timings[1]) > 0 and float(timings[2]) > 0, result.stderr


def test_generate_with_stop_strings_penalties_and_top_logprobs(workdir):
    from lmhead.lm import generation

    workdir, _ = workdir
    _, tokenizer, model, params = generation.load_run(workdir)
    settings = dict(
        key=jax.random.key(0),
        num_samples=2,
        max_new_tokens=12,
        temperature=0.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    plain = generation.continue_text(model, params, tokenizer, "ROMEO:", **settings)
    stops = [plain[0][9:11], "\n\n"]
    expected = generation.continuations(
        model, params, tokenizer, "ROMEO:", stop=stops, top_logprobs=2, **settings
    )
    stdout = run(
        "generate.py",
        f"--workdir={workdir}",
        "--prompt=ROMEO:",
        "--max_new_tokens=12",
        "--num_samples=2",
        "--temperature=0",
        "--presence_penalty=0.5",
        "--frequency_penalty=0.25",
        f"--stop={stops[0]}",
        "--stop=\\n\\n",  # escapes are read as in Python
        "--top_logprobs=2",
        "--notimings",
    )
    samples = stdout.rstrip("\n").split("\n---------------\n")
    assert len(samples) == 2
    for sample, continuation in zip(samples, expected, strict=True):
        assert continuation.finish_reason == "stop"
        assert sample.startswith(continuation.text + "\n")
        lines = sample[len(continuation.text) + 1 :].split("\n")
        assert len(lines) == len(continuation.tokens)
        for line in lines:  # "'x': 'x' -0.123 'y' -1.234": two log-probs
            assert len(re.findall(r" -?\d+\.\d{3}(?= |$)", line)) == 2, line


@pytest.mark.slow
def test_data_parallel_cpu_devices_train_the_same_model(tmp_path):
    """Splitting the batch over 2 CPU devices changes float32 rounding only."""
    losses = {}
    for devices in (1, 2):
        workdir = str(tmp_path / str(devices))
        run(
            "train.py",
            "--config=configs/default.py:tiny",
            f"--workdir={workdir}",
            f"--cpu_devices={devices}",
            "--config.train.steps=20",
            "--config.sample.num_samples=1",
        )
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            losses[devices] = [
                r["eval/loss"] for r in map(json.loads, f) if "eval/loss" in r
            ]
    assert len(losses[1]) == 1
    assert losses[2] == pytest.approx(losses[1], rel=1e-4)


def test_generate_command_line_without_a_run(tmp_path):
    result = run_experiment(
        "generate.py",
        f"--workdir={tmp_path}",
    )
    assert result.returncode == 1
    assert "FileNotFoundError" in result.stderr
    assert os.path.join(str(tmp_path), "config.json") in result.stderr


@pytest.mark.parametrize(
    "flag,message",
    [
        ("--top_p=0", "top_p must be in (0, 1]; got 0.0."),
        ("--temperature=-1", "temperature must be in [0, inf); got -1.0."),
        ("--presence_penalty=nan", "presence_penalty must be in (-inf, inf); got nan."),
    ],
)
def test_generate_refuses_a_knob_flag_with_the_knobs_range(tmp_path, flag, message):
    """The sampling flags' ranges and messages are the knobs' own
    (``lmhead.decoding.knobs``), checked before anything runs."""
    result = run_experiment("generate.py", f"--workdir={tmp_path}", flag)
    assert result.returncode == 1
    assert message in result.stderr and "FileNotFoundError" not in result.stderr


def test_generate_speculates_greedy_text_and_refuses_by_flag(workdir):
    workdir, _ = workdir
    args = ("generate.py", f"--workdir={workdir}", "--prompt=ROMEO:",
            "--max_new_tokens=12", "--num_samples=2", "--temperature=0",
            "--notimings")  # fmt: skip
    plain = run(*args)
    assert run(*args, "--speculative=ngram", "--num_speculative_tokens=3") == plain
    for flags, words in (
        (["--speculative=mtp"], "--speculative='mtp' needs a run trained with MTP"),
        (["--speculative=ngram", "--num_beams=2"], "--speculative does not apply"),
        (["--speculative=ngram", "--num_speculative_tokens=0"], "--num_speculative"),
    ):
        result = run_experiment(*args, *flags)
        assert result.returncode != 0 and words in result.stderr, result.stderr[-2000:]
