r"""The running jobs' progress lines for the sweep runner
(:func:`lmhead.lab.runner.run_all`), read from the files the train
processes write (``docs/sweeps.md``): step, best validation loss, members
still training, and the ETA to the step budget ``S`` from the rate since
the first step logged past the job's start,

.. math::

    \text{rate} = \frac{s_\text{last} - s_\text{first}}
                        {t_\text{last} - t_\text{first}}, \qquad
    \text{ETA} = \max\Big(0, \frac{S - s_\text{last}}{\text{rate}}
                            - (t_\text{now} - t_\text{last})\Big).
"""

import dataclasses
import json
import math
import os
from collections.abc import Sequence

from lmhead.lab import workdirs
from lmhead.lm import evaluation
from lmhead.lm import members as members_lib

# The default seconds between two reports (experiments/sweep.py --progress_every_s).
PROGRESS_EVERY_S = 30.0
METRICS_FILE = "metrics.jsonl"


def format_seconds(seconds: float) -> str:
    """A duration as the progress lines print it: seconds below 100 s, then
    minutes, then hours.

    Examples:
        >>> [format_seconds(s) for s in (42.4, 150.0, 7200.0)]
        ['42 s', '2.5 min', '2.0 h']
    """
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _read_json(path: str) -> dict | None:
    """The file's JSON, or None while it is missing or being written."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@dataclasses.dataclass
class _Member:
    """One member's workdir as last read: ``metrics.jsonl``'s records (read
    again when its size or time changes) and ``config.json``'s train
    section (read until it exists)."""

    workdir: str
    signature: tuple[int, int] | None = None
    records: list = dataclasses.field(default_factory=list)
    train: dict | None = None

    def observe(self) -> None:
        path = os.path.join(self.workdir, METRICS_FILE)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return
        signature = (stat.st_mtime_ns, stat.st_size)
        if signature != self.signature:
            try:
                self.records = workdirs.read_metrics(path)
            except ValueError:  # rewritten while read (a resume): next poll
                return
            self.signature = signature

    @property
    def step(self) -> int:
        return max((r.get("step", 0) for r in self.records), default=0)

    def read_train(self) -> dict:
        if self.train is None:
            config = _read_json(os.path.join(self.workdir, "config.json"))
            self.train = None if config is None else config.get("train", {})
        return self.train or {}

    def best_loss(self) -> float:
        return min(
            (r["eval/loss"] for r in self.records if "eval/loss" in r), default=math.nan
        )

    def training(self) -> bool:
        """Whether the member is still training: no summary, no failure,
        short of its ``train.steps`` and not stopped early by its patience."""
        if any(
            os.path.exists(os.path.join(self.workdir, name))
            for name in ("summary.json", members_lib.FAILED_FILE)
        ):
            return False
        train = self.read_train()
        if train.get("steps") and self.step >= train["steps"]:
            return False
        stopping = evaluation.EarlyStopping.from_records(
            train.get("patience") or 0, self.records
        )
        return not stopping.should_stop


@dataclasses.dataclass
class _Watch:
    """A running job: its members, the step its files showed when it
    started (``baseline``), and when its step was first and last seen to
    rise past it (``first``, ``last``: ``(time, step)``)."""

    job: dict
    started: float
    members: list[_Member]
    baseline: int = 0
    first: tuple[float, int] | None = None
    last: tuple[float, int] | None = None

    @classmethod
    def start(cls, job: dict, now: float) -> "_Watch":
        workdirs_ = [m["workdir"] for m in job.get("members", [job])]
        watch = cls(job, now, [_Member(workdir) for workdir in workdirs_])
        for member in watch.members:
            member.observe()
        watch.baseline = watch.step
        return watch

    @property
    def step(self) -> int:
        return max((member.step for member in self.members), default=0)

    def observe(self, now: float) -> None:
        for member in self.members:
            member.observe()
        step = self.step
        if step > max(self.baseline, self.last[1] if self.last else 0):
            self.first = self.first or (now, step)
            self.last = (now, step)

    def budget(self) -> int | None:
        """The most steps a member may train (``train.steps``; the job's own
        ``config.json`` until the members have theirs)."""
        members = self.members
        if "members" in self.job and not any(m.read_train() for m in members):
            members = [_Member(self.job["workdir"])]
        return (
            max((m.read_train().get("steps") or 0 for m in members), default=0) or None
        )

    def line(self, now: float) -> str:
        """The job's progress line at time ``now``."""
        name = self.job["name"]
        if self.last is None and self.step == 0:
            return (
                f"  {name}: no step logged yet, "
                f"{format_seconds(now - self.started)} after its start"
            )
        budget = self.budget()
        parts = [f"step {self.step}" + (f"/{budget}" if budget else "")]
        bests = [b for b in (m.best_loss() for m in self.members) if not math.isnan(b)]
        if bests:
            spread = (
                f" (members' bests up to {max(bests):.4f})" if len(bests) > 1 else ""
            )
            parts.append(f"best eval/loss {min(bests):.4f}{spread}")
        training = [m for m in self.members if m.training()]
        if "members" in self.job:
            parts.append(f"{len(training)}/{len(self.members)} members training")
        parts.append(self._eta(now, budget, training))
        return f"  {name}: " + ", ".join(parts)

    def _eta(self, now: float, budget: int | None, training: Sequence[_Member]) -> str:
        if not training:
            return "final evaluations"
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return "ETA after the next logged step"
        (t_first, s_first), (t_last, s_last) = self.first, self.last
        rate = (s_last - s_first) / (t_last - t_first)
        if budget is None:
            return f"{rate:.2f} steps/s"
        left = max(0.0, (budget - s_last) / rate - (now - t_last))
        stops = any(m.read_train().get("patience") for m in training)
        return f"ETA {format_seconds(left)} at {rate:.2f} steps/s" + (
            " (early stopping may end it sooner)" if stops else ""
        )


class Progress:
    """Watches the running jobs and gives their progress lines every
    ``every_s`` seconds of the caller's clock.

    :meth:`poll` is called often (each time the runner looks for ended
    jobs) with the jobs running and the time; it reads a member's
    ``metrics.jsonl`` again only when the file changed, and returns one line
    per job once ``every_s`` has passed since the last report (the first,
    ``every_s`` after the first poll).

    Examples:
        >>> import tempfile
        >>> workdir = tempfile.mkdtemp()
        >>> job = {"name": "seed=0", "workdir": workdir}
        >>> def write(step):
        ...     with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        ...         f.write(json.dumps({"step": step, "eval/loss": 3 - step / 100}) + "\\n")
        >>> with open(os.path.join(workdir, "config.json"), "w") as f:
        ...     json.dump({"train": {"steps": 600, "patience": 0}}, f)
        >>> progress = Progress(every_s=30)
        >>> progress.poll([job], now=0.0)
        []
        >>> write(100)
        >>> progress.poll([job], now=20.0)
        []
        >>> write(200)
        >>> progress.poll([job], now=30.0)
        ['  seed=0: step 200/600, best eval/loss 1.0000, ETA 40 s at 10.00 steps/s']
    """

    def __init__(self, every_s: float = PROGRESS_EVERY_S):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 seconds; got {every_s!r}.")
        self.every_s = every_s
        self.watches: dict[str, _Watch] = {}
        self.due: float | None = None

    def poll(self, jobs: Sequence[dict], now: float) -> list[str]:
        """Observes the running ``jobs`` at time ``now`` (seconds, any
        origin); their progress lines when a report is due, else ``[]``."""
        names = {job["name"] for job in jobs}
        self.watches = {n: w for n, w in self.watches.items() if n in names}
        for job in jobs:
            if job["name"] not in self.watches:
                self.watches[job["name"]] = _Watch.start(job, now)
            else:
                self.watches[job["name"]].observe(now)
        if self.due is None:
            self.due = now + self.every_s
        if now < self.due:
            return []
        self.due = now + self.every_s
        return [self.watches[job["name"]].line(now) for job in jobs]
