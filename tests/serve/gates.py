"""Holding the slot batcher's decoding calls, so that a test decides how far
a request runs: no serve test depends on the machine's speed or on winning
a race."""

import time

from lmhead.serve import continuous


def gate_decoding(monkeypatch, go):
    """Makes each decoding call of a :class:`continuous.SlotBatcher` wait
    until ``go(batcher)`` holds or the batcher stops (checked whenever a
    request is queued or cancelled, and every 10 ms for conditions set
    outside the batcher): a request runs no further than the test lets it,
    however fast the machine."""
    step = continuous.SlotBatcher._step

    def gated(self):
        with self._changed:
            while not (self._stopping or go(self)):
                self._changed.wait(0.01)
        return step(self)

    monkeypatch.setattr(continuous.SlotBatcher, "_step", gated)


def all_cancelled(batcher):
    """Every running job is cancelled (true when none runs)."""
    return all(job.cancelled for job in batcher._running())


def wait_until(condition, timeout=60.0):
    """Polls ``condition`` until it holds; fails after ``timeout`` seconds
    (a bound on a hang, never a speed the test assumes)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
