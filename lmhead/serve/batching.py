"""Dynamic batching: :class:`Engine` runs a batch of checked requests
(``lmhead/serve/requests.py``), and :class:`Batcher` feeds it from a bounded queue
on one worker thread.

A job waits at most ``window_s`` after the oldest waiting job arrived (less
when a full batch is ready), then every waiting job of the same group that
fits joins it, oldest first, up to ``max_rows`` rows. While a batch runs, new
jobs queue, so under load batches fill without any waiting. One thread runs
the device, so batches never compete for it.

The engine and the batcher are one module because they share one rule:
:func:`group_of` says which requests the engine can run as one program, and
the batcher groups jobs by it.
"""

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from lmhead import _checks, decoding
from lmhead.lm import model as model_lib
from lmhead.lm import scoring
from lmhead.serve import completions, openai_api, requests
from lmhead.serve.requests import SERVED_KNOBS, GenerateRequest, ScoreRequest, bucket


class Engine:
    """Runs batches of checked requests on one model, within the buckets.

    Args:
        model, params, tokenizer: a run's, as :func:`generation.load_run` gives.
        buckets: the shapes to compile (checked against ``model.max_len``).
        seed: the key of the batches whose requests give no seed.
        score_batch_size: windows per call of the scorer.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from lmhead.lm import data
        >>> tokenizer = data.CharTokenizer("abcd")
        >>> model = model_lib.DecoderLM(vocab_size=4, num_layers=1, num_heads=2,
        ...                             d_model=8, mlp_dim=16, max_len=8)
        >>> init = jax.jit(model.init)
        >>> params = init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> engine = Engine(model, params, tokenizer, requests.Buckets((2,), (4,), (4,)))
        >>> request = requests.parse_generate(
        ...     {"prompt": ["ab", "c"], "temperature": 0, "max_new_tokens": 3},
        ...     tokenizer, engine.buckets, requests.Limits())
        >>> [(c["prompt_index"], c["length"]) for c in engine.sample([request])[0]]
        [(0, 3), (1, 3)]
        >>> batcher = Batcher(engine, max_queue=4, window_s=0.001)
        >>> batcher.submit(request).result()[1]["length"]
        3
        >>> batcher.stop()
    """

    def __init__(
        self,
        model: model_lib.DecoderLM,
        params: Any,
        tokenizer: Any,
        buckets: requests.Buckets,
        *,
        seed: int = 0,
        score_batch_size: int = 8,
    ):
        buckets.check(model.max_len)
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.buckets, self.score_batch_size = buckets, score_batch_size
        self._step_fn = model_lib.make_step_fn(model)
        self._key = jax.random.key(seed)
        self._batch_index = itertools.count()

    def _prefill(self, prompts: list[np.ndarray]):
        """Logits and cache of the prompts padded to their buckets, and the
        prompts as ``int32 [R, max prompt length]`` with -1 after each one (the
        decoders' padding; one width keeps one decoding program per ``R, N``)."""
        rows = bucket(len(prompts), self.buckets.batch_sizes)
        width = self.buckets.prompt_lengths[-1]
        history = np.full([rows, width], -1, np.int32)
        history[:, 0] = 0  # padding rows: a one-token prompt
        lengths = np.ones([rows], np.int32)
        for row, ids in enumerate(prompts):
            history[row, : len(ids)], lengths[row] = ids, len(ids)
        time_ = bucket(int(lengths.max()), self.buckets.prompt_lengths)
        logits, cache = model_lib.prefill(
            self.model, self.params, np.maximum(history[:, :time_], 0), lengths
        )
        return logits, cache, history

    def _completion(
        self,
        prompt_index: int,
        ids: np.ndarray,
        length: int,
        log_probs: np.ndarray | None = None,
        score: float | None = None,
    ) -> dict[str, Any]:
        ids = ids[:length]
        completion = {
            "prompt_index": prompt_index,
            "text": decoding.detokenize(
                ids, self.tokenizer, eos_id=self.tokenizer.eos_id
            ),
            "token_ids": ids.tolist(),
            "length": int(length),
        }
        if log_probs is not None:
            completion["log_probs"] = [
                completions.json_float(x) for x in log_probs[:length]
            ]
        if score is not None:
            completion["score"] = completions.json_float(score)
        return completion

    def sample(self, requests: list[GenerateRequest]) -> list[list[dict]]:
        """Sampled and greedy requests in one batch, with per-row knobs (the
        others are one value per batch: the requests share them, see
        :func:`group_of`); a lone request with a seed draws from
        ``jax.random.key(seed)``."""
        owners, prompts = [], []
        for index, request in enumerate(requests):
            for p, ids in enumerate(request.prompt_ids):
                for _ in range(request.num_return_sequences):
                    owners.append((index, p))
                    prompts.append(ids)
        logits, cache, history = self._prefill(prompts)
        knobs = decoding.SamplingKnobs.stack(
            [requests[index].knobs for index, _ in owners], size=len(logits)
        )
        seeded = len(requests) == 1 and requests[0].seed is not None
        key = (
            jax.random.key(requests[0].seed)
            if seeded
            else jax.random.fold_in(self._key, next(self._batch_index))
        )
        num_new = bucket(
            max(r.max_new_tokens for r in requests), self.buckets.new_tokens
        )
        tokens, log_probs, lengths, *_ = jax.device_get(
            decoding.generate(
                self._step_fn,
                self.params,
                logits,
                cache,
                key=key,
                max_new_tokens=num_new,
                knobs=knobs,
                prompt_tokens=history,
                eos_id=self.tokenizer.eos_id,
                donate_state=True,
            )
        )
        results = [[] for _ in requests]
        for row, (index, p) in enumerate(owners):
            request = requests[index]
            results[index].append(
                self._completion(
                    p,
                    tokens[row],
                    min(lengths[row], request.max_new_tokens),
                    log_probs[row] if request.logprobs else None,
                )
            )
        return results

    def beam(self, requests: list[GenerateRequest]) -> list[list[dict]]:
        """Beam-search requests of one ``num_beams`` and ``max_new_tokens``
        (their knobs are neutral: :func:`requests.parse_generate` refuses
        sampling knobs with beam search)."""
        num_beams, num_new = requests[0].num_beams, requests[0].max_new_tokens
        owners = [
            (index, p)
            for index, request in enumerate(requests)
            for p in range(len(request.prompt_ids))
        ]
        logits, cache, _ = self._prefill(
            [ids for request in requests for ids in request.prompt_ids]
        )
        tokens, scores, lengths, _ = jax.device_get(
            decoding.beam_search(
                self._step_fn,
                self.params,
                logits,
                cache,
                num_beams=num_beams,
                max_new_tokens=num_new,
                eos_id=self.tokenizer.eos_id,
                num_return_sequences=num_beams,
            )
        )
        results = [[] for _ in requests]
        for row, (index, p) in enumerate(owners):
            for k in range(requests[index].num_return_sequences):
                results[index].append(
                    self._completion(
                        p, tokens[row, k], lengths[row, k], score=scores[row, k]
                    )
                )
        return results

    def score(self, request: ScoreRequest) -> dict[str, Any]:
        """:func:`scoring.score_text`'s totals, tokens and log-probs."""
        try:
            score = scoring.score_text(
                self.model,
                self.params,
                self.tokenizer,
                request.text,
                stride=request.stride,
                batch_size=self.score_batch_size,
            )
        except ValueError as error:
            raise requests.RequestError("text", str(error)) from None
        summary = score.summary()
        del summary["name"]
        return dict(
            summary,
            token_texts=score.token_texts,
            log_probs=[completions.json_float(x) for x in score.log_probs],
        )

    def complete(self, batch: list[openai_api.CompletionRequest]) -> list[dict]:
        """OpenAI completion requests of one group (see
        :func:`completions.run_completions`)."""
        return completions.run_completions(self, batch)

    def warm_up(self, window: bool = True) -> int:
        """Runs every bucketed shape once, so that later requests compile
        nothing; returns the number of programs run. ``window=False`` runs
        the scorer only: with continuous batching the window batcher's
        prefills and decoding serve only ``/v1/generate``, beam search and
        echo-only completions, which then compile a shape on its first use."""
        runs = 0
        one = np.zeros([1], np.int32)
        # Every served knob set, as a parsed request sets them (a knob left at
        # None would compile another program than the requests').
        served = {name: decoding.knobs.neutral_value(name) for name in SERVED_KNOBS}
        plain = dict(
            knobs=decoding.SamplingKnobs(**{**served, "temperature": 0.5}),
            seed=None,
            logprobs=False,
            num_return_sequences=1,
        )
        for rows in self.buckets.batch_sizes if window else ():
            for length in self.buckets.prompt_lengths:
                prompts = [np.zeros([length], np.int32)] * rows
                self._prefill(prompts)
                runs += 1
            for num_new in self.buckets.new_tokens:
                request = GenerateRequest([one] * rows, num_new, num_beams=1, **plain)
                self.sample([request])
                for num_beams in self.buckets.beam_sizes:
                    self.beam([dataclasses.replace(request, num_beams=num_beams)])
                runs += 1 + len(self.buckets.beam_sizes)
        # Scoring compiles one program per window shape, whatever the text.
        scoring.strided_log_probs(
            scoring.ModelLogits(self.model),
            self.params,
            np.zeros([2], np.int32),
            window=self.model.max_len,
            batch_size=self.score_batch_size,
        )
        return runs + 1


_unique = itertools.count()


def group_of(request: Any) -> tuple:
    """Jobs of equal groups may share a batch (see ``lmhead/serve/requests.py``)."""
    if isinstance(request, requests.ScoreRequest):
        return ("score", next(_unique))
    if isinstance(request, openai_api.CompletionRequest):
        return request.group()
    if request.num_beams > 1:
        return ("beam", request.num_beams, request.max_new_tokens)
    if request.seed is not None:
        return ("seeded", next(_unique))
    return ("sample", request.knobs.shared())


@dataclasses.dataclass(eq=False)  # jobs are distinct even with equal requests
class Job:
    """A request waiting for, or in, a batch."""

    request: Any
    group: tuple
    arrival: float
    future: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future
    )

    @property
    def rows(self) -> int:
        return getattr(self.request, "rows", 1)


class WorkQueue:
    """A bounded queue of jobs and the one worker thread that serves them,
    which :class:`Batcher` and :class:`lmhead.serve.continuous.SlotBatcher`
    share. A subclass sets up its own state, then calls :meth:`_start`.

    ``_changed`` is a condition over a re-entrant lock, so a subclass may
    hold it around :meth:`_enqueue` to record the job in the same step.
    """

    def __init__(self, max_queue: int):
        _checks.check_count("max_queue", max_queue)
        self.max_queue = max_queue
        self._waiting: collections.deque = collections.deque()
        self._changed = threading.Condition()
        self._stopping = False

    def _start(self, target: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def depth(self) -> int:
        """Jobs waiting (not counting those that run)."""
        return len(self._waiting)

    def _enqueue(self, job: Any) -> None:
        """Queues ``job`` for the worker.

        Raises:
            requests.QueueFull: ``max_queue`` jobs are waiting already.
            RuntimeError: the queue is stopped.
        """
        with self._changed:
            if self._stopping:
                raise RuntimeError("the batcher is stopped.")
            if len(self._waiting) >= self.max_queue:
                raise requests.QueueFull(f"{self.max_queue} requests are waiting.")
            self._waiting.append(job)
            self._changed.notify()


class Batcher(WorkQueue):
    """Queues requests for ``engine`` and runs them in batches.

    Args:
        engine: a warmed-up :class:`Engine`.
        max_queue: jobs that may wait; :meth:`submit` raises
            :class:`requests.QueueFull` beyond.
        window_s: how long the oldest waiting job waits for company.
        on_batch: called as ``on_batch(kind, rows)`` after each batch runs
            (``kind`` is ``"sample"``, ``"beam"``, ``"score"`` or
            ``"complete"``).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int,
        window_s: float,
        on_batch: Callable[[str, int], None] | None = None,
    ):
        super().__init__(max_queue)
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0; got {window_s!r}.")
        self.engine, self.window_s = engine, window_s
        self.max_rows = engine.buckets.batch_sizes[-1]
        self._on_batch = on_batch or (lambda kind, rows: None)
        self._start(self._serve_batches, "batcher")

    def submit(self, request: Any) -> concurrent.futures.Future:
        """Queues a checked request; its future gives a list of completions
        (generate) or a dict (score), or raises what the engine raised."""
        job = Job(request, group_of(request), time.monotonic())
        self._enqueue(job)
        return job.future

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Cancels a waiting request: it leaves the queue at once, so it
        takes no place in a batch and none against ``max_queue``. A no-op
        once its batch runs."""
        with self._changed:
            if future.cancel():
                self._waiting = collections.deque(
                    job for job in self._waiting if job.future is not future
                )
                self._changed.notify()

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
            while True:  # the head is read again after each wait: it may be gone
                while not self._waiting and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return []
                head = self._waiting[0]
                batch = self._batch_for(head)
                left = head.arrival + self.window_s - time.monotonic()
                full = sum(job.rows for job in batch) >= self.max_rows
                if left <= 0 or full or head.group[0] in ("score", "seeded"):
                    break
                self._changed.wait(left)
            for job in batch:
                self._waiting.remove(job)
            return batch

    def _serve_batches(self) -> None:
        while not self._stopping:
            batch = [
                job
                for job in self._next_batch()
                if job.future.set_running_or_notify_cancel()
            ]
            if batch:
                self._run_batch(batch)

    def _run_batch(self, batch: list[Job]) -> None:
        kind = batch[0].group[0]
        batch_requests = [job.request for job in batch]
        try:
            if kind == "score":
                results = [self.engine.score(batch_requests[0])]
            elif kind == "beam":
                results = self.engine.beam(batch_requests)
            elif kind == "complete":
                results = self.engine.complete(batch_requests)
            else:
                results = self.engine.sample(batch_requests)
        except Exception as error:
            for job in batch:  # the callers report it; the worker goes on
                job.future.set_exception(error)
            return
        for job, result in zip(batch, results):
            job.future.set_result(result)
        self._on_batch(
            "sample" if kind == "seeded" else kind, sum(job.rows for job in batch)
        )
