"""Greedy decoding and sampling: :func:`generate`, one ``lax.while_loop`` of
:func:`~lmhead.decoding.step.decode_step`, and :func:`generate_stream`, the same
loop resumed in chunks of steps."""

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks
from lmhead.decoding import _loop
from lmhead.decoding._loop import StepFn
from lmhead.decoding.constraint import TokenConstraint
from lmhead.decoding.knobs import SamplingKnobs
from lmhead.decoding.processors import NO_TOKEN
from lmhead.decoding.speculative import (
    Proposer,
    SpeculationStats,
    check_speculation,
    speculative_step,
)
from lmhead.decoding.split import split_loops
from lmhead.decoding.step import (
    DecodeRows,
    ProcessorContext,
    StepConfig,
    advance_constraint,
    decode_step,
    is_running,
    start_rows,
)
from lmhead.decoding.stopping import StopCondition, StopSequences
from lmhead.head import NEG_INF


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
        speculation: None, or with ``speculative`` a
            :class:`~lmhead.decoding.speculative.SpeculationStats`: each row's
            model calls and each draft's tests and acceptances.
    """

    tokens: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    finish_reasons: jax.Array
    top_tokens: jax.Array
    top_log_probs: jax.Array
    speculation: SpeculationStats | None = None


class SamplingState(NamedTuple):
    """The carry of :func:`generate`'s while loop.

    ``B`` rows (prompts times samples), ``N = max_new_tokens``, ``k =
    top_logprobs``.

    Attributes:
        step: ``int32 []``, tokens generated so far by every row.
        rows: the :class:`~lmhead.decoding.step.DecodeRows` that
            :func:`~lmhead.decoding.step.decode_step` advances (logits, key,
            lengths and limits, finish reasons, history, counts, stop carries).
        model_state: ``step_fn``'s state, every leaf ``[B, ...]``.
        tokens: ``int32 [B, N]``, the output; ``pad_id`` after a row's end.
        log_probs: ``float32 [B, N]``, see :class:`Generation`.
        top_tokens: ``int32 [B, N, k]``; top_log_probs: ``float32 [B, N, k]``.
        rejected: with speculation, ``int32 [B]``: the draft each row rejected
            at its carried logits, which its next draw leaves out
            (``NO_TOKEN``: none); else None.
        speculation: with speculation, its
            :class:`~lmhead.decoding.speculative.SpeculationStats`; else None.

    With speculation ``step`` counts the loop's steps, each of which gives a
    row one or more tokens (``rows.generated`` counts them).
    """

    step: jax.Array
    rows: DecodeRows
    model_state: Any
    tokens: jax.Array
    log_probs: jax.Array
    top_tokens: jax.Array
    top_log_probs: jax.Array
    rejected: jax.Array | None = None
    speculation: SpeculationStats | None = None


class _SamplingConfig(NamedTuple):
    """Static (hashable) settings of :func:`generate` besides the knobs'."""

    max_new_tokens: int
    step: StepConfig
    proposer: Proposer | None = None  # speculative decoding's


class _Rows(NamedTuple):
    """Per-row inputs that stay fixed through the loop (traced)."""

    max_new_tokens: jax.Array | None  # int32 [B]
    prompt_lengths: jax.Array | None  # int32 [B], when there is a processor
    constraint: TokenConstraint | None = None  # its ids [B], masker static


def _sampling_continues(s: SamplingState) -> jax.Array:
    return (s.step < s.tokens.shape[1]) & jnp.any(is_running(s.rows))


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
    context = None
    if config.step.processor is not None:
        lengths = s.rows.generated
        context = ProcessorContext(s.step, s.tokens, lengths, rows.prompt_lengths)
    decoded, out = decode_step(
        s.rows, knobs, stop, config.step, step=s.step, context=context
    )
    column = lambda whole, value: whole.at[:, s.step].set(value)
    new = s._replace(
        step=s.step + 1,
        rows=decoded,
        tokens=column(s.tokens, out.tokens),
        log_probs=column(s.log_probs, jnp.where(out.bad, NEG_INF, out.log_probs)),
        top_tokens=column(s.top_tokens, out.top_tokens),
        top_log_probs=column(s.top_log_probs, out.top_log_probs),
    )
    # The constraint's host call goes beside the model's pass, in its branch.
    logits, model_state, decoded = _loop.maybe_step(
        step_fn, params, _sampling_continues(new), out.tokens, s.rows.logits,
        s.model_state, beside=lambda: advance_constraint(decoded, out),
    )  # fmt: skip
    return new._replace(rows=decoded._replace(logits=logits), model_state=model_state)


def _advance(
    s: SamplingState,
    until: jax.Array,
    step_fn: StepFn,
    params: Any,
    knobs: SamplingKnobs,
    stop: tuple,
    rows: _Rows,
    config: _SamplingConfig,
    width: int | None = None,
) -> Any:
    """Runs the loop from ``s`` until step ``until`` or until every row ends;
    returns :func:`_columns`. Streaming resumes the loop with this function,
    and :func:`generate` runs it once to the end: the same body, so chunks
    equal one call bitwise."""
    body = lambda s: (_sampling_step if config.proposer is None else speculative_step)(
        s,
        step_fn=step_fn,
        params=params,
        knobs=knobs,
        stop=stop,
        rows=rows,
        config=config,
    )
    cond = lambda s: _sampling_continues(s) & (s.step < until)
    if config.proposer is not None:  # until a column: rows advance apart
        cond = lambda s: jnp.any(is_running(s.rows) & (s.rows.generated < until))
    return _columns(jax.lax.while_loop(cond, body, s), until, width)


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
    width: int | None = None,
) -> Any:
    """The loop's first state, advanced to step ``until`` (:func:`_advance`);
    the state is returned whole (its model state too, so that a donated
    state's buffers can alias it and be updated in place)."""
    batch, num_new = logits.shape[0], config.max_new_tokens
    k, pad_id = config.step.top_logprobs, config.step.pad_id
    limits = rows.max_new_tokens
    if limits is None:
        limits = jnp.full((batch,), num_new, jnp.int32)
    counts = None
    if knobs.reads_counts:
        counts = jnp.zeros(logits.shape, jnp.int32)
    init = SamplingState(
        step=jnp.zeros((), jnp.int32),
        rows=start_rows(
            logits,
            key,
            limits,
            history,
            counts,
            stop_carry=tuple(condition.init(batch) for condition in stop),
            constraint=rows.constraint,
        ),
        model_state=model_state,
        tokens=jnp.full((batch, num_new), pad_id, jnp.int32),
        log_probs=jnp.zeros((batch, num_new), jnp.float32),
        top_tokens=jnp.full((batch, num_new, k), pad_id, jnp.int32),
        top_log_probs=jnp.zeros((batch, num_new, k), jnp.float32),
    )
    if config.proposer is not None:
        init = init._replace(
            rejected=jnp.full((batch,), NO_TOKEN, jnp.int32),
            speculation=SpeculationStats.empty(batch, config.proposer.num_tokens),
        )
    return _advance(init, until, step_fn, params, knobs, stop, rows, config, width)


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


_STATIC = ("step_fn", "config", "width")
_sampling_loop = jax.jit(_start, static_argnames=_STATIC)
# Without donation the loop must first copy the caller's state into buffers
# it may write: for a key/value cache, a cost that follows its capacity.
_donating_sampling_loop = jax.jit(
    _start, static_argnames=_STATIC, donate_argnames="model_state"
)
# A resumed loop owns its state: each chunk updates it in place.
_resume_loop = jax.jit(_advance, static_argnames=_STATIC, donate_argnames="s")


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
    stop_sequences, top_logprobs, log_probs_from, processor, constraint, speculative,
    knob_values,
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
    if speculative is not None:
        check_speculation(speculative, step_fn, state)
    reads_history = knobs.reads_history or (
        speculative is not None and speculative.reads_history
    )
    if reads_history or processor is not None:
        _loop.check_prompt_tokens(prompt_tokens, batch, vocab_size)
    if reads_history:  # [B, P + N - 1]: the prompt, right-aligned
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
    if constraint is not None:  # one automaton per output row
        if not isinstance(constraint, TokenConstraint):
            raise TypeError(
                "constraint must be a TokenConstraint(ids, masker) or None; got "
                f"{type(constraint).__name__}."
            )
        constraint.check(batch * num_samples)
        ids = jnp.asarray(constraint.ids, jnp.int32)
        rows = rows._replace(constraint=TokenConstraint(ids, constraint.masker))
    config = _SamplingConfig(
        max_new_tokens=int(max_new_tokens),
        step=StepConfig(
            eos_ids=eos_ids,
            pad_id=int(pad_id),
            top_logprobs=int(top_logprobs),
            log_probs_from=log_probs_from,
            processor=processor,
        ),
        proposer=speculative,
    )
    # The repeated state of num_samples > 1 is the loop's own to write.
    donate = bool(donate_state) or num_samples > 1
    return _LoopArguments(
        step_fn, params, logits, state, key, history, knobs, stop, rows, config, donate
    )


def _loops(arguments: _LoopArguments) -> tuple[Callable, Callable]:
    """``(start(until, width=None), resume(s, until, width=None))``: the
    loop from its start, and resumed from ``s`` (which it consumes), to step
    ``until``; each device runs its own rows' loop where
    :func:`~lmhead.decoding.split.split_loops` allows. Each returns the state, or with ``width`` the state and the
    chunk of columns ``until - width ... until - 1`` (:func:`_columns`).
    Made once per call of :func:`generate` or stream. ``until`` goes in as a
    host scalar, which the call places itself."""
    a = arguments
    split = split_loops(a, _start, _advance, _columns)
    if split is not None:
        return split
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


def _generation_of(s: SamplingState) -> Generation:
    return Generation(
        tokens=s.tokens,
        log_probs=s.log_probs,
        lengths=s.rows.generated,
        finish_reasons=s.rows.finish_reasons,
        top_tokens=s.top_tokens,
        top_log_probs=s.top_log_probs,
        speculation=s.speculation,
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
    constraint: TokenConstraint | None = None,
    speculative: Proposer | None = None,
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
    logit ``-inf``) ends at that step (:data:`FINISHED_BAD_LOGITS`) with
    ``pad_id`` and log-prob ``-inf``, which occurs nowhere else.

    ``params``, ``key``, ``row_max_new_tokens``, the stop conditions' arrays
    and the traced knobs' values are traced (changing them does not
    recompile; inside an outer ``jit`` the processors' documented rules
    apply); every other argument, the shapes and which knobs are on are
    static.

    Args:
        step_fn: ``step_fn(params, tokens int32[B], state) -> (logits [B, V],
            state)``; hashable; must keep the structure, shapes and dtypes of
            ``state``. A step that splits the rows over a mesh makes each
            device run the loop on its own rows (:mod:`lmhead.decoding.split`)
            unless there is a ``processor``.
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
        donate_state: True hands ``state``'s buffers to the loop, which
            updates them in place (a fresh :func:`lmhead.lm.inference.prefill`
            state); False copies ``state`` first.
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
        constraint: None, or a
            :class:`~lmhead.decoding.constraint.TokenConstraint` ``(ids,
            masker)`` with one automaton id per output row (``[B*S]``, ``-1``
            for a row without one): each step removes the tokens the row's
            automaton does not allow (after the penalties and ``logit_bias``,
            before temperature and the filters: greedy takes the best allowed
            token, sampling renormalizes over the allowed ones) and hands the
            drawn tokens to ``masker``; a row whose automaton allows no token
            ends (:data:`FINISHED_STOP`). ``ids`` are traced: a new
            constraint compiles nothing. The loop then runs over the whole
            batch (no split over devices).
        speculative: None, or a
            :class:`~lmhead.decoding.speculative.Proposer` (n-gram lookup,
            :class:`~lmhead.decoding.speculative.NGramProposer`, or a run's
            MTP heads, ``lmhead.lm.inference.MTPProposer``): speculative
            decoding (:mod:`lmhead.decoding.speculative`). Each step checks
            its ``k`` proposals with one ``step_fn.verify`` call; greedy rows
            get plain greedy's tokens and sampled rows plain sampling's
            distribution, under every knob, hook and stop (draws differ,
            since they use the keys otherwise). ``generation.speculation``
            counts the calls and acceptances. Rows with a constraint are not
            speculated; the loop runs over the whole batch.

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
    """
    arguments = _prepare(
        step_fn, params, logits, state, key=key, max_new_tokens=max_new_tokens,
        knobs=knobs, eos_id=eos_id, pad_id=pad_id, num_samples=num_samples,
        prompt_tokens=prompt_tokens, donate_state=donate_state,
        row_max_new_tokens=row_max_new_tokens, stop=stop,
        stop_sequences=stop_sequences, top_logprobs=top_logprobs,
        log_probs_from=log_probs_from, processor=processor, constraint=constraint,
        speculative=speculative, knob_values=knob_values,
    )  # fmt: skip
    start = _loops(arguments)[0]  # the loop from its start, to its end
    return _generation_of(start(max_new_tokens))


def generate_stream(
    step_fn: StepFn,
    params: Any,
    logits: jax.typing.ArrayLike,
    state: Any,
    *,
    chunk_steps: int,
    **arguments: Any,
) -> Iterator[Generation]:
    """:func:`~lmhead.decoding.generate`, yielding its columns ``chunk_steps`` at a time.

    The first chunk runs :func:`~lmhead.decoding.generate`'s compiled loop to
    step ``k = chunk_steps``; each next one resumes it from its carried state
    (donated: updated in place) to ``k`` steps further. Chunk ``c`` holds
    columns ``c k ... min((c + 1) k, N) - 1`` of ``tokens``, ``log_probs``,
    ``top_tokens`` and ``top_log_probs``, and ``lengths`` and
    ``finish_reasons`` as they stand after those steps. Every chunk runs the
    same loop body as one call, so the chunks concatenated along the token
    axis (with the last chunk's ``lengths`` and ``finish_reasons``) equal one
    :func:`~lmhead.decoding.generate` call bitwise. The iterator always
    covers all ``N = max_new_tokens`` columns; once every row has ended, the
    rest are ``pad_id`` and the loop does no more steps. Each chunk's
    successor is already dispatched when the chunk is yielded, so the
    device decodes while the caller reads; a caller that stops early has
    paid for one chunk more.

    The arguments are checked when this function is called.

    Args:
        step_fn, params, logits, state: as for :func:`~lmhead.decoding.generate`.
        chunk_steps: ``k >= 1`` steps per chunk.
        **arguments: :func:`~lmhead.decoding.generate`'s keyword arguments
            (``key`` and ``max_new_tokens`` are required).

    Returns:
        An iterator of ``ceil(N / k)`` :class:`~lmhead.decoding.Generation`
        chunks.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> table = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.2, 0.1, 0.7],
        ...                            [0.5, 0.3, 0.2]]))
        >>> markov = lambda table, tokens, state: (table[tokens], state)
        >>> chunks = generate_stream(
        ...     markov, table, table[jnp.array([0])], (), chunk_steps=2,
        ...     key=jax.random.key(0), max_new_tokens=5, temperature=0.0)
        >>> [chunk.tokens.tolist() for chunk in chunks]
        [[[1, 2]], [[0, 1]], [[2]]]
    """
    _checks.check_count("chunk_steps", chunk_steps)
    bound = inspect.signature(generate).bind(
        step_fn, params, logits, state, **arguments
    )
    bound.apply_defaults()
    loop = _prepare(**bound.arguments)
    return _chunks(loop, chunk_steps)


def _chunks(loop: Any, chunk_steps: int) -> Iterator[Generation]:
    num_new = loop.config.max_new_tokens
    end = min(chunk_steps, num_new)
    start_loop, resume_loop = _loops(loop)
    # Each program returns its chunk's columns beside the state, so that the
    # next one is dispatched before the caller reads (and so waits for) this
    # one: the device decodes while the caller reads.
    s, chunk = start_loop(end, width=end)
    while end < num_new:
        width = min(chunk_steps, num_new - end)
        end += width
        s, following = resume_loop(s, end, width=width)
        yield chunk
        chunk = following
    yield chunk
