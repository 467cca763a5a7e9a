"""Stand-ins for the sweep runner's tests: a train program that writes a
run's files without training (and one that does so for an ensemble's
members), a sweep file of four runs, and the runner's command line on them
(``experiments/sweep.py``).

The stand-in train program writes the files of a finished run, fails on
request (``FAIL_RUN``) and records whether it resumed, so skip / resume /
failure handling needs no training.
"""

import os
import subprocess
import sys
import textwrap

from absl import flags
from ml_collections import config_flags

from lmhead.lm import configuration
from tests import ROOT

SWEEP_SCRIPT = os.path.join(ROOT, "experiments", "sweep.py")
SWEEP_CONFIGS = os.path.join(ROOT, "configs", "sweeps")
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "default.py")

# Writes the files of a finished run unless its workdir's name is $FAIL_RUN;
# appends "start" or "resume" (a checkpoints/ folder exists) to calls.txt.
FAKE_TRAIN = textwrap.dedent("""\
    import json, math, os, sys
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    workdir = args["--workdir"]
    name = os.path.basename(workdir)
    os.makedirs(workdir, exist_ok=True)
    checkpoints = os.path.join(workdir, "checkpoints")
    with open(os.path.join(workdir, "calls.txt"), "a") as f:
        f.write("resume\\n" if os.path.isdir(checkpoints) else "start\\n")
    print("training", name, args["--config"])
    if name == os.environ.get("FAIL_RUN"):
        sys.exit("simulated failure in " + name)
    os.makedirs(checkpoints, exist_ok=True)
    seed = int(args["--config.train.seed"])
    tied = args["--config.model.tied"] == "True"
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"model": {"tied": tied, "d_model": 8},
                   "data": {"tokenizer": "char", "vocab_size": None},
                   "train": {"seed": seed}}, f)
    loss = 2.0 + 0.1 * seed + (0.0 if tied else 0.05)
    final = {"eval/loss": loss, "eval/perplexity": math.exp(loss),
             "eval/bits_per_char": loss / math.log(2), "eval/accuracy": 0.4,
             "eval/ece": 0.01}
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 5, "eval/loss": loss + 1}) + "\\n")
        f.write(json.dumps({"step": 10, **final}) + "\\n")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({"num_params": 100 if tied else 120, "num_head_params": 20,
                   "final": final, "tokens_per_sec": 1000.0, "steps": 10,
                   "wall_seconds": 0.1}, f)
    """)

# The stand-in of an ensemble program (train.py with --member flags): writes
# each unfinished member's files as FAKE_TRAIN does, with the summary's
# "ensemble" key, except the member whose workdir's name is $FAIL_MEMBER
# (then it exits 1); appends to the program's calls.txt "start" or "resume"
# and "train NAME" or "skip NAME" (finished before) per member.
FAKE_ENSEMBLE_TRAIN = textwrap.dedent("""\
    import json, math, os, sys
    flags = [a.split("=", 1) for a in sys.argv[1:]]
    args = {k: v for k, v in flags if k != "--member"}
    members = [json.loads(v) for k, v in flags if k == "--member"]
    workdir = args["--workdir"]
    os.makedirs(workdir, exist_ok=True)
    checkpoints = os.path.join(workdir, "checkpoints")
    calls = ["resume" if os.path.isdir(checkpoints) else "start"]
    os.makedirs(checkpoints, exist_ok=True)
    tied = args["--config.model.tied"] == "True"
    failed = False
    for index, member in enumerate(members):
        run = member["workdir"]
        name = os.path.basename(run)
        if os.path.exists(os.path.join(run, "summary.json")):
            calls.append("skip " + name)
            continue
        calls.append("train " + name)
        if name == os.environ.get("FAIL_MEMBER"):
            failed = True
            continue
        os.makedirs(run, exist_ok=True)
        seed = member["train.seed"]
        with open(os.path.join(run, "config.json"), "w") as f:
            json.dump({"model": {"tied": tied, "d_model": 8},
                       "data": {"tokenizer": "char", "vocab_size": None},
                       "train": {"seed": seed}}, f)
        loss = 2.0 + 0.1 * seed + (0.0 if tied else 0.05)
        final = {"eval/loss": loss, "eval/perplexity": math.exp(loss),
                 "eval/bits_per_char": loss / math.log(2), "eval/accuracy": 0.4,
                 "eval/ece": 0.01}
        with open(os.path.join(run, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 10, **final}) + "\\n")
        ensemble = {"program": workdir, "members": len(members), "index": index}
        with open(os.path.join(run, "summary.json"), "w") as f:
            json.dump({"num_params": 100 if tied else 120, "num_head_params": 20,
                       "final": final, "tokens_per_sec": 1000.0, "steps": 10,
                       "wall_seconds": 30.0, "ensemble": ensemble}, f)
    with open(os.path.join(workdir, "calls.txt"), "a") as f:
        f.write("".join(call + "\\n" for call in calls))
    print("trained", len(members), "members")
    sys.exit(1 if failed else 0)
    """)

FAKE_SWEEP = textwrap.dedent("""\
    from lmhead.lab import sweeps

    def get_sweep(arg=None):
        seeds = int(arg or 2)
        return "tiny", sweeps.product(sweeps.sweep("model.tied", [True, False]),
                                      sweeps.sweep("train.seed", list(range(seeds))))
    """)


def parsed_train_config(argv, monkeypatch) -> dict:
    """The flat config that experiments/train.py's flags give for ``argv``."""
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values)
    flags.DEFINE_string("workdir", None, "", flag_values=flag_values)
    # config_flags finds the --config.* overrides in sys.argv.
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    flag_values(sys.argv)
    return configuration.flatten(flag_values.config.to_dict())


def sweep_command(tmp_path, *flags_, sweep=FAKE_SWEEP, train=FAKE_TRAIN, arg=""):
    """sweep.py on ``sweep`` (a sweep file's source; ``arg`` its argument),
    each run executing ``train`` (a program's source) instead of train.py."""
    (tmp_path / "fake_sweep.py").write_text(sweep)
    (tmp_path / "fake_train.py").write_text(train)
    return [
        sys.executable,
        SWEEP_SCRIPT,
        f"--sweep={tmp_path}/fake_sweep.py{arg}",
        f"--workdir={tmp_path}/sweep",
        f"--train_script={tmp_path}/fake_train.py",
        *flags_,
    ]


def run_sweep(tmp_path, *flags_, env=None, **sources):
    """Runs :func:`sweep_command` (``env``: more environment variables)."""
    return subprocess.run(
        sweep_command(tmp_path, *flags_, **sources),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def calls(tmp_path, name):
    """How the stand-in train program was started in run ``name``: "start"s
    and "resume"s, in order."""
    path = tmp_path / "sweep" / name / "calls.txt"
    return path.read_text().split() if path.exists() else []


def program_calls(tmp_path, name):
    """What the stand-in ensemble program did in program ``name``, a line per
    item: "start"/"resume", then "train RUN"/"skip RUN" per member."""
    path = tmp_path / "sweep" / "ensembles" / name / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []
