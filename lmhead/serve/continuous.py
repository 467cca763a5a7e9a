"""Continuous batching of OpenAI completion requests, the service's one
batcher: :class:`SlotBatcher` decodes ``S`` slots
(:mod:`lmhead.decoding.slots`) on one worker thread, which frees the slots
of ended and cancelled rows, prefills waiting requests into free ones
(oldest first), dispatches a compiled call of ``steps_per_call`` steps, and
hands out the tokens of the call before while it runs. Each row's stop
strings are matched in the decode step, so a row ends, and its slot stops
decoding, at the token that completes one. Beam and echo-only
requests queue with the others and run whole between two calls
(:meth:`lmhead.serve.engine.Engine.run_whole`). A request's rows draw as
:func:`lmhead.decoding.generate` with per-row keys would, whatever runs
beside them. ``docs/serving.md`` describes it.
"""

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from lmhead import _checks, decoding
from lmhead.lm import constraints, data, generation, inference, kv_cache
from lmhead.serve import completions, requests
from lmhead.serve.requests import CompletionRequest

DEFAULT_STEPS_PER_CALL = 4


@functools.partial(jax.jit, static_argnums=(0, 13), donate_argnames="state")
def _prefill_into_slots(
    model, params, state, slots, prompts, lengths, key, recipe, limits, history, knobs,
    stops, constraint_ids, mtp=False,
):  # fmt: skip
    """``inference.prefill`` of ``prompts`` and ``decoding.fill_slots`` of the
    result, with each row's key made from ``recipe`` (the arrays of
    ``completions.key_recipe``), as one program: one dispatch per admission
    instead of one per operation (the rows were checked when their requests
    were parsed)."""
    logits, cache = inference.prefill(model, params, prompts, lengths, mtp=mtp)
    return decoding.fill_slots(
        state,
        slots,
        logits,
        cache,
        keys=completions.derive_keys(key, *recipe),
        max_new_tokens=limits,
        prompt_tokens=history,
        knobs=knobs,
        stop_strings=stops,
        constraint_ids=constraint_ids,
    )


@dataclasses.dataclass(eq=False)
class _Row:
    """One sequence of a request: sample ``s`` of prompt ``p``, in ``slot``."""

    p: int
    s: int
    slot: int = -1
    tokens: list = dataclasses.field(default_factory=list)
    log_probs: list = dataclasses.field(default_factory=list)
    top_tokens: list = dataclasses.field(default_factory=list)
    top_log_probs: list = dataclasses.field(default_factory=list)
    reason: int | None = None  # FINISHED_* once the row has ended
    first_call: int = 0  # the number of the first decoding call that runs it
    constraint_id: int = decoding.constraint.UNCONSTRAINED  # its automaton


@dataclasses.dataclass(eq=False)
class _Job:
    request: CompletionRequest
    arrival: float
    future: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future
    )
    rows: list = dataclasses.field(default_factory=list)
    prompt_scores: dict = dataclasses.field(default_factory=dict)
    stop_strings: tuple = ()  # encode_stop_strings of its stop strings, 1 row
    cancelled: bool = False
    last_tokens_at: float | None = None


@dataclasses.dataclass(frozen=True)
class SlotEvents:
    """Callbacks of :class:`SlotBatcher`, called from its worker thread.

    Attributes:
        first_token: ``(seconds)`` from a request's arrival to its first
            tokens.
        inter_token: ``(seconds)`` per token between two deliveries of a
            request's tokens (the gap divided by the tokens delivered).
        cancelled: ``(rows)`` when a running request is cancelled and its
            rows leave their slots.
    """

    first_token: Callable[[float], None] = lambda seconds: None
    inter_token: Callable[[float], None] = lambda seconds: None
    cancelled: Callable[[int], None] = lambda rows: None


def slot_count(slots: int | None, batch_sizes: tuple[int, ...]) -> int:
    """The decode slots of a :class:`SlotBatcher` over buckets of
    ``batch_sizes``: ``slots``, or the largest batch size when None.

    Raises:
        ValueError: ``slots`` is below the largest batch size (a request's
            rows start together) or not a positive integer.

    Examples:
        >>> slot_count(None, (1, 4)), slot_count(8, (1, 4))
        (4, 8)
    """
    largest = batch_sizes[-1]
    slots = largest if slots is None else slots
    _checks.check_count("slots", slots)
    if slots < largest:
        raise ValueError(
            f"slots must be at least the largest batch size {largest} (a "
            f"request's rows start together); got {slots}."
        )
    return slots


class SlotBatcher:
    """Queues completion requests for ``engine`` and decodes them in slots,
    on one worker thread.

    Args:
        engine: a :class:`lmhead.serve.engine.Engine`: its model, tokenizer
            and prompt-length buckets (:meth:`warm_up` compiles what the
            slots run).
        slots: ``S``, at least the largest batch bucket (a request's rows
            start together). Default: the largest batch bucket.
        max_queue: requests that may wait; :meth:`submit` raises
            :class:`requests.QueueFull` beyond.
        steps_per_call: decoding steps per compiled call: more steps cost
            fewer host round trips, fewer make a finished slot free sooner.
        prefill_rows: rows per prefill (waiting rows are prefilled this
            many at a time, padded); default ``min(4, slots)``.
        events: :class:`SlotEvents` for the metrics.
        limits: the requests' caps (default :class:`requests.Limits`): the
            slots hold a table of ``limits.max_stops`` stop strings of
            ``limits.max_stop_bytes`` bytes per row, so that one compiled
            step serves every request's strings.
        speculative: None, ``"mtp"`` or ``"ngram"``: every decoding step is
            speculative (``decoding.step_slots``' ``speculative``;
            ``generation.proposer`` makes the proposer), with
            ``num_speculative_tokens`` proposals; a slot advances by its
            accepted count plus one per step. The same tokens greedily, the
            same distribution sampled; constrained rows are not speculated
            (beam requests run whole, unspeculated).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from lmhead.lm import data, model as model_lib
        >>> from lmhead.serve import engine as engine_lib
        >>> tokenizer = data.CharTokenizer("abcd")
        >>> model = model_lib.DecoderLM(vocab_size=4, num_layers=1, num_heads=2,
        ...                             d_model=8, mlp_dim=16, max_len=8)
        >>> init = jax.jit(model.init)
        >>> params = init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> engine = engine_lib.Engine(model, params, tokenizer,
        ...                            requests.Buckets((2,), (4,), (4,)))
        >>> slots = SlotBatcher(engine, max_queue=4)
        >>> from lmhead.serve import protocol
        >>> body = protocol.body_models(16, 16, 64).completion(
        ...     model="m", prompt="ab", max_tokens=3, temperature=0.0)
        >>> request = requests.completion_request(
        ...     body, tokenizer, engine.buckets, requests.Limits(), "m", context=8)
        >>> slots.submit(request).result()["completion_tokens"]
        3
        >>> slots.stop()
    """

    def __init__(
        self,
        engine: Any,
        *,
        slots: int | None = None,
        max_queue: int,
        steps_per_call: int = DEFAULT_STEPS_PER_CALL,
        prefill_rows: int | None = None,
        events: SlotEvents = SlotEvents(),
        limits: requests.Limits | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int = 3,
    ):
        slots = slot_count(slots, engine.buckets.batch_sizes)
        _checks.check_count("max_queue", max_queue)
        _checks.check_count("steps_per_call", steps_per_call)
        self.max_queue = max_queue
        self._waiting: collections.deque = collections.deque()
        self._changed = threading.Condition()
        self._stopping = False
        self.engine, self.slots = engine, slots
        self.steps_per_call, self._events = steps_per_call, events
        self.prefill_rows = min(4, slots) if prefill_rows is None else prefill_rows
        _checks.check_count("prefill_rows", self.prefill_rows)
        model = engine.model
        self.proposer = generation.proposer(
            model, speculative, num_speculative_tokens, None
        )
        self._mtp = speculative == "mtp"
        self._vocab_size, self._history_len = model.vocab_size, model.max_len
        self._top = completions.top_width(engine)
        limits = requests.Limits() if limits is None else limits
        # The constrained rows' automata: one masker, one compiled step for
        # every constraint; a step in which no constrained row emits calls
        # nothing on the host.
        self.masker = constraints.masker_for(engine.tokenizer)
        self._stop_table = decoding.StopStrings.build(
            [[]] * slots,
            data.token_bytes(engine.tokenizer),
            max_bytes=limits.max_stop_bytes,
            max_strings=limits.max_stops,
        )
        self._state = self._empty_state()
        self._holders: list[tuple[_Job, _Row] | None] = [None] * slots
        self._calls = 0  # decoding calls dispatched
        self._jobs: dict[concurrent.futures.Future, _Job] = {}
        self._thread = threading.Thread(
            target=self._serve, name="slot-batcher", daemon=True
        )
        self._thread.start()

    def _empty_state(self) -> decoding.SlotState:
        return decoding.empty_slots(
            kv_cache.init_cache(self.engine.model, self.slots, mtp=self._mtp),
            vocab_size=self._vocab_size,
            history_len=self._history_len,
            key=jax.random.key(0),
            stop=self._stop_table,
            masker=self.masker,
        )

    # The interface the web layer uses.

    def active(self) -> int:
        """Slots that hold a running row."""
        return sum(holder is not None for holder in self._holders)

    def depth(self) -> int:
        """Requests waiting (not counting those that run)."""
        return len(self._waiting)

    def submit(self, request: CompletionRequest) -> concurrent.futures.Future:
        """Queues a checked completion request; its future gives
        :func:`completions.request_result`.

        Raises:
            requests.QueueFull: ``max_queue`` requests are waiting already.
            RuntimeError: the batcher is stopped.
        """
        job = _Job(request, time.monotonic())
        if not _runs_whole(request):
            job.rows = [
                _Row(p, s)
                for p in range(len(request.prompt_ids))
                for s in range(request.n)
            ]
        with self._changed:
            if self._stopping:
                raise RuntimeError("the batcher is stopped.")
            if len(self._waiting) >= self.max_queue:
                raise requests.QueueFull(f"{self.max_queue} requests are waiting.")
            self._waiting.append(job)
            self._jobs[job.future] = job
            self._changed.notify()
        return job.future

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Cancels a request: a waiting one leaves the queue, a running one
        frees its slots before the next decoding call. A no-op once it ended
        (or once a request that runs whole has started)."""
        with self._changed:
            job = self._jobs.get(future)
            if job is None:
                return
            job.cancelled = True
            if future.cancel():  # it was waiting: it leaves the queue now
                self._waiting.remove(job)
                del self._jobs[future]
            self._changed.notify()

    def stop(self) -> None:
        """Cancels every request (a running one's future raises
        ``CancelledError``) and ends the worker after its call."""
        with self._changed:
            self._stopping = True
            for job in list(self._jobs.values()):
                job.future.cancel()
            self._changed.notify()
        self._thread.join()

    def warm_up(self) -> int:
        """Compiles the slots' programs: a prefill per prompt-length bucket,
        the fill, the freeing of slots and the decoding call; returns the
        number compiled."""
        lengths = self.engine.buckets.prompt_lengths
        # Twice: the state a prefill takes comes from the empty state first,
        # and from a decoding call once serving (a state the fill leaves may
        # be laid out otherwise, which is another program).
        for _ in range(2):
            for length in lengths:
                self._prefill([], length)
            self._free([])
            self._state, chunk = self._step()
        jax.block_until_ready(chunk)
        return len(lengths) + 3

    # The worker.

    def _serve(self) -> None:
        pending = None  # (number, chunk) of the decoding call in flight
        while True:
            with self._changed:
                while not (self._stopping or self._waiting or self.active() or pending):
                    self._changed.wait()
                if self._stopping:
                    # A running job's future cannot be cancelled: fail it.
                    cancelled = concurrent.futures.CancelledError()
                    self._fail(self._running(), cancelled, on_device=False)
                    return
                admitted = self._admissible()
                cancelled = [job for job in self._running() if job.cancelled]
            try:
                if cancelled:
                    held = [h for h in self._holders if h and h[0].cancelled]
                    self._events.cancelled(len(held))
                    self._fail(cancelled, concurrent.futures.CancelledError())
                self._admit(admitted)
                running = None
                if self.active():
                    self._state, chunk = self._step()
                    self._calls += 1
                    running = (self._calls, chunk)
                # The previous call's tokens are handed over while this one
                # runs, so the device does not wait for the host's work.
                if pending is not None:
                    self._deliver(*pending)
                pending = running
            except Exception as error:  # fail the running requests, go on
                pending = None
                self._fail([*self._running(), *admitted], error, on_device=False)
                # A failed call may have consumed its donated buffers.
                self._state = self._empty_state()

    def _admissible(self) -> list[_Job]:
        """The waiting jobs, oldest first, that fit in the free slots (one
        job that does not fit stops the rest: none overtakes the oldest; a
        job that runs whole takes no slot)."""
        free = self.slots - self.active()
        taken = []
        while self._waiting:
            job = self._waiting[0]
            if job.future.cancelled():
                self._waiting.popleft()
                self._jobs.pop(job.future, None)
                continue
            if len(job.rows) > free:
                break
            self._waiting.popleft()
            if job.future.set_running_or_notify_cancel():
                taken.append(job)
                free -= len(job.rows)
            else:
                self._jobs.pop(job.future, None)
        return taken

    def _knobs(self, rows: list[tuple[_Job, _Row]], size: int):
        """Every row's knobs (:func:`decoding.full_knobs`), padding rows greedy."""
        pad = decoding.SamplingKnobs(temperature=0.0)
        each = [job.request.knobs for job, _ in rows] + [pad] * (size - len(rows))
        full = [decoding.full_knobs(k, 1, self._vocab_size) for k in each]
        return jax.tree.map(lambda *values: np.concatenate(values), *full)

    def _admit(self, jobs: list[_Job]) -> None:
        """Prefills the jobs' rows into free slots, ``prefill_rows`` rows per
        prefill (padded: one program per prompt-length bucket)."""
        rows, free = (
            [],
            iter(slot for slot, holder in enumerate(self._holders) if holder is None),
        )
        for job in jobs:
            if _runs_whole(job.request):
                self._run_whole(job)
                continue
            try:
                job.prompt_scores = completions.echo_scores(self.engine, job.request)
                job.stop_strings = decoding.encode_stop_strings(
                    [job.request.stop],
                    max_bytes=self._stop_table.stop_bytes.shape[-1],
                    max_strings=self._stop_table.stop_len.shape[-1],
                )
                recipe = completions.key_recipe(self.engine, job.request)
            except Exception as error:  # this request only: the others go on
                self._fail([job], error)
                continue
            for row, row_recipe in zip(job.rows, zip(*recipe)):
                if job.request.constraint is not None:
                    row.constraint_id = self.masker.start(job.request.constraint)
                row.slot, row.first_call = next(free), self._calls + 1
                self._holders[row.slot] = (job, row)
                rows.append((job, job.request.prompt_ids[row.p], row, row_recipe))
        for start in range(0, len(rows), self.prefill_rows):
            group = rows[start : start + self.prefill_rows]
            longest = max(len(ids) for _, ids, _, _ in group)
            self._prefill(
                group, requests.bucket(longest, self.engine.buckets.prompt_lengths)
            )

    def _run_whole(self, job: _Job) -> None:
        """Runs a beam or echo-only job as one program and answers it."""
        self._jobs.pop(job.future, None)
        try:
            job.future.set_result(self.engine.run_whole(job.request))
        except Exception as error:  # this request only: the others go on
            job.future.set_exception(error)

    def _prefill(self, group: list[tuple], length: int) -> None:
        """Prefills ``(job, prompt ids, row, key recipe)`` entries, padded to
        ``prefill_rows`` rows of ``length`` tokens, and fills their slots."""
        size, width = self.prefill_rows, self.engine.buckets.prompt_lengths[-1]
        prompts = np.full([size, width], -1, np.int32)
        lengths = np.ones([size], np.int32)
        slots = np.full([size], self.slots, np.int32)  # padding rows: dropped
        limits = np.ones([size], np.int32)
        recipe = np.zeros([3, size], np.int32)  # padding rows: any key
        table = self._stop_table
        stop_bytes = np.zeros([size, *table.stop_bytes.shape[1:]], np.uint8)
        stop_len = np.zeros([size, *table.stop_len.shape[1:]], np.int32)
        constraint_ids = np.full([size], decoding.constraint.UNCONSTRAINED, np.int32)
        for i, (job, ids, row, row_recipe) in enumerate(group):
            prompts[i, : len(ids)], lengths[i] = ids, len(ids)
            constraint_ids[i] = row.constraint_id
            slots[i], limits[i] = row.slot, job.request.prompt_max_tokens[row.p]
            recipe[:, i] = row_recipe
            stop_bytes[i], stop_len[i] = (rows[0] for rows in job.stop_strings)
        self._state = _prefill_into_slots(
            self.engine.model,
            self.engine.params,
            self._state,
            slots,
            np.maximum(prompts[:, :length], 0),
            lengths,
            self.engine._key,
            recipe,
            limits,
            prompts,
            self._knobs([(job, row) for job, _, row, _ in group], size),
            (stop_bytes, stop_len),
            constraint_ids,
            self._mtp,
        )

    def _step(self) -> tuple[decoding.SlotState, decoding.SlotChunk]:
        return decoding.step_slots(
            self.engine._step_fn,
            self.engine.params,
            self._state,
            num_steps=self.steps_per_call,
            eos_id=None,  # EOS is each row's stop token unless it ignores it
            top_logprobs=self._top,
            speculative=self.proposer,
        )

    def _free(self, slots: list[int]) -> None:
        """Ends the rows in ``slots`` on the device (one program: the list is
        padded to ``S`` with dropped entries)."""
        padded = np.full([self.slots], self.slots, np.int32)
        padded[: len(slots)] = slots
        self._state = decoding.free_slots(self._state, padded)

    def _deliver(self, number: int, chunk: decoding.SlotChunk) -> None:
        """Gives each row that call ``number`` ran its new tokens (``chunk``);
        releases the slots of rows that ended in it (at their limit, EOS, a
        stop id or string); streams and answers the jobs. A row admitted
        after that call started is not in it."""
        chunk = jax.device_get(chunk)
        now, touched = time.monotonic(), {}  # touched: job -> new tokens
        for slot, holder in enumerate(self._holders):
            if holder is None or holder[1].first_call > number:
                continue
            job, row = holder
            count = int(chunk.emitted[slot].sum())
            if count == 0 and chunk.generated[slot] < chunk.limits[slot]:
                continue
            row.tokens += chunk.tokens[slot, :count].tolist()
            row.log_probs += chunk.log_probs[slot, :count].tolist()
            row.top_tokens += list(chunk.top_tokens[slot, :count])
            row.top_log_probs += list(chunk.top_log_probs[slot, :count])
            touched[job] = touched.get(job, 0) + count
            if chunk.generated[slot] >= chunk.limits[slot]:
                row.reason = int(chunk.finish_reasons[slot])
                self._holders[slot] = None
                self.masker.release([row.constraint_id])
        for job, count in touched.items():
            try:
                self._report(job, count, now)
            except Exception as error:  # this request only: the others go on
                self._fail([job], error)

    def _report(self, job: _Job, new: int, now: float) -> None:
        """The job's metrics, its stream chunk, and its answer once every
        row has ended; ``new`` tokens came in this call."""
        if new and job.last_tokens_at is None:
            self._events.first_token(now - job.arrival)
        elif new:
            self._events.inter_token((now - job.last_tokens_at) / new)
        if new:
            job.last_tokens_at = now
        request, done = job.request, all(row.reason is not None for row in job.rows)
        if request.sink is not None and not done:
            request.sink(
                [
                    (
                        row.p * request.n + row.s,
                        (request.prompt_texts[row.p] if request.echo else "")
                        + completions.completion_text(
                            self.engine, request, row.tokens, row.reason is not None
                        ),
                        len(row.tokens),
                    )
                    for row in job.rows
                ]
            )
        if done:
            self._jobs.pop(job.future, None)
            if not job.future.done():
                job.future.set_result(self._result(job))

    def _result(self, job: _Job) -> dict:
        request, rows = job.request, job.rows
        width = max(1, max(len(row.tokens) for row in rows))
        k = self._top

        def pad(name, shape, dtype):
            out = np.zeros([len(rows), width, *shape], dtype)
            for i, row in enumerate(rows):
                values = np.asarray(getattr(row, name), dtype).reshape(-1, *shape)
                out[i, : len(values)] = values
            return out

        generated = decoding.Generation(
            tokens=pad("tokens", (), np.int32),
            log_probs=pad("log_probs", (), np.float32),
            lengths=np.asarray([len(row.tokens) for row in rows], np.int32),
            finish_reasons=np.asarray([row.reason for row in rows], np.int32),
            top_tokens=pad("top_tokens", (k,), np.int32),
            top_log_probs=pad("top_log_probs", (k,), np.float32),
        )
        return completions.request_result(
            self.engine,
            request,
            [(i, row.p, row.s) for i, row in enumerate(rows)],
            generated,
            job.prompt_scores,
        )

    def _running(self) -> list[_Job]:
        """The jobs whose rows hold slots."""
        return list({id(job): job for job, _ in filter(None, self._holders)}.values())

    def _fail(
        self, jobs: Sequence[_Job], error: Exception, on_device: bool = True
    ) -> None:
        """Answers each of ``jobs`` that is not done with ``error``, forgets
        them and empties the slots they hold (on the device too unless the
        caller rebuilds the state or the worker ends)."""
        failed = {id(job) for job in jobs}
        held = [
            slot
            for slot, holder in enumerate(self._holders)
            if holder is not None and id(holder[0]) in failed
        ]
        for slot in held:
            self.masker.release([self._holders[slot][1].constraint_id])
            self._holders[slot] = None
        if held and on_device:
            self._free(held)
        for job in jobs:
            self._jobs.pop(job.future, None)
            if not job.future.done():
                job.future.set_exception(error)


def _runs_whole(request: CompletionRequest) -> bool:
    """Beam and echo-only requests run whole, not in slots."""
    return request.num_beams > 1 or request.max_tokens == 0
