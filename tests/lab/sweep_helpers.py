"""Stand-ins for the sweep runner's tests: a train program that writes the
files of finished runs without training, a sweep file of four runs, and the
runner's command line on them (``experiments/sweep.py``).
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

# train.py's stand-in: a single run, or an ensemble program (--member flags),
# whose members each get the files of a finished run (a program's summaries
# name it), except the member whose workdir's name is $FAIL_RUN (the process
# then exits 1) or $EMPTY_RUN (it exits 0 all the same); members finished
# before are skipped. The workdir gets checkpoints/ once a member has
# trained, and its calls.txt the lines "start" or "resume" (checkpoints/
# existed), then, for a program, "train NAME" or "skip NAME" per member.
FAKE_TRAIN = textwrap.dedent("""\
    import json, math, os, sys
    flags = [a.split("=", 1) for a in sys.argv[1:]]
    args = {k: v for k, v in flags if k != "--member"}
    members = [json.loads(v) for k, v in flags if k == "--member"]
    workdir = args["--workdir"]
    os.makedirs(workdir, exist_ok=True)
    checkpoints = os.path.join(workdir, "checkpoints")
    calls = ["resume" if os.path.isdir(checkpoints) else "start"]
    print("training", os.path.basename(workdir), args["--config"])
    tied = args["--config.model.tied"] == "True"
    program = bool(members)
    members = members or [{"workdir": workdir,
                           "train.seed": int(args["--config.train.seed"])}]
    failed = False
    for index, member in enumerate(members):
        run = member["workdir"]
        name = os.path.basename(run)
        if program and os.path.exists(os.path.join(run, "summary.json")):
            calls.append("skip " + name)
            continue
        calls += ["train " + name] if program else []
        if name == os.environ.get("FAIL_RUN"):
            print("simulated failure in " + name)
            failed = True
            continue
        if name == os.environ.get("EMPTY_RUN"):
            print("did nothing")
            continue
        os.makedirs(checkpoints, exist_ok=True)
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
            f.write(json.dumps({"step": 5, "eval/loss": loss + 1}) + "\\n")
            f.write(json.dumps({"step": 10, **final}) + "\\n")
        summary = {"num_params": 100 if tied else 120, "num_head_params": 20,
                   "final": final, "tokens_per_sec": 1000.0, "steps": 10,
                   "wall_seconds": 30.0}
        if program:
            summary["ensemble"] = {"program": workdir, "members": len(members),
                                   "index": index}
        with open(os.path.join(run, "summary.json"), "w") as f:
            json.dump(summary, f)
    with open(os.path.join(workdir, "calls.txt"), "a") as f:
        f.write("".join(call + "\\n" for call in calls))
    print("trained", len(members), "members" if program else "run")
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


def calls(tmp_path, name, program=False):
    """What the stand-in train program did in run (or ``program``) ``name``,
    a line per item (see :data:`FAKE_TRAIN`)."""
    folder = tmp_path / "sweep" / ("ensembles" if program else "") / name
    path = folder / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []
