"""Dynamic batching: a bounded queue and one worker thread that runs
:class:`lmhead.serving.Engine` batches.

A job waits at most ``window_s`` after the oldest waiting job arrived (less
when a full batch is ready), then every waiting job of the same group that
fits joins it, oldest first, up to ``max_rows`` rows. While a batch runs, new
jobs queue, so under load batches fill without any waiting. One thread runs
the device, so batches never compete for it.
"""

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable

from lmhead import serving

_unique = itertools.count()


def group_of(request: Any) -> tuple:
    """Jobs of equal groups may share a batch (see ``lmhead/serving.py``)."""
    if isinstance(request, serving.ScoreRequest):
        return ("score", next(_unique))
    if request.num_beams > 1:
        return ("beam", request.num_beams, request.max_new_tokens)
    if request.seed is not None:
        return ("seeded", next(_unique))
    return ("sample", request.repetition_penalty)


@dataclasses.dataclass(eq=False)  # jobs are distinct even with equal requests
class Job:
    """A request waiting for, or in, a batch."""
    request: Any
    group: tuple
    arrival: float
    future: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future)

    @property
    def rows(self) -> int:
        return getattr(self.request, "rows", 1)


class Batcher:
    """Queues requests for ``engine`` and runs them in batches.

    Args:
        engine: a warmed-up :class:`serving.Engine`.
        max_queue: jobs that may wait; :meth:`submit` raises
            :class:`serving.QueueFull` beyond.
        window_s: how long the oldest waiting job waits for company.
        on_batch: called as ``on_batch(kind, rows)`` after each batch runs
            (``kind`` is ``"sample"``, ``"beam"`` or ``"score"``).
    """

    def __init__(self, engine: serving.Engine, *, max_queue: int, window_s: float,
                 on_batch: Callable[[str, int], None] | None = None):
        if max_queue < 1 or window_s < 0:
            raise ValueError(f"max_queue must be >= 1 and window_s >= 0; got "
                             f"{max_queue}, {window_s}.")
        self.engine, self.max_queue, self.window_s = engine, max_queue, window_s
        self.max_rows = engine.buckets.batch_sizes[-1]
        self._on_batch = on_batch or (lambda kind, rows: None)
        self._waiting: collections.deque[Job] = collections.deque()
        self._changed = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="batcher", daemon=True)
        self._thread.start()

    def depth(self) -> int:
        """Jobs waiting (not counting the batch that runs)."""
        return len(self._waiting)

    def submit(self, request: Any) -> concurrent.futures.Future:
        """Queues a checked request; its future gives a list of completions
        (generate) or a dict (score), or raises what the engine raised."""
        job = Job(request, group_of(request), time.monotonic())
        with self._changed:
            if self._stopping:
                raise RuntimeError("the batcher is stopped.")
            if len(self._waiting) >= self.max_queue:
                raise serving.QueueFull(f"{self.max_queue} requests are waiting.")
            self._waiting.append(job)
            self._changed.notify()
        return job.future

    def stop(self) -> None:
        """Cancels the waiting jobs and ends the worker after its batch."""
        with self._changed:
            self._stopping = True
            for job in self._waiting:
                job.future.cancel()
            self._waiting.clear()
            self._changed.notify()
        self._thread.join()

    def _batch_for(self, head: Job) -> list[Job]:
        batch, rows = [], 0
        for job in self._waiting:
            if job.group == head.group and rows + job.rows <= self.max_rows:
                batch.append(job)
                rows += job.rows
        return batch

    def _next_batch(self) -> list[Job]:
        """Waits for the oldest job's window to close or a full batch."""
        with self._changed:
            while not self._waiting and not self._stopping:
                self._changed.wait()
            if self._stopping:
                return []
            head = self._waiting[0]
            while True:
                batch = self._batch_for(head)
                left = head.arrival + self.window_s - time.monotonic()
                full = sum(job.rows for job in batch) >= self.max_rows
                if left <= 0 or full or head.group[0] in ("score", "seeded"):
                    break
                self._changed.wait(left)
            for job in batch:
                self._waiting.remove(job)
            return batch

    def _work(self) -> None:
        while not self._stopping:
            batch = [job for job in self._next_batch()
                     if job.future.set_running_or_notify_cancel()]
            if batch:
                self._run(batch)

    def _run(self, batch: list[Job]) -> None:
        kind = batch[0].group[0]
        requests = [job.request for job in batch]
        try:
            if kind == "score":
                results = [self.engine.score(requests[0])]
            elif kind == "beam":
                results = self.engine.beam(requests)
            else:
                results = self.engine.sample(requests)
        except Exception as error:  # pylint: disable=broad-except
            for job in batch:  # the callers report it; the worker goes on
                job.future.set_exception(error)
            return
        for job, result in zip(batch, results):
            job.future.set_result(result)
        self._on_batch("sample" if kind == "seeded" else kind,
                       sum(job.rows for job in batch))
