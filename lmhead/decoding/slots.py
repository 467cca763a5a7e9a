"""Continuous batching's decoding: ``S`` slots that requests enter and leave
between steps, each with its own step count, limit, key, history and knobs.

:func:`empty_slots` makes the state, :func:`fill_slots` puts prefilled prompts
into free slots, :func:`step_slots` runs :func:`~lmhead.decoding.step.decode_step`
(the step :func:`generate` runs) ``num_steps`` times in one compiled call, and
:func:`free_slots` ends rows. A row filled with the key ``generate`` gets for
it draws what ``generate`` draws (up to the float rounding of another batch
shape). Log-probs are the model's own. Each row's stop strings are matched in
the step (:class:`~lmhead.decoding.stop_strings.StopStrings`, a table of fixed
capacity whose rows a fill replaces), so a row ends, and its slot stops
decoding, at the token that completes one.
"""

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks
from lmhead.decoding import _loop
from lmhead.decoding._loop import StepFn
from lmhead.decoding.constraint import (
    UNCONSTRAINED,
    TokenConstraint,
    TokenMasker,
    mask_width,
)
from lmhead.decoding.knobs import (
    KNOBS,
    TRACED_KNOBS,
    SamplingKnobs,
    knob_spec,
    neutral_value,
)
from lmhead.decoding.processors import NO_TOKEN
from lmhead.decoding.speculative import Speculation, check_speculation, speculate
from lmhead.decoding.step import (
    DecodeRows,
    StepConfig,
    advance_constraint,
    decode_step,
    start_rows,
)
from lmhead.decoding.stop_strings import StopStrings


class SlotState(NamedTuple):
    """The slots' state; every leaf has the ``S`` slots first.

    Attributes:
        rows: the ``S`` slots' :class:`~lmhead.decoding.step.DecodeRows`,
            with ``[S]`` keys (step ``t`` of slot ``s`` draws from
            ``fold_in(key[s], t)``), limits 0 for a free slot, ``[S, H]``
            history, ``[S, V]`` counts, the carry of ``stop`` if any, and,
            with a masker, each slot's constraint (id ``-1`` and every token
            allowed for a slot without one).
        model_state: ``step_fn``'s state for ``S`` rows (a key/value cache).
        knobs: :class:`SamplingKnobs`, every traced knob ``[S]`` (``[S, V]``
            per token) and no static knob.
        stop: None, or the slots' :class:`StopStrings`, one row of strings
            per slot (``stop_bytes [S, S', Ls]``; empty for a free slot).
        rejected: ``int32 [S]``, with speculative decoding the draft each
            slot rejected at its logits, left out of its next draw
            (``NO_TOKEN``: none, as a fill leaves it).
    """

    rows: DecodeRows
    model_state: Any
    knobs: SamplingKnobs
    stop: StopStrings | None = None
    rejected: jax.Array | None = None


class SlotChunk(NamedTuple):
    """What :func:`step_slots` produced, ``N = num_steps``, ``K = top_logprobs``
    (with speculation, ``N (k + 1)`` columns: a step may give a slot ``k + 1``
    tokens).

    Attributes:
        tokens: ``int32 [S, N]``; ``emitted[s, j]`` says whether step ``j``
            gave slot ``s`` a token (0 where not).
        emitted: ``bool [S, N]``; a slot's emitted steps come first.
        log_probs: ``float32 [S, N]``, the model's log-prob of each token.
        top_tokens: ``int32 [S, N, K]``; top_log_probs: ``float32 [S, N, K]``.
        generated, limits, finish_reasons: the state's after the chunk; a
            slot whose row ended has ``generated == limits`` (0 for a row
            whose first logits could not be decoded, which
            ``finish_reasons`` tells apart from a free slot).
    """

    tokens: jax.Array
    emitted: jax.Array
    log_probs: jax.Array
    top_tokens: jax.Array
    top_log_probs: jax.Array
    generated: jax.Array
    limits: jax.Array
    finish_reasons: jax.Array


def full_knobs(knobs: SamplingKnobs, rows: int, vocab_size: int) -> SamplingKnobs:
    """``knobs`` with every traced knob as ``rows`` values (``logit_bias``
    ``[rows, V]``): a knob that is None becomes its neutral value, a scalar
    is repeated. The slots hold every knob, so that one compiled step serves
    every request.

    Raises:
        ValueError: a static knob (``no_repeat_ngram_size``,
            ``suppress_tokens``) is set: it would be one value for all slots.

    Examples:
        >>> knobs = full_knobs(SamplingKnobs(temperature=0.5, top_k=None), 2, 3)
        >>> knobs.temperature, knobs.top_k, knobs.logit_bias.shape
        (array([0.5, 0.5], dtype=float32), array([0, 0], dtype=int32), (2, 3))
    """
    for name in KNOBS:
        if name not in TRACED_KNOBS and getattr(knobs, name) is not None:
            raise ValueError(
                f"{name} is one value for the whole batch; slots take per-row "
                "knobs only (leave it None)."
            )
    knobs.check(rows, vocab_size)
    values = {}
    for name in TRACED_KNOBS:
        spec = knob_spec(name)
        value = getattr(knobs, name)
        if value is None:
            value = neutral_value(name)
        shape = (rows, vocab_size) if spec.get("per_token") else (rows,)
        values[name] = np.broadcast_to(np.asarray(value, spec["dtype"]), shape)
    return SamplingKnobs(**values)


def empty_slots(
    model_state: Any,
    *,
    vocab_size: int,
    history_len: int,
    key: jax.Array,
    stop: StopStrings | None = None,
    masker: TokenMasker | None = None,
) -> SlotState:
    """Free slots, one per row of ``model_state``.

    Args:
        model_state: ``step_fn``'s state for ``S`` rows, e.g.
            ``kv_cache.init_cache(model, S)``.
        vocab_size: ``V``.
        history_len: ``H``, the longest prompt plus generation a slot holds
            (the model's ``max_len``).
        key: one PRNG key, typed (``jax.random.key``) or raw key data
            (``jax.random.PRNGKey``): the free slots' keys, which a fill
            replaces.
        stop: None (no row has stop strings), or the slots' stop-string
            table: ``StopStrings.build([[]] * S, token_bytes,
            max_bytes=Ls, max_strings=S')``, whose capacity every fill's
            strings must fit.
        masker: None (no row is constrained), or the
            :class:`~lmhead.decoding.constraint.TokenMasker` of the rows'
            constraints (:func:`fill_slots`' ``constraint_ids``): static, one
            compile for every constraint.

    Examples:
        >>> state = empty_slots(jnp.zeros([3, 2]), vocab_size=5, history_len=4,
        ...                     key=jax.random.key(0))
        >>> state.rows.logits.shape, state.rows.limits, state.knobs.logit_bias.shape
        ((3, 5), Array([0, 0, 0], dtype=int32), (3, 5))
    """
    _checks.check_count("vocab_size", vocab_size)
    _checks.check_count("history_len", history_len)
    leaves = jax.tree.leaves(model_state)
    if not leaves or not jnp.ndim(leaves[0]):
        raise ValueError("model_state must have leaves with the slots first.")
    slots = jnp.shape(leaves[0])[0]
    _loop.check_state(model_state, slots)
    if stop is not None:
        if stop.stop_bytes.shape[0] != slots:
            raise ValueError(
                f"stop must be a table of one row per slot (S = {slots}); got "
                f"{stop.stop_bytes.shape[0]} rows."
            )
        stop.check(slots, vocab_size)
    if not jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        if jnp.shape(key) != (2,):
            raise ValueError(
                "key must be one PRNG key: jax.random.key(seed), or the raw "
                f"data of one, shape (2,); got shape {jnp.shape(key)}."
            )
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    elif jnp.shape(key) != ():
        raise ValueError(f"key must be one PRNG key; got shape {jnp.shape(key)}.")
    knobs = full_knobs(SamplingKnobs(temperature=0.0), slots, vocab_size)
    constraint = None
    if masker is not None:
        constraint = TokenConstraint(
            ids=jnp.full((slots,), UNCONSTRAINED, jnp.int32),
            masker=masker,
            words=jnp.full((slots, mask_width(vocab_size)), -1, jnp.int32),
        )
    rows = start_rows(
        logits=jnp.zeros((slots, vocab_size), jnp.float32),
        key=jax.random.split(key, slots),
        limits=jnp.zeros((slots,), jnp.int32),
        history=jnp.full((slots, history_len), NO_TOKEN, jnp.int32),
        counts=jnp.zeros((slots, vocab_size), jnp.int32),
        stop_carry=_stop_carry(stop, slots),
        constraint=constraint,
    )
    rejected = jnp.full((slots,), NO_TOKEN, jnp.int32)
    return SlotState(
        rows, model_state, jax.tree.map(jnp.asarray, knobs), stop, rejected
    )


def _stop_carry(stop: StopStrings | None, rows: int) -> tuple:
    """The stop carries of ``rows`` fresh rows: ``stop``'s, or none."""
    return () if stop is None else (stop.init(rows),)


@partial(jax.jit, donate_argnames="state")
def _fill(
    state, slots, logits, model_state, keys, limits, history, knobs, stops, ids
):  # fmt: skip
    put = lambda whole, rows: whole.at[slots].set(rows, mode="drop")
    old = state.rows
    constraint = None
    if old.constraint is not None:  # the new rows' first masks, from the host
        constraint = TokenConstraint(ids, old.constraint.masker)
    new = start_rows(
        logits,
        keys,
        limits,
        history=_loop.right_aligned(history, old.history.shape[1]),
        counts=jnp.zeros_like(logits, jnp.int32),
        stop_carry=_stop_carry(state.stop, logits.shape[0]),
        constraint=constraint,
    )
    stop = state.stop
    if stop is not None:
        stop_bytes, stop_len = stops
        stop = dataclasses.replace(
            stop,
            stop_bytes=put(stop.stop_bytes, stop_bytes),
            stop_len=put(stop.stop_len, stop_len),
        )
    return SlotState(
        rows=jax.tree.map(put, old, new),
        model_state=jax.tree.map(put, state.model_state, model_state),
        knobs=jax.tree.map(put, state.knobs, knobs),
        stop=stop,
        rejected=put(state.rejected, jnp.full(slots.shape, NO_TOKEN, jnp.int32)),
    )


def fill_slots(
    state: SlotState,
    slots: jax.typing.ArrayLike,
    logits: jax.typing.ArrayLike,
    model_state: Any,
    *,
    keys: jax.Array,
    max_new_tokens: jax.typing.ArrayLike,
    prompt_tokens: jax.typing.ArrayLike,
    knobs: SamplingKnobs,
    stop_strings: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike] | None = None,
    constraint_ids: jax.typing.ArrayLike | None = None,
) -> SlotState:
    """Starts ``R`` prefilled rows in ``slots`` (donates ``state``).

    Args:
        state: the slots.
        slots: ``int [R]``, the slot each row takes; a value ``>= S`` drops
            the row (the padding of a bucketed prefill).
        logits: ``float [R, V]``, each prompt's next-token logits.
        model_state: ``step_fn``'s state for the ``R`` rows (a prefilled
            cache with the shapes of ``state.model_state``'s rows).
        keys: ``[R]`` PRNG keys (or ``[R, 2]`` raw key data), one per row, as
            :func:`generate`'s ``key`` of one key per row: the row then draws
            what ``generate`` would.
        max_new_tokens: ``int [R]``, each row's limit, ``>= 1`` (the caller
            makes sure prompt plus limit fits the model).
        prompt_tokens: ``int [R, P]``, each prompt, negative ids after it.
        knobs: the rows' knobs as :func:`full_knobs` gives them.
        stop_strings: None (no row has stop strings), or the rows' strings
            ``(stop_bytes uint8 [R, S', Ls], stop_len int32 [R, S'])`` in
            the capacity of ``state.stop``:
            ``encode_stop_strings(per_row, max_bytes=Ls, max_strings=S')``
            (which refuses strings beyond it).
        constraint_ids: ``int [R]``, each row's automaton id in the slots'
            masker (``-1``: none), or None (no row is constrained); the fill
            asks the masker for their first masks.

    Examples:
        >>> state = empty_slots(jnp.zeros([3]), vocab_size=2, history_len=4,
        ...                     key=jax.random.key(0))
        >>> state = fill_slots(
        ...     state, jnp.array([2]), jnp.zeros([1, 2]), jnp.ones([1]),
        ...     keys=jax.random.split(jax.random.key(1), 1),
        ...     max_new_tokens=jnp.array([5]), prompt_tokens=jnp.array([[1, -1]]),
        ...     knobs=full_knobs(SamplingKnobs(), 1, 2))
        >>> state.rows.limits, state.model_state, state.rows.history[2]
        (Array([0, 0, 5], dtype=int32), Array([0., 0., 1.], dtype=float32), Array([-1, -1, -1,  1], dtype=int32))
    """
    logits = _checks.as_logits(logits, "[R, V]")
    rows = logits.shape[0]
    vocab_size = state.rows.logits.shape[1]
    if logits.shape[1] != vocab_size:
        raise ValueError(
            f"logits must have V = {vocab_size} columns; got {logits.shape}."
        )
    for name, value in (("slots", slots), ("max_new_tokens", max_new_tokens)):
        _checks.check_integer(name, value)
        if jnp.shape(value) != (rows,):
            raise ValueError(
                f"{name} must have shape [R] = ({rows},); got {jnp.shape(value)}."
            )
    _checks.check_in_range("slots", slots, low=0)
    _checks.check_in_range("max_new_tokens", max_new_tokens, low=1)
    typed = jnp.issubdtype(jnp.result_type(keys), jax.dtypes.prng_key)
    if jnp.shape(keys) != ((rows,) if typed else (rows, 2)):
        raise ValueError(
            f"keys must be one PRNG key per row: [R] = ({rows},) keys or "
            f"[R, 2] = ({rows}, 2) raw key data; got shape {jnp.shape(keys)}."
        )
    _loop.check_token_rows("prompt_tokens", prompt_tokens, rows, "[R, P]")
    _loop.check_state(model_state, rows)
    full = jax.tree.structure(state.knobs)
    if jax.tree.structure(knobs) != full:
        raise ValueError(
            "knobs must hold every traced knob; build them with full_knobs."
        )
    knobs.check(rows, vocab_size)
    return _fill(
        state,
        jnp.asarray(slots, jnp.int32),
        logits,
        model_state,
        _loop.row_keys(keys, rows, 1),
        jnp.asarray(max_new_tokens, jnp.int32),
        jnp.asarray(prompt_tokens, jnp.int32),
        jax.tree.map(jnp.asarray, knobs),
        _stop_rows(state.stop, stop_strings, rows),
        _constraint_rows(state.rows.constraint, constraint_ids, rows),
    )


def _constraint_rows(
    constraint: TokenConstraint | None, ids: Any, rows: int
) -> jax.Array | None:
    """``constraint_ids`` checked against the slots' masker (``-1``: none)."""
    if constraint is None:
        if ids is not None:
            raise ValueError(
                "constraint_ids needs slots with a masker (empty_slots' masker)."
            )
        return None
    if ids is None:
        return jnp.full((rows,), UNCONSTRAINED, jnp.int32)
    _checks.check_integer("constraint_ids", ids)
    if jnp.shape(ids) != (rows,):
        raise ValueError(
            f"constraint_ids must have shape [R] = ({rows},); got {jnp.shape(ids)}."
        )
    return jnp.asarray(ids, jnp.int32)


def _stop_rows(
    stop: StopStrings | None, stop_strings: tuple | None, rows: int
) -> tuple | None:
    """``stop_strings`` checked against the slots' table (zeros: none)."""
    if stop is None:
        if stop_strings is not None:
            raise ValueError(
                "stop_strings needs slots with a stop table (empty_slots' stop)."
            )
        return None
    shapes = ((rows, *stop.stop_bytes.shape[1:]), (rows, *stop.stop_len.shape[1:]))
    if stop_strings is None:
        return jnp.zeros(shapes[0], jnp.uint8), jnp.zeros(shapes[1], jnp.int32)
    stop_bytes, stop_len = stop_strings
    if (jnp.shape(stop_bytes), jnp.shape(stop_len)) != shapes:
        raise ValueError(
            f"stop_strings must have the shapes of the slots' table, [R, S', Ls] "
            f"= {shapes[0]} and [R, S'] = {shapes[1]} (encode_stop_strings with "
            f"that capacity); got {jnp.shape(stop_bytes)} and {jnp.shape(stop_len)}."
        )
    return jnp.asarray(stop_bytes, jnp.uint8), jnp.asarray(stop_len, jnp.int32)


@partial(jax.jit, donate_argnames="state")
def free_slots(state: SlotState, slots: jax.Array) -> SlotState:
    """Ends the rows in ``slots`` (``int [F]``; values outside ``[0, S)`` are
    ignored): their limit becomes what they have generated, so that they
    emit nothing more. A cancelled request frees its slots this way.

    Examples:
        >>> def two_rows():
        ...     state = empty_slots(jnp.zeros([2]), vocab_size=2, history_len=2,
        ...                         key=jax.random.key(0))
        ...     rows = state.rows._replace(limits=jnp.array([4, 4]),
        ...                                generated=jnp.array([1, 3]))
        ...     return state._replace(rows=rows)
        >>> free_slots(two_rows(), jnp.array([1, 5])).rows.limits
        Array([4, 3], dtype=int32)
        >>> free_slots(two_rows(), jnp.array([-1])).rows.limits  # no slot
        Array([4, 4], dtype=int32)
    """
    # A negative id would index from the end: it is sent past it instead.
    rows = state.rows
    slots = jnp.where(slots < 0, rows.limits.shape[0], slots)
    limits = rows.limits.at[slots].set(rows.generated[slots], mode="drop")
    return state._replace(rows=rows._replace(limits=limits))


def _one_step(step_fn, params, config: StepConfig, state: SlotState):
    stop = () if state.stop is None else (state.stop,)
    rows, out = decode_step(
        state.rows, state.knobs, stop, config, step=state.rows.generated
    )
    # Beside the model's pass below, on which it does not depend: the host
    # fills the next masks while the device runs the model.
    rows = advance_constraint(rows, out)
    # A row that emitted nothing feeds position 0 of its own cache row: it is
    # free or has ended, and its next fill overwrites it; left alone, its
    # position would run past the model's max_len.
    model_state = state.model_state
    reset = getattr(step_fn, "reset_rows", None)
    if reset is not None:
        model_state = reset(model_state, ~out.emitted)
    logits, model_state = step_fn(params, out.tokens, model_state)
    rows = rows._replace(logits=jnp.asarray(logits, jnp.float32))
    state = state._replace(rows=rows, model_state=model_state)
    return state, out._replace(bad=None)


def _one_speculative_step(step_fn, params, config, proposer, state: SlotState):
    """:func:`_one_step` with speculation: its ``k + 1`` outputs, ``[S,
    k + 1, ...]``, each slot's emitted ones first."""
    stop = () if state.stop is None else (state.stop,)
    rows, model_state, rejected, _, outs, _, _ = speculate(
        state.rows, state.model_state, state.rejected, (), step_fn=step_fn,
        params=params, knobs=state.knobs, stop=stop,
        spec=Speculation(proposer, config, reset_rows=hasattr(step_fn, "reset_rows")),
        emit=lambda sink, out, at: sink,
    )  # fmt: skip
    stacked = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), outs._replace(bad=None))
    state = state._replace(rows=rows, model_state=model_state, rejected=rejected)
    return state, stacked


def _emitted_first(outs: Any) -> Any:
    """``outs`` (leaves ``[S, M, ...]``) with each slot's emitted entries
    first, in order."""
    order = jnp.argsort(~outs.emitted, axis=1, stable=True)
    take = lambda x: jnp.take_along_axis(
        x, jnp.reshape(order, order.shape + (1,) * (x.ndim - 2)), axis=1
    )
    return jax.tree.map(take, outs)


@partial(
    jax.jit,
    static_argnames=("step_fn", "num_steps", "eos_ids", "top_logprobs", "speculative"),
    donate_argnames="state",
)
def _step_slots(
    step_fn, params, state, *, num_steps, eos_ids, top_logprobs, speculative
):  # fmt: skip
    # The slots' tokens are 0 where a slot emits none; log-probs are the model's.
    config = StepConfig(eos_ids, 0, top_logprobs, log_probs_from="model")
    if speculative is None:
        step = partial(_one_step, step_fn, params, config)
    else:
        step = partial(_one_speculative_step, step_fn, params, config, speculative)
    state, outs = jax.lax.scan(lambda s, _: step(s), state, length=num_steps)
    outs = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), outs)  # [S, N, ...]
    if speculative is not None:  # [S, N, k + 1, ...] -> [S, N (k + 1), ...]
        outs = jax.tree.map(
            lambda x: x.reshape((x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])),
            outs,
        )
        outs = _emitted_first(outs)
    rows = state.rows
    return state, SlotChunk(
        outs.tokens, outs.emitted, outs.log_probs, outs.top_tokens, outs.top_log_probs,
        rows.generated, rows.limits, rows.finish_reasons,
    )  # fmt: skip


def step_slots(
    step_fn: StepFn,
    params: Any,
    state: SlotState,
    *,
    num_steps: int,
    eos_id: int | Sequence[int] | None = None,
    top_logprobs: int = 0,
    speculative: Any = None,
) -> tuple[SlotState, SlotChunk]:
    """Decodes every slot ``num_steps`` times in one compiled call (donates
    ``state``).

    Each step is :func:`~lmhead.decoding.step.decode_step` of every slot
    (``num_generated = generated``; a row ends at its limit, at an
    ``eos_id`` or one of its ``stop_tokens``, or at the token that
    completes one of its stop strings, which it emits, or at non-finite
    logits, emitting nothing), then ``step_fn`` on all ``S``
    rows; if ``step_fn`` has ``reset_rows(state, rows)``, the rows that
    emitted nothing are emptied first
    (:func:`lmhead.lm.kv_cache.reset_rows`), so a free slot never runs past
    the cache.

    Args:
        step_fn: ``(params, tokens int32 [S], state) -> (logits [S, V],
            state)``, hashable (it is static).
        params: its parameters.
        state: the slots.
        num_steps: ``N >= 1`` steps per call.
        eos_id: None, an id or ids that end a row.
        top_logprobs: ``K``, the top log-probs to return per step.
        speculative: None, or a
            :class:`~lmhead.decoding.speculative.Proposer`: each step is a
            speculative step (:func:`~lmhead.decoding.speculative.speculate`),
            which gives a slot ``1 +`` its accepted proposals, ``k`` at most;
            the chunk then has ``N (k + 1)`` columns, each slot's tokens
            first. ``step_fn`` needs ``verify`` and ``rewind``.

    Returns:
        ``(state, chunk)``, :class:`SlotChunk` of the ``N`` steps.

    Examples:
        >>> table = jnp.log(jnp.array([[0.1, 0.9], [0.8, 0.2]]))
        >>> step_fn = lambda params, tokens, state: (params[tokens], state)
        >>> state = empty_slots(jnp.zeros([2]), vocab_size=2, history_len=8,
        ...                     key=jax.random.key(0))
        >>> state = fill_slots(
        ...     state, jnp.array([0, 1]), table, jnp.zeros([2]),
        ...     keys=jax.random.split(jax.random.key(1), 2),
        ...     max_new_tokens=jnp.array([3, 1]),
        ...     prompt_tokens=jnp.array([[0], [1]]),
        ...     knobs=full_knobs(SamplingKnobs(temperature=0.0), 2, 2))
        >>> state, chunk = step_slots(step_fn, table, state, num_steps=4)
        >>> chunk.tokens, chunk.emitted.sum(axis=1)
        (Array([[1, 0, 1, 0],
               [0, 0, 0, 0]], dtype=int32), Array([3, 1], dtype=int32))
    """
    _loop.check_static_callable("step_fn", step_fn)
    _checks.check_count("num_steps", num_steps)
    vocab_size = state.rows.logits.shape[1]
    eos_ids = _loop.eos_ids(eos_id, vocab_size)
    _loop.check_outputs(top_logprobs, "model", vocab_size)
    if speculative is not None:
        check_speculation(speculative, step_fn, state.model_state)
    return _step_slots(
        step_fn,
        params,
        state,
        num_steps=int(num_steps),
        eos_ids=eos_ids,
        top_logprobs=int(top_logprobs),
        speculative=speculative,
    )
