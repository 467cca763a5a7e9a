"""Stopping a training run on SIGTERM (preemption) at a step boundary.

While :func:`sigterm_flag`'s block runs, SIGTERM sets a flag instead of
ending the process; the training loop asks :func:`stop_requested` before
each step, saves a checkpoint of that step and raises :class:`Preempted`.
Rerunning the same command resumes from that checkpoint. With several
processes, JAX's preemption notifier decides the step, the same for all.
"""

import contextlib
import signal
import threading

import jax


class Preempted(Exception):
    """``train_and_evaluate`` stopped on SIGTERM; a checkpoint of ``step`` is saved."""

    def __init__(self, step: int, directory: str):
        super().__init__(
            f"Stopped by SIGTERM at step {step}; its checkpoint is "
            f"in {directory}. Rerun the same command to resume."
        )
        self.step = step


@contextlib.contextmanager
def sigterm_flag():
    """A ``threading.Event`` that SIGTERM sets while the block runs.

    Only in the main thread of a single process: a signal handler can only be
    installed there, and several processes must stop at the same step, which
    JAX's preemption sync point decides (see :func:`stop_requested`).
    """
    event = threading.Event()
    if (
        jax.process_count() > 1
        or threading.current_thread() is not threading.main_thread()
    ):
        yield event
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: event.set())
    try:
        yield event
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_requested(manager, step: int, terminated: threading.Event) -> bool:
    """SIGTERM seen: by this process, or (several processes) by JAX's
    preemption notifier, at a step that every process agrees on."""
    if jax.process_count() > 1:
        return manager.reached_preemption(step)
    return terminated.is_set()
