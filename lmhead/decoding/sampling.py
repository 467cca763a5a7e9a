"""Greedy decoding and sampling: :func:`generate`, one ``lax.while_loop``."""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lmhead import _checks
from lmhead.decoding import _loop
from lmhead.decoding._loop import StepFn
from lmhead.decoding.knobs import SamplingKnobs
from lmhead.decoding.processors import process_logits
from lmhead.decoding.stopping import StopCondition, StopSequences
from lmhead.head import NEG_INF

# Why a row ended (Generation.finish_reasons).
FINISHED_LENGTH = 0  # it reached its max_new_tokens (or row_max_new_tokens)
FINISHED_EOS = 1  # it produced one of eos_id
FINISHED_STOP = 2  # a stop condition ended it
FINISHED_BAD_LOGITS = 3  # the model's logits were not finite


class Generation(NamedTuple):
    """What :func:`generate` returns (``B*S`` rows, ``N = max_new_tokens``).

    Attributes:
        tokens: ``int32 [B*S, N]``, ``pad_id`` after a row's end.
        log_probs: ``float32 [B*S, N]``, each token's log-probability under
            the distribution ``log_probs_from`` names; 0 after a row's end,
            ``-inf`` at the step where the model's logits were not finite.
        lengths: ``int32 [B*S]``, tokens generated, EOS or stop included.
        finish_reasons: ``int32 [B*S]``, :data:`FINISHED_LENGTH`,
            :data:`FINISHED_EOS`, :data:`FINISHED_STOP` or
            :data:`FINISHED_BAD_LOGITS`.
        top_tokens: ``int32 [B*S, N, k]``, the ``k = top_logprobs`` most
            likely tokens at each step, most likely first (ties: lower id);
            ``pad_id`` after a row's end.
        top_log_probs: ``float32 [B*S, N, k]``, their log-probabilities
            (``-inf`` for a token the processors removed); 0 after the end.
    """

    tokens: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    finish_reasons: jax.Array
    top_tokens: jax.Array
    top_log_probs: jax.Array


class ProcessorContext(NamedTuple):
    """What a ``processor`` hook of :func:`generate` sees at each step.

    Attributes:
        step: ``int32 []``, the step (tokens generated so far by every row
            still going).
        tokens: ``int32 [B, N]``, the tokens generated so far, ``pad_id`` after.
        lengths: ``int32 [B]``, each row's generated tokens so far.
        prompt_lengths: ``int32 [B]``, each prompt's tokens (the non-negative
            ids of ``prompt_tokens``), 0 when ``prompt_tokens`` is None.
    """

    step: jax.Array
    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array


class SamplingState(NamedTuple):
    """The carry of :func:`generate`'s while loop.

    ``B`` rows (prompts times samples), ``N = max_new_tokens``, ``V`` tokens,
    ``H = P + N - 1`` history slots for a prompt of ``P`` tokens, ``k =
    top_logprobs``.

    Attributes:
        step: ``int32 []``, tokens generated so far by every row.
        logits: ``float32 [B, V]``, the model's logits for the next token.
        model_state: ``step_fn``'s state, every leaf ``[B, ...]``.
        key: a PRNG key for the remaining steps, or ``[B]`` keys, one per row,
            that stay as they are (the draw at step ``t`` uses ``fold_in(key,
            t)``).
        tokens: ``int32 [B, N]``, the output; ``pad_id`` after a row's end.
        log_probs: ``float32 [B, N]``, see :class:`Generation`.
        finished: ``bool [B]``, the row has ended.
        lengths: ``int32 [B]``, tokens generated, EOS included.
        history: ``int32 [B, H]``, prompt then generated tokens, latest last,
            ``NO_TOKEN`` on the left; None when no processor reads it.
        finish_reasons: ``int32 [B]``, see :class:`Generation`.
        top_tokens: ``int32 [B, N, k]``; top_log_probs: ``float32 [B, N, k]``.
        stop_carry: a tuple, each stop condition's carry.
        counts: ``int32 [B, V]``, how many times each token has been
            generated in the row; None unless a knob reads it.
    """

    step: jax.Array
    logits: jax.Array
    model_state: Any
    key: jax.Array
    tokens: jax.Array
    log_probs: jax.Array
    finished: jax.Array
    lengths: jax.Array
    history: jax.Array | None
    finish_reasons: jax.Array
    top_tokens: jax.Array
    top_log_probs: jax.Array
    stop_carry: tuple
    counts: jax.Array | None


class _SamplingConfig(NamedTuple):
    """Static (hashable) settings of :func:`generate` besides the knobs'."""

    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    top_logprobs: int = 0
    log_probs_from: str = "processed"
    processor: Callable | None = None


class _Rows(NamedTuple):
    """Per-row inputs that stay fixed through the loop (traced)."""

    max_new_tokens: jax.Array | None  # int32 [B]
    prompt_lengths: jax.Array | None  # int32 [B], when there is a processor


def _processed_logits(
    s: SamplingState, knobs: SamplingKnobs, rows: _Rows, config: _SamplingConfig
) -> jax.Array:
    """The built-in processors, then the ``processor`` hook."""
    counts = {} if s.counts is None else {"counts": s.counts}
    processed = process_logits(
        s.logits,
        knobs,
        history=s.history,
        num_generated=s.step,
        eos_id=_loop.eos_argument(config.eos_ids),
        **counts,
    )
    if config.processor is None:
        return processed
    context = ProcessorContext(s.step, s.tokens, s.lengths, rows.prompt_lengths)
    hooked = config.processor(processed, context)
    if jnp.shape(hooked) != processed.shape:
        raise ValueError(
            f"processor must return logits of shape {processed.shape}; got "
            f"{jnp.shape(hooked)}."
        )
    hooked = jnp.asarray(hooked, jnp.float32)
    emptied = jnp.all(hooked == NEG_INF, axis=-1, keepdims=True)
    return jnp.where(emptied, processed, hooked)


def _choose_tokens(
    s: SamplingState, processed: jax.Array, temperature: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """A draw from softmax(processed), or its argmax when ``temperature == 0``,
    and the key for the next step."""
    if _per_row_keys(s.key):  # the draw depends on the row's key and the step
        sampled, key = _loop.row_samples(s.key, s.step, processed), s.key
    else:
        key, sample_key = jax.random.split(s.key)
        sampled = jax.random.categorical(sample_key, processed, axis=-1)
    return _loop.greedy_where_cold(sampled, processed, temperature), key


def _per_row_keys(key: jax.Array) -> bool:
    return jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1


def _token_log_probs(
    s: SamplingState, processed: jax.Array, token: jax.Array, config: _SamplingConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The chosen tokens' log-probs ``[B]`` and the top ``k`` ``[B, k]``."""
    source = processed if config.log_probs_from == "processed" else s.logits
    log_dist = jax.nn.log_softmax(source, axis=-1)
    log_prob = jnp.take_along_axis(log_dist, token[:, None], axis=-1)[:, 0]
    if config.top_logprobs == 0:
        return log_prob, s.top_tokens[:, 0], s.top_log_probs[:, 0]
    top_log_probs, top_tokens = jax.lax.top_k(log_dist, config.top_logprobs)
    return log_prob, top_tokens.astype(jnp.int32), top_log_probs


def _sampling_continues(s: SamplingState) -> jax.Array:
    return (s.step < s.tokens.shape[1]) & ~jnp.all(s.finished)


def _update_stops(
    s: SamplingState, stop: tuple, token: jax.Array, active: jax.Array
) -> tuple[tuple, jax.Array]:
    ended = jnp.zeros_like(active)
    carries = []
    for condition, carry in zip(stop, s.stop_carry):
        carry, stopped = condition.update(carry, token, active)
        carries.append(carry)
        ended = ended | stopped
    return tuple(carries), ended & active


def _finish(
    s: SamplingState,
    token: jax.Array,
    bad: jax.Array,
    stopped: jax.Array,
    rows: _Rows,
    config: _SamplingConfig,
) -> tuple[jax.Array, jax.Array]:
    """``finished`` and ``finish_reasons`` after this step's tokens."""
    active = ~s.finished & ~bad
    eos = _loop.is_eos(token, config.eos_ids) & active
    at_limit = jnp.zeros_like(active)
    if rows.max_new_tokens is not None:
        at_limit = active & (s.step + 1 >= rows.max_new_tokens)
    reasons = jnp.where(stopped, FINISHED_STOP, s.finish_reasons)
    reasons = jnp.where(eos, FINISHED_EOS, reasons)
    reasons = jnp.where(bad, FINISHED_BAD_LOGITS, reasons)
    finished = s.finished | bad | eos | stopped | at_limit
    return finished, reasons.astype(jnp.int32)


def _sampling_step(
    s: SamplingState,
    *,
    step_fn: StepFn,
    params: Any,
    knobs: SamplingKnobs,
    stop: tuple,
    rows: _Rows,
    config: _SamplingConfig,
) -> SamplingState:
    processed = _processed_logits(s, knobs, rows, config)
    token, key = _choose_tokens(s, processed, knobs.temperature)
    log_prob, top_tokens, top_log_probs = _token_log_probs(s, processed, token, config)
    bad = _loop.not_finite(s.logits) & ~s.finished
    active = ~s.finished & ~bad
    token = jnp.where(s.finished | bad, config.pad_id, token)
    log_prob = jnp.where(s.finished, 0.0, jnp.where(bad, NEG_INF, log_prob))
    top_tokens = jnp.where(active[:, None], top_tokens, config.pad_id)
    top_log_probs = jnp.where(active[:, None], top_log_probs, 0.0)
    stop_carry, stopped = _update_stops(s, stop, token, active)
    finished, reasons = _finish(s, token, bad, stopped, rows, config)
    history, counts = s.history, s.counts
    if history is not None:
        history = jnp.concatenate([history[:, 1:], token[:, None]], axis=1)
    if counts is not None:
        row_ids = jnp.arange(counts.shape[0])
        counts = counts.at[row_ids, token].add(active.astype(jnp.int32), mode="drop")
    new = s._replace(
        step=s.step + 1,
        key=key,
        tokens=s.tokens.at[:, s.step].set(token),
        log_probs=s.log_probs.at[:, s.step].set(log_prob),
        finished=finished,
        lengths=s.lengths + active.astype(jnp.int32),
        history=history,
        finish_reasons=reasons,
        top_tokens=s.top_tokens.at[:, s.step].set(top_tokens),
        top_log_probs=s.top_log_probs.at[:, s.step].set(top_log_probs),
        stop_carry=stop_carry,
        counts=counts,
    )
    logits, model_state = _loop.maybe_step(
        step_fn, params, _sampling_continues(new), token, s.logits, s.model_state
    )
    return new._replace(logits=logits, model_state=model_state)


def _advance(
    s: SamplingState,
    until: jax.Array,
    step_fn: StepFn,
    params: Any,
    knobs: SamplingKnobs,
    stop: tuple,
    rows: _Rows,
    config: _SamplingConfig,
) -> SamplingState:
    """Runs the loop from ``s`` until step ``until`` or until every row ends.

    Streaming resumes the loop with this function, and :func:`generate` runs
    it once to the end: the same body, so chunks equal one call bitwise."""
    body = lambda s: _sampling_step(
        s,
        step_fn=step_fn,
        params=params,
        knobs=knobs,
        stop=stop,
        rows=rows,
        config=config,
    )
    cond = lambda s: _sampling_continues(s) & (s.step < until)
    return jax.lax.while_loop(cond, body, s)


def _start(
    step_fn: StepFn,
    params: Any,
    logits: jax.Array,
    model_state: Any,
    key: jax.Array,
    history: jax.Array | None,
    knobs: SamplingKnobs,
    stop: tuple,
    rows: _Rows,
    config: _SamplingConfig,
    until: jax.Array,
) -> SamplingState:
    """The loop's first state, advanced to step ``until``; the state is
    returned whole (its model state too, so that a donated state's buffers
    can alias it and be updated in place)."""
    batch, num_new, k = logits.shape[0], config.max_new_tokens, config.top_logprobs
    counts = None
    if knobs.reads_counts:
        counts = jnp.zeros(logits.shape, jnp.int32)
    init = SamplingState(
        step=jnp.zeros((), jnp.int32),
        logits=logits,
        model_state=model_state,
        key=key,
        tokens=jnp.full((batch, num_new), config.pad_id, jnp.int32),
        log_probs=jnp.zeros((batch, num_new), jnp.float32),
        finished=jnp.zeros((batch,), bool),
        lengths=jnp.zeros((batch,), jnp.int32),
        history=history,
        finish_reasons=jnp.full((batch,), FINISHED_LENGTH, jnp.int32),
        top_tokens=jnp.full((batch, num_new, k), config.pad_id, jnp.int32),
        top_log_probs=jnp.zeros((batch, num_new, k), jnp.float32),
        stop_carry=tuple(condition.init(batch) for condition in stop),
        counts=counts,
    )
    return _advance(init, until, step_fn, params, knobs, stop, rows, config)


def _columns(s: SamplingState, until: jax.Array, width: int | None) -> Any:
    """``s``, or with ``width`` given ``(s, chunk)``: the :class:`Generation`
    of columns ``until - width ... until - 1`` (a stream's chunk, cut by the
    program that computed it, so that the host dispatches one program per
    chunk and never waits between two)."""
    if width is None:
        return s
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, until - width, width, axis=1)
    whole = _generation_of(s)
    return s, whole._replace(
        tokens=take(whole.tokens),
        log_probs=take(whole.log_probs),
        top_tokens=take(whole.top_tokens),
        top_log_probs=take(whole.top_log_probs),
    )


def _start_columns(
    step_fn, params, logits, model_state, key, history, knobs, stop, rows, config,
    until, width,
):  # fmt: skip
    """:func:`_start`, then :func:`_columns`."""
    s = _start(
        step_fn, params, logits, model_state, key, history, knobs, stop, rows, config,
        until,
    )  # fmt: skip
    return _columns(s, until, width)


def _advance_columns(s, until, step_fn, params, knobs, stop, rows, config, width):
    """:func:`_advance`, then :func:`_columns`."""
    s = _advance(s, until, step_fn, params, knobs, stop, rows, config)
    return _columns(s, until, width)


_STATIC = ("step_fn", "config", "width")
_sampling_loop = jax.jit(_start_columns, static_argnames=_STATIC)
# Without donation the loop must first copy the caller's state into buffers
# it may write: for a key/value cache, a cost that follows its capacity.
_donating_sampling_loop = jax.jit(
    _start_columns, static_argnames=_STATIC, donate_argnames="model_state"
)
# A resumed loop owns its state: each chunk updates it in place.
_resume_loop = jax.jit(_advance_columns, static_argnames=_STATIC, donate_argnames="s")


def _stop_conditions(
    stop: Any, stop_sequences: Any, batch: int, vocab_size: int
) -> tuple:
    if stop is None:
        conditions = ()
    else:
        conditions = tuple(stop) if isinstance(stop, (tuple, list)) else (stop,)
    for condition in conditions:
        if not isinstance(condition, StopCondition):
            raise TypeError(
                "stop must be a StopCondition (init, update, repeat_rows, check) "
                f"or a tuple of them; got {type(condition).__name__}."
            )
    if stop_sequences is not None:
        conditions += (StopSequences.of(stop_sequences, batch),)
    for condition in conditions:
        condition.check(batch, vocab_size)
    return conditions


class _LoopArguments(NamedTuple):
    """:func:`_start`'s arguments but ``until``, and whether it may donate."""

    step_fn: StepFn
    params: Any
    logits: jax.Array
    model_state: Any
    key: jax.Array
    history: jax.Array | None
    knobs: SamplingKnobs
    stop: tuple
    rows: _Rows
    config: _SamplingConfig
    donate: bool


def _prepare(
    step_fn, params, logits, state, *, key, max_new_tokens, knobs, eos_id, pad_id,
    num_samples, prompt_tokens, donate_state, row_max_new_tokens, stop,
    stop_sequences, top_logprobs, log_probs_from, processor, knob_values,
) -> _LoopArguments:  # fmt: skip
    """Checks :func:`generate`'s arguments and repeats the rows per sample."""
    logits, batch, vocab_size = _loop.check_call(step_fn, logits, state)
    _checks.check_count("max_new_tokens", max_new_tokens)
    _checks.check_count("num_samples", num_samples)
    knobs = SamplingKnobs.of(knobs, **knob_values)
    knobs.check(batch, vocab_size)
    knobs = knobs.as_arrays()
    eos_ids = _loop.eos_ids(eos_id, vocab_size)
    _loop.check_outputs(top_logprobs, log_probs_from, vocab_size)
    if processor is not None:
        _loop.check_static_callable("processor", processor)
    limits = _loop.row_limits(row_max_new_tokens, batch, max_new_tokens)
    stop = _stop_conditions(stop, stop_sequences, batch, vocab_size)
    key = _loop.row_keys(key, batch, num_samples)
    history = prompt_lengths = None
    if knobs.reads_history or processor is not None:
        _loop.check_prompt_tokens(prompt_tokens, batch, vocab_size)
    if knobs.reads_history:  # [B, P + N - 1]: the prompt, right-aligned
        prompt = (
            jnp.zeros((batch, 0), jnp.int32) if prompt_tokens is None else prompt_tokens
        )
        history = _loop.right_aligned(prompt, jnp.shape(prompt)[1] + max_new_tokens - 1)
    if processor is not None:
        prompt_lengths = jnp.zeros((batch,), jnp.int32)
        if prompt_tokens is not None:
            prompt_lengths = jnp.sum(jnp.asarray(prompt_tokens) >= 0, axis=1)
        prompt_lengths = prompt_lengths.astype(jnp.int32)
    rows = _Rows(max_new_tokens=limits, prompt_lengths=prompt_lengths)
    if num_samples > 1:
        repeat = lambda x: jnp.repeat(x, num_samples, axis=0)
        logits, history, rows = jax.tree.map(repeat, (logits, history, rows))
        state = _loop.repeat_rows(step_fn, state, num_samples)
        knobs = knobs.repeat_rows(num_samples)
        stop = tuple(condition.repeat_rows(num_samples) for condition in stop)
    config = _SamplingConfig(
        max_new_tokens=int(max_new_tokens),
        eos_ids=eos_ids,
        pad_id=int(pad_id),
        top_logprobs=int(top_logprobs),
        log_probs_from=log_probs_from,
        processor=processor,
    )
    # The repeated state of num_samples > 1 is the loop's own to write.
    donate = bool(donate_state) or num_samples > 1
    return _LoopArguments(
        step_fn, params, logits, state, key, history, knobs, stop, rows, config, donate
    )


def _run(arguments: _LoopArguments, until: int) -> SamplingState:
    """The loop from its start to step ``until`` (or until every row ends)."""
    return _loops(arguments)[0](until)


def _loops(arguments: _LoopArguments) -> tuple[Callable, Callable]:
    """``(start(until, width=None), resume(s, until, width=None))``: the
    loop from its start, and resumed from ``s`` (which it consumes), to step
    ``until``; each device runs its own rows' loop where :func:`_split_loops`
    allows. Each returns the state, or with ``width`` the state and the
    chunk of columns ``until - width ... until - 1`` (:func:`_columns`).
    Made once per call of :func:`generate` or stream: the split places the
    parameters and per-row inputs on the mesh once for all of its chunks.
    ``until`` goes in as a host scalar, which the call places itself."""
    a = arguments
    split = _split_loops(a)
    if split is not None:
        start, resume, specs = split
        # Placed once, rather than sent to the devices by each chunk (no
        # copy where the caller has replicated them: sharding.replicate).
        mesh = a.step_fn.mesh
        params, knobs, stop, rows = jax.device_put(
            (a.params, a.knobs, a.stop, a.rows),
            jax.tree.map(
                lambda spec: NamedSharding(mesh, spec),
                (P(), *specs),
                is_leaf=lambda x: isinstance(x, P),
            ),
        )
        return (
            lambda until, width=None: start(
                params, *a[2:6], knobs, stop, rows, np.int32(until), width=width
            ),
            lambda s, until, width=None: resume(
                s, np.int32(until), params, knobs, stop, rows, width=width
            ),
        )
    loop = _donating_sampling_loop if a.donate else _sampling_loop
    return (
        lambda until, width=None: loop(*a[:-1], until=np.int32(until), width=width),
        lambda s, until, width=None: _resume_loop(
            s,
            np.int32(until),
            a.step_fn,
            a.params,
            a.knobs,
            a.stop,
            a.rows,
            a.config,
            width=width,
        ),  # fmt: skip
    )


def _row_specs(tree: Any, axis: str) -> Any:
    """A ``PartitionSpec`` per leaf of ``tree`` (knobs or a stop condition):
    ``P(axis)`` for a leaf with one entry per row (``tree.repeat_rows(2)``
    doubles its leading axis), ``P()`` for a shared one."""
    leaves, structure = jax.tree.flatten(tree)
    shapes = tuple((jnp.shape(leaf), jnp.result_type(leaf)) for leaf in leaves)
    return structure.unflatten(_row_spec_leaves(structure, shapes, axis))


@functools.lru_cache(maxsize=256)
def _row_spec_leaves(structure: Any, shapes: tuple, axis: str) -> tuple:
    # Cached: finding them traces repeat_rows, which costs more than a step.
    tree = structure.unflatten([jax.ShapeDtypeStruct(*shape) for shape in shapes])
    doubled = jax.tree.leaves(jax.eval_shape(lambda t: t.repeat_rows(2), tree))
    return tuple(
        P(axis) if shape and new.shape[0] == 2 * shape[0] else P()
        for (shape, _), new in zip(shapes, doubled)
    )


def _split_loops(arguments: _LoopArguments) -> tuple[Callable, Callable, tuple] | None:
    """The loop's start and resume run by each device on its own rows (and
    the ``PartitionSpec`` trees of the knobs, stops and rows), when
    ``step_fn`` splits the rows over a mesh (``step_fn.mesh``, and
    ``step_fn.per_device()`` the step of one device's rows) and a row's
    tokens cannot depend on that: a key per row, or one key with every
    temperature 0 (greedy), and no processor hook (which sees all rows).
    Each device then runs its own ``while_loop`` with no collective, the
    processors and stops included. None otherwise: the loop runs on the
    whole batch, only the step split."""
    a = arguments
    mesh = getattr(a.step_fn, "mesh", None)
    per_device = getattr(a.step_fn, "per_device", None)
    if mesh is None or per_device is None or a.config.processor is not None:
        return None
    if a.logits.shape[0] % mesh.size:  # the step says why it cannot split
        return None
    per_row_key = _per_row_keys(a.key)
    temperature = a.knobs.temperature
    # Read on the host (np, not jnp): a comparison on the device would wait
    # behind the work queued there.
    if not per_row_key and (
        _checks.is_traced(temperature) or np.any(np.asarray(temperature) > 0)
    ):
        return None
    axis = mesh.axis_names[0]
    rows = P(axis)
    specs = (
        rows,  # logits
        rows,  # model_state
        rows if per_row_key else P(),
        rows,  # history
        _row_specs(a.knobs, axis),
        tuple(_row_specs(c, axis) for c in a.stop),
        rows,  # rows
    )
    leaves, tree = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
    return _split_programs(
        per_device(), a.config, mesh, tree, tuple(leaves), per_row_key, a.donate,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _split_programs(step_fn, config, mesh, tree, leaves, per_row_key, donate):
    """The compiled start and resume of :func:`_split_loops`, and the specs
    of the knobs, stops and rows (one per set of static arguments and
    shardings, as ``jax.jit`` caches a function's)."""
    axis = mesh.axis_names[0]
    logits_spec, state_spec, key_spec, history_spec, *row_specs = tree.unflatten(leaves)
    row_specs = tuple(row_specs)  # the knobs', stops' and rows' specs

    # Outside, a device's own scalars (its step, and the single key it
    # splits) are stacked: one per device. A stream's chunk is cut inside.
    def stacked(s):
        return s._replace(step=s.step[None], key=s.key if per_row_key else s.key[None])

    def unstacked(s):
        return s._replace(step=s.step[0], key=s.key if per_row_key else s.key[0])

    split = functools.partial(
        jax.shard_map, mesh=mesh, check_vma=False, out_specs=P(axis)
    )

    def start(
        params, logits, model_state, key, history, knobs, stop, rows, until, width
    ):
        def local(params, logits, model_state, key, history, knobs, stop, rows, until):
            s = _start(step_fn, params, logits, model_state, key, history, knobs,
                       stop, rows, config, until)  # fmt: skip
            return _columns(stacked(s), until, width)

        specs = (P(), logits_spec, state_spec, key_spec, history_spec, *row_specs, P())
        return split(local, in_specs=specs)(
            params, logits, model_state, key, history, knobs, stop, rows, until
        )

    def resume(s, until, params, knobs, stop, rows, width):
        def local(s, until, params, knobs, stop, rows):
            s = _advance(
                unstacked(s), until, step_fn, params, knobs, stop, rows, config
            )
            return _columns(stacked(s), until, width)

        specs = (P(axis), P(), P(), *row_specs)
        return split(local, in_specs=specs)(s, until, params, knobs, stop, rows)

    return (
        jax.jit(start, static_argnames="width", donate_argnums=(2,) if donate else ()),
        jax.jit(resume, static_argnames="width", donate_argnums=(0,)),
        row_specs,
    )


def _generation_of(s: SamplingState) -> Generation:
    return Generation(
        tokens=s.tokens,
        log_probs=s.log_probs,
        lengths=s.lengths,
        finish_reasons=s.finish_reasons,
        top_tokens=s.top_tokens,
        top_log_probs=s.top_log_probs,
    )


def generate(
    step_fn: StepFn,
    params: Any,
    logits: jax.typing.ArrayLike,
    state: Any,
    *,
    key: jax.Array,
    max_new_tokens: int,
    knobs: SamplingKnobs | None = None,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    num_samples: int = 1,
    prompt_tokens: jax.typing.ArrayLike | None = None,
    donate_state: bool = False,
    row_max_new_tokens: jax.typing.ArrayLike | None = None,
    stop: StopCondition | tuple[StopCondition, ...] | None = None,
    stop_sequences: Sequence | None = None,
    top_logprobs: int = 0,
    log_probs_from: str = "processed",
    processor: Callable[[jax.Array, ProcessorContext], jax.Array] | None = None,
    **knob_values: Any,
) -> Generation:
    r"""Greedy decoding or sampling, with any combination of the processors.

    At step ``t`` every unfinished row draws

    .. math::
        y_t \sim \mathrm{softmax}(\tilde z_t), \qquad
        \tilde z_t = h(\mathrm{process\_logits}(z_t, \dots), c_t)

    (:func:`process_logits`, then the ``processor`` hook :math:`h` if given,
    with its :class:`ProcessorContext` :math:`c_t`), or takes
    :math:`\arg\max \tilde z_t` when ``temperature == 0``. By default the
    returned log-probabilities are :math:`\log \mathrm{softmax}(\tilde
    z_t)_{y_t}`, under the *processed* distribution (at ``temperature == 0``,
    the processed logits without any temperature); ``log_probs_from="model"``
    gives :math:`\log \mathrm{softmax}(z_t)_{y_t}`, the model's own (T5X's
    ``rescale_log_probs=False``). ``top_logprobs = k`` adds the ``k`` most
    likely tokens of the same distribution at every step.

    A row ends at the step where it produces one of ``eos_id``
    (:data:`FINISHED_EOS`), where a stop condition says so
    (:data:`FINISHED_STOP`; e.g. ``stop_sequences``, matched on generated
    tokens only, see :class:`~lmhead.decoding.stopping.StopSequences`), or
    after its ``row_max_new_tokens`` (or ``max_new_tokens``) tokens
    (:data:`FINISHED_LENGTH`). The ending token is kept and counted in
    ``lengths``; after it the row emits ``pad_id`` with log-prob 0, and the
    loop stops as soon as every row has ended.

    A row whose model logits are not finite (a NaN or ``+inf``, or every
    logit ``-inf``) cannot be decoded, and inside the loop nothing can raise:
    the row ends at that step (:data:`FINISHED_BAD_LOGITS`), which holds
    ``pad_id`` with log-prob ``-inf`` and adds nothing to its length.
    ``-inf`` never occurs otherwise (a chosen token has positive
    probability), so ``jnp.isneginf(log_probs).any(-1)`` flags exactly those
    rows.

    Static arguments (changing them recompiles): ``step_fn`` and
    ``processor`` (by hash), ``max_new_tokens``, ``num_samples``, the shapes
    of ``logits``, ``state``, ``prompt_tokens`` and the stop conditions,
    which processors and options are on (None or not), the static knobs
    (``no_repeat_ngram_size``, ``suppress_tokens``), ``eos_id``, ``pad_id``,
    ``top_logprobs``, ``log_probs_from`` and ``donate_state``. ``params``,
    ``key``, ``row_max_new_tokens``, the stop sequences' ids and the values
    of the traced knobs (``temperature``, 0 included, ``top_k``, ...) are
    traced: changing them does not recompile. Inside an outer ``jit`` they
    cannot be checked; the processors' documented rules apply.

    Args:
        step_fn: ``step_fn(params, tokens int32[B], state) -> (logits [B, V],
            state)``; hashable; must keep the structure, shapes and dtypes of
            ``state``. A step that splits the rows over a mesh (a ``mesh``
            attribute, and ``per_device()`` giving the step of one device's
            rows, as ``lmhead.lm.model.make_step_fn(model, mesh)``) makes
            each device run the loop on its own rows when that cannot
            change which rows a draw reads (a key per row, or greedy
            decoding; no ``processor``); the outputs are one device's to
            float32 rounding.
        params: any pytree, passed to every ``step_fn`` call (traced).
        logits: ``[B, V]`` next-token logits after each prompt.
        state: pytree whose every leaf has leading axis ``B`` (may be empty).
        key: one PRNG key (unused when ``temperature == 0``), or one key per
            prompt row, shape ``[B]`` (``jax.random.split(key, B)``, typed or
            raw): then row ``b``'s draw at step ``t`` uses ``fold_in(k, t)``
            of its own key ``k = fold_in(key_b, s)`` for sample ``s``, so a
            row's tokens are the same alone and in any batch.
        max_new_tokens: ``N >= 1``, the output's width (static).
        knobs: a :class:`~lmhead.decoding.knobs.SamplingKnobs`, or None to
            give its fields as keywords (``temperature=0.8, top_k=40``), not
            both. ``temperature`` 0 is greedy; the per-row knobs are a scalar
            or ``[B]``: rows may be greedy and sampled in one batch. See
            :func:`process_logits`.
        eos_id: an id in ``[0, V)`` that ends a row, a sequence of them, or
            None.
        pad_id: id written after a row's end.
        num_samples: ``S >= 1`` samples per prompt, drawn in one batch: the
            prompt rows of ``logits``, ``state`` and every per-row input are
            repeated (``state`` by ``step_fn.repeat(state, S)`` if ``step_fn``
            has one), and output row ``b * S + s`` is sample ``s`` of prompt
            ``b``.
        prompt_tokens: ``int [B, P]``, the prompts, read by the repetition
            penalty, the n-gram filter and ``ProcessorContext.prompt_lengths``
            (negative ids are padding, at either end). None: those see only
            the generated tokens.
        donate_state: True hands ``state``'s buffers (each leaf a distinct
            array) to the loop, which updates them in place and deletes the
            caller's arrays (on a backend that supports donation). False
            keeps ``state`` usable but copies it whole first, a per-call cost
            that grows with a cache's capacity, not its filled length: pass
            True for a state made for this call alone, such as
            :func:`lmhead.lm.model.prefill`'s. With ``num_samples > 1`` the loop
            always updates its own repeated copy in place. Inside an outer
            ``jit`` it changes nothing.
        row_max_new_tokens: ``int [B]``, each row's own limit ``1 <= n_b <=
            N``, or None (every row ``N``).
        stop: a :class:`~lmhead.decoding.stopping.StopCondition` or a tuple
            (or list) of them, or None.
        stop_sequences: token-id lists shared by every row, or one list of
            them per row: builds a :class:`~lmhead.decoding.stopping.StopSequences`
            added to ``stop``.
        top_logprobs: ``k >= 0`` (at most ``V``), static.
        log_probs_from: ``"processed"`` (the distribution sampled from) or
            ``"model"`` (the model's ``log_softmax``).
        processor: None or a hashable function ``(logits [B, V], context) ->
            logits [B, V]`` applied after the built-in processors (to the
            tempered logits when ``temperature > 0``); removing a token means
            setting its logit to :data:`NEG_INF`. A row whose every token it
            removes is drawn as if there were no hook.

    Returns:
        A :class:`Generation`: ``tokens``, ``log_probs``, ``lengths``,
        ``finish_reasons``, ``top_tokens`` and ``top_log_probs``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> table = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.2, 0.1, 0.7],
        ...                            [0.5, 0.3, 0.2]]))
        >>> markov = lambda table, tokens, state: (table[tokens], state)
        >>> logits = table[jnp.array([0, 1])]  # prompts ending in 0 and in 1
        >>> out = generate(
        ...     markov, table, logits, (), key=jax.random.key(0), max_new_tokens=4,
        ...     temperature=0.0, eos_id=0, pad_id=-1)
        >>> out.tokens
        Array([[ 1,  2,  0, -1],
               [ 2,  0, -1, -1]], dtype=int32)
        >>> out.lengths, jnp.exp(out.log_probs[1])
        (Array([3, 2], dtype=int32), Array([0.7, 0.5, 1. , 1. ], dtype=float32))
        >>> out = generate(
        ...     markov, table, logits, (), key=jax.random.key(0), max_new_tokens=4,
        ...     temperature=0.0, pad_id=-1, stop_sequences=[[2, 0]],
        ...     top_logprobs=2, row_max_new_tokens=jnp.array([4, 1]))
        >>> out.tokens
        Array([[ 1,  2,  0, -1],
               [ 2, -1, -1, -1]], dtype=int32)
        >>> out.finish_reasons  # FINISHED_STOP, FINISHED_LENGTH
        Array([2, 0], dtype=int32)
        >>> out.top_tokens[0, 0], jnp.exp(out.top_log_probs[0, 0])
        (Array([1, 2], dtype=int32), Array([0.6, 0.3], dtype=float32))
    """
    arguments = _prepare(
        step_fn, params, logits, state, key=key, max_new_tokens=max_new_tokens,
        knobs=knobs, eos_id=eos_id, pad_id=pad_id, num_samples=num_samples,
        prompt_tokens=prompt_tokens, donate_state=donate_state,
        row_max_new_tokens=row_max_new_tokens, stop=stop,
        stop_sequences=stop_sequences, top_logprobs=top_logprobs,
        log_probs_from=log_probs_from, processor=processor, knob_values=knob_values,
    )  # fmt: skip
    return _generation_of(_run(arguments, max_new_tokens))
