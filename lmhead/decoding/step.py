"""One decoding step, :func:`decode_step`, that every sampling decoder runs:
:func:`~lmhead.decoding.generate` and its streams in a ``lax.while_loop``, the
slots of continuous batching (:func:`~lmhead.decoding.step_slots`) in a
``lax.scan``; each feeds the step's tokens to the model's ``step_fn``.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmhead.decoding import _loop
from lmhead.decoding.constraint import TokenConstraint
from lmhead.decoding.knobs import SamplingKnobs
from lmhead.decoding.processors import process_logits
from lmhead.head import NEG_INF

# Why a row ended (Generation.finish_reasons, SlotChunk.finish_reasons).
FINISHED_LENGTH = 0  # it reached its limit of new tokens
FINISHED_EOS = 1  # it produced one of eos_id
FINISHED_STOP = 2  # a stop condition ended it, or its constraint allowed no token
FINISHED_BAD_LOGITS = 3  # the model's logits were not finite


class ProcessorContext(NamedTuple):
    """What a ``processor`` hook of :func:`~lmhead.decoding.generate` sees at each step.

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


class DecodeRows(NamedTuple):
    """The rows' state that :func:`decode_step` reads and advances (``B``
    rows, ``V`` tokens, ``H`` history slots).

    Attributes:
        logits: ``float32 [B, V]``, the model's logits for each row's next token.
        key: one PRNG key, split at every step in which a row samples
            (``temperature > 0``), or ``[B]`` keys, one per row, that stay
            as they are (the draw at step ``t`` uses ``fold_in(key, t)``).
        generated: ``int32 [B]``, tokens each row has generated, EOS included.
        limits: ``int32 [B]``: a row runs while ``generated < limits``; an
            ending (EOS, a stop, non-finite logits) sets it to ``generated``.
        finish_reasons: ``int32 [B]``, ``FINISHED_*``.
        history: ``int32 [B, H]``, prompt then generated tokens, latest last,
            ``NO_TOKEN`` on the left; None when no processor reads it.
        counts: ``int32 [B, V]``, how often each row generated each token;
            None when no knob reads them.
        stop_carry: a tuple, each stop condition's carry.
        constraint: None, or the rows' :class:`~lmhead.decoding.constraint.TokenConstraint`
            with the masks of their next token (``words``).
    """

    logits: jax.Array
    key: jax.Array
    generated: jax.Array
    limits: jax.Array
    finish_reasons: jax.Array
    history: jax.Array | None
    counts: jax.Array | None
    stop_carry: tuple
    constraint: TokenConstraint | None = None


class StepConfig(NamedTuple):
    """The step's static (hashable) settings besides the knobs'.

    Attributes:
        eos_ids: the distinct ids that end a row, in increasing order.
        pad_id: the token of a row that emits nothing.
        top_logprobs: ``k``, the most likely tokens to return per step.
        log_probs_from: ``"processed"`` (the distribution drawn from) or
            ``"model"`` (the model's ``log_softmax``).
        processor: None, or the hook ``(logits [B, V], ProcessorContext) ->
            logits [B, V]`` applied after the built-in processors.
        row_axis: None, or the mesh axis whose devices each step their own
            block of the batch's rows (``decoding/split.py``): one key's draw
            then takes this block's rows of the whole batch's noise.
    """

    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    top_logprobs: int = 0
    log_probs_from: str = "processed"
    processor: Callable | None = None
    row_axis: str | None = None


class StepOutput(NamedTuple):
    """What one step emitted (``B`` rows, ``k = top_logprobs``).

    Attributes:
        tokens: ``int32 [B]``, each row's token, ``pad_id`` where it emitted none.
        emitted: ``bool [B]``, the row was running and its logits were finite.
        bad: ``bool [B]``, the row was running and its logits were not finite:
            it ended at this step without a token.
        log_probs: ``float32 [B]``, each token's log-probability, 0 where none.
        top_tokens: ``int32 [B, k]``, the ``k`` most likely tokens, most likely
            first (ties: lower id), ``pad_id`` where none.
        top_log_probs: ``float32 [B, k]``, their log-probabilities, 0 where none.
    """

    tokens: jax.Array
    emitted: jax.Array
    bad: jax.Array
    log_probs: jax.Array
    top_tokens: jax.Array
    top_log_probs: jax.Array


def start_rows(
    logits: jax.Array,
    key: jax.Array,
    limits: jax.Array,
    history: jax.Array | None = None,
    counts: jax.Array | None = None,
    stop_carry: tuple = (),
    constraint: TokenConstraint | None = None,
) -> DecodeRows:
    """Rows about to draw their first token: none generated, each running
    until its limit (``int32 [B]``), :data:`FINISHED_LENGTH` unless
    something ends it first; a ``constraint`` without masks gets those of
    the rows' first tokens from its masker."""
    batch = logits.shape[0]
    if constraint is not None and constraint.words is None:
        constraint = constraint.started(logits.shape[-1])
    return DecodeRows(
        logits=logits,
        key=key,
        generated=jnp.zeros((batch,), jnp.int32),
        limits=limits,
        finish_reasons=jnp.full((batch,), FINISHED_LENGTH, jnp.int32),
        history=history,
        counts=counts,
        stop_carry=stop_carry,
        constraint=constraint,
    )


def is_running(rows: DecodeRows) -> jax.Array:
    """``bool [B]``: the row has not ended."""
    return rows.generated < rows.limits


def _processed_logits(
    rows: DecodeRows,
    knobs: SamplingKnobs,
    config: StepConfig,
    step: jax.Array,
    context: ProcessorContext | None,
) -> jax.Array:
    """The built-in processors, then the ``processor`` hook."""
    eos_ids = config.eos_ids
    processed = process_logits(
        _early_stops_removed(rows.logits, knobs, step),
        knobs,
        history=rows.history,
        counts=rows.counts,
        num_generated=step,
        eos_id=eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        allowed=None if rows.constraint is None else rows.constraint.words,
    )
    if config.processor is None:
        return processed
    hooked = config.processor(processed, context)
    if jnp.shape(hooked) != processed.shape:
        raise ValueError(
            f"processor must return logits of shape {processed.shape}; got "
            f"{jnp.shape(hooked)}."
        )
    hooked = jnp.asarray(hooked, jnp.float32)
    emptied = jnp.all(hooked == NEG_INF, axis=-1, keepdims=True)
    return jnp.where(emptied, processed, hooked)


def _early_stops_removed(
    logits: jax.Array, knobs: SamplingKnobs, step: jax.Array
) -> jax.Array:
    """``logits`` with the ``stop_tokens`` removed from the rows that have
    made fewer than ``min_new_tokens`` tokens (as ``min_new_tokens`` removes
    EOS), so that a stop token cannot end a row early."""
    if knobs.stop_tokens is None:
        return logits
    early = jnp.reshape(jnp.asarray(step) < knobs.min_new_tokens, (-1, 1))
    return jnp.where(early & (knobs.stop_tokens > 0), NEG_INF, logits)


def _is_stop_token(knobs: SamplingKnobs, token: jax.Array) -> jax.Array:
    """``bool [B]``: each row's token is one of its ``stop_tokens``."""
    mask = jnp.broadcast_to(
        knobs.stop_tokens, (token.shape[0], knobs.stop_tokens.shape[-1])
    )
    return jnp.take_along_axis(mask, token[:, None], axis=-1)[:, 0] > 0


def per_row_keys(key: jax.Array) -> bool:
    """Whether ``key`` is one typed PRNG key per row (``[B]``)."""
    return jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1


def _one_key_draw(
    key: jax.Array, processed: jax.Array, row_axis: str | None
) -> jax.Array:
    """``jax.random.categorical(key, processed)`` of the whole batch, whose
    rows, with ``row_axis``, are split in blocks over that axis's devices:
    each device draws the whole batch's Gumbel noise and adds its own
    block's, so a row's noise is the one it has on one device, bit for bit."""
    if row_axis is None:
        return jax.random.categorical(key, processed, axis=-1)
    block, vocab_size = processed.shape
    whole = (block * jax.lax.axis_size(row_axis), vocab_size)
    noise = jax.random.gumbel(key, whole, processed.dtype)
    start = jax.lax.axis_index(row_axis) * block
    noise = jax.lax.dynamic_slice_in_dim(noise, start, block, axis=0)
    return jnp.argmax(noise + processed, axis=-1)


def accepts_draft(
    processed: jax.Array, draft: jax.Array, uniform: jax.Array, temperature: jax.Array
) -> jax.Array:
    r"""Leviathan et al.'s and Chen et al.'s test of proposed tokens:
    ``bool [B]``, row ``b`` keeps ``draft[b]``.

    A proposal is one token :math:`d` (a point mass, :math:`q = \delta_d`),
    so the rule :math:`u < \min(1, p(d) / q(d))` is :math:`u < p(d)`,
    :math:`p = \mathrm{softmax}(\tilde z)` the processed distribution
    (every processor, the hook and the constraint applied) and :math:`u
    \sim U[0, 1)`; a rejected row then draws from the residual
    :math:`\max(0, p - q) \propto p` without :math:`d`
    (:func:`decode_step`'s ``rejected``), so each position's token has
    distribution :math:`p` exactly. Greedy rows (``temperature == 0``)
    keep :math:`d` where it is the argmax of :math:`\tilde z`.

    Args:
        processed: ``float32 [B, V]``, the processed logits :math:`\tilde z`.
        draft: ``int32 [B]``, the proposed tokens (a negative id is none).
        uniform: ``float32 [B]``, :math:`u`.
        temperature: ``[B]`` or a scalar.

    Examples:
        >>> z = jnp.log(jnp.array([[0.7, 0.3], [0.7, 0.3]]))
        >>> accepts_draft(z, jnp.array([1, 1]), jnp.array([0.2, 0.5]), 1.0)
        Array([ True, False], dtype=bool)
        >>> accepts_draft(z, jnp.array([0, 1]), jnp.array([0.9, 0.0]), 0.0)
        Array([ True, False], dtype=bool)

    References:
        Leviathan et al. 2023, "Fast Inference from Transformers via
        Speculative Decoding", arXiv:2211.17192; Chen et al. 2023,
        "Accelerating Large Language Model Decoding with Speculative
        Sampling", arXiv:2302.01318.
    """
    token = jnp.maximum(draft, 0)[:, None]
    p = jnp.take_along_axis(jax.nn.softmax(processed, axis=-1), token, axis=-1)[:, 0]
    greedy = jnp.argmax(processed, axis=-1) == draft
    return jnp.where(temperature > 0, uniform < p, greedy) & (draft >= 0)


def _choose_tokens(
    rows: DecodeRows,
    processed: jax.Array,
    temperature: jax.Array,
    step: jax.Array,
    row_axis: str | None,
    draft: jax.Array | None = None,
    rejected: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A draw from softmax(processed) (less each row's ``rejected`` token),
    or its argmax where ``temperature == 0``; with ``draft``, the drafts and
    whether each is accepted (:func:`accepts_draft`). Returns ``(tokens,
    the key for the next step, accepted: bool [B], all True without a
    draft)``.

    When no row samples (every ``temperature`` is 0), the step takes
    argmaxes only: no random bits are made and the key is not split
    (:func:`key_after_steps`). The draws are the same as if it were: a
    loop's temperatures do not change, so a key left unsplit is one that no
    row ever draws from (a per-row key is never split; with ``row_axis``
    each device carries its own copy of the one key, and splits it while
    any of its rows samples)."""
    if rejected is not None:
        removed = jnp.arange(processed.shape[-1]) == rejected[:, None]
        processed = jnp.where(removed, NEG_INF, processed)
    batch = processed.shape[0]

    def greedy():
        if draft is not None:
            zeros = jnp.zeros((batch,), jnp.float32)
            accepted = accepts_draft(processed, draft, zeros, 0.0)
            return jnp.maximum(draft, 0).astype(jnp.int32), rows.key, accepted
        chosen = jnp.argmax(processed, axis=-1).astype(jnp.int32)
        return chosen, rows.key, jnp.ones((batch,), bool)

    def draw():
        if per_row_keys(rows.key):  # a row's draw depends on its key and step only
            steps = jnp.broadcast_to(step, rows.key.shape)
            step_keys = jax.vmap(jax.random.fold_in)(rows.key, steps)
            key = rows.key
            # The test of a draft and the draw at the same step are independent.
            test_keys = jax.vmap(jax.random.fold_in, (0, None))(step_keys, 1)
            uniform = lambda: jax.vmap(jax.random.uniform)(test_keys)
            sampled = lambda: jax.vmap(jax.random.categorical)(step_keys, processed)
        else:
            key, sample_key = _split_one_key(rows.key)
            uniform = lambda: jax.random.uniform(sample_key, (batch,))
            sampled = lambda: _one_key_draw(sample_key, processed, row_axis)
        if draft is not None:
            accepted = accepts_draft(processed, draft, uniform(), temperature)
            return jnp.maximum(draft, 0).astype(jnp.int32), key, accepted
        argmax = jnp.argmax(processed, axis=-1)
        chosen = jnp.where(temperature > 0, sampled(), argmax).astype(jnp.int32)
        return chosen, key, jnp.ones((batch,), bool)

    return jax.lax.cond(_any_samples(temperature), draw, greedy)


def _any_samples(temperature: jax.Array) -> jax.Array:
    """``bool []``: some row samples (``temperature > 0``): the step draws,
    and splits one key."""
    return jnp.any(jnp.asarray(temperature) > 0)


def _split_one_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A sampling step's use of one key: ``(the next step's key, this
    step's draws' key)``."""
    carried, drawn = jax.random.split(key)
    return carried, drawn


def key_after_steps(key: jax.Array, temperature: jax.Array, steps: int) -> jax.Array:
    """``key`` as ``steps`` calls of :func:`decode_step` with these
    temperatures leave it: one key is split once per step in which a row
    samples (:func:`_split_one_key`), a per-row key never.

    Examples:
        >>> key = jax.random.key(0)
        >>> after = key_after_steps(key, jnp.array([0.0, 1.0]), 2)
        >>> twice = jax.random.split(jax.random.split(key)[0])[0]
        >>> bool(jnp.all(jax.random.key_data(after) == jax.random.key_data(twice)))
        True
        >>> same = key_after_steps(key, 0.0, 2)  # no row samples
        >>> bool(jnp.all(jax.random.key_data(same) == jax.random.key_data(key)))
        True
    """
    if per_row_keys(key):
        return key

    def split():
        new = key
        for _ in range(steps):
            new, _ = _split_one_key(new)
        return new

    return jax.lax.cond(_any_samples(temperature), split, lambda: key)


def _token_log_probs(
    rows: DecodeRows, processed: jax.Array, token: jax.Array, config: StepConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The chosen tokens' log-probs ``[B]`` and the top ``k`` ``[B, k]``."""
    source = processed if config.log_probs_from == "processed" else rows.logits
    log_dist = jax.nn.log_softmax(source, axis=-1)
    log_prob = jnp.take_along_axis(log_dist, token[:, None], axis=-1)[:, 0]
    batch, k = token.shape[0], config.top_logprobs
    if k == 0:
        return log_prob, jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0))
    top_log_probs, top_tokens = jax.lax.top_k(log_dist, k)
    return log_prob, top_tokens.astype(jnp.int32), top_log_probs


def _update_stops(
    rows: DecodeRows, stop: tuple, token: jax.Array, emitted: jax.Array
) -> tuple[tuple, jax.Array]:
    ended = jnp.zeros_like(emitted)
    carries = []
    for condition, carry in zip(stop, rows.stop_carry):
        carry, stopped = condition.update(carry, token, emitted)
        carries.append(carry)
        ended = ended | stopped
    return tuple(carries), ended & emitted


def advance_constraint(rows: DecodeRows, out: StepOutput) -> DecodeRows:
    """``rows`` whose constrained rows that emitted in ``out`` have handed
    their token to the masker and hold the masks of their next token
    (:meth:`~lmhead.decoding.constraint.TokenConstraint.advanced`); the same
    rows without a constraint. A loop issues it beside the model's forward
    pass of the step's tokens, on which it does not depend, and in the same
    branch of any ``lax.cond`` around that pass: XLA then runs the host's
    work while the device runs the model."""
    if rows.constraint is None:
        return rows
    advanced = rows.constraint.advanced(out.tokens, out.emitted)
    return rows._replace(constraint=advanced)


def decode_step(
    rows: DecodeRows,
    knobs: SamplingKnobs,
    stop: tuple,
    config: StepConfig,
    *,
    step: jax.Array,
    context: ProcessorContext | None = None,
    draft: jax.Array | None = None,
    rejected: jax.Array | None = None,
) -> tuple[DecodeRows, StepOutput]:
    r"""One token for every running row: processors, hook, draw, stops, log-probs.

    A running row (``generated < limits``) with finite logits :math:`z`
    emits

    .. math::
        y \sim \mathrm{softmax}(\tilde z), \qquad
        \tilde z = h(\mathrm{process\_logits}(z, \dots), c)

    (``argmax`` where its temperature is 0; :math:`h` the ``processor``
    hook, if any, with its context :math:`c`; ``process_logits`` removes the
    tokens that the row's constraint mask, if any, does not allow, before
    temperature and the filters), and its log-probability
    under :math:`\log\mathrm{softmax}(\tilde z)` (``log_probs_from ==
    "processed"``) or :math:`\log\mathrm{softmax}(z)` (``"model"``), with the
    top ``k`` of the same distribution. The row then ends, its limit set to
    its new length, at an ``eos_ids`` token (:data:`FINISHED_EOS`), or where a
    stop condition fires or at one of its ``stop_tokens``
    (:data:`FINISHED_STOP`; before ``min_new_tokens`` tokens the stop
    tokens are removed from :math:`z` as EOS is, and a stop condition that
    fires before the row holds ``min_new_tokens`` tokens does not end it,
    as vLLM checks stop strings); a row whose ``generated``
    reaches its limit ends with :data:`FINISHED_LENGTH`. A running row whose
    logits are not finite (:func:`~lmhead.decoding._loop.not_finite`) emits
    nothing and ends (:data:`FINISHED_BAD_LOGITS`); a running row whose
    constraint allows no token emits nothing and ends
    (:data:`FINISHED_STOP`: its grammar is complete in a vocabulary without
    end-of-text, or broken). Rows that emit append their token to
    ``history`` and ``counts``; the constrained rows' automata take the
    tokens in :func:`advance_constraint`, which the loops issue beside the
    model's next forward pass.

    Args:
        rows: the rows' :class:`DecodeRows`.
        knobs: :class:`~lmhead.decoding.knobs.SamplingKnobs` as arrays, each a
            scalar or one value per row.
        stop: a tuple of :class:`~lmhead.decoding.stopping.StopCondition`,
            whose carries are ``rows.stop_carry``.
        config: the static :class:`StepConfig`.
        step: ``int32 []`` or ``[B]``, the tokens generated so far (what
            ``min_new_tokens`` reads, and what a per-row key is folded with).
        context: the hook's :class:`ProcessorContext` (when there is one).
        draft: None, or speculative verification (``lmhead/decoding/
            speculative.py``): ``int32 [B]``, a proposed token per row
            (negative: none). A running row then emits its draft where
            :func:`accepts_draft` keeps it, and nothing otherwise (it stays
            running, its logits unused); nothing is drawn, and a row
            without a draft is left as it is.
        rejected: None, or ``int32 [B]``: the draft each row rejected at
            these logits (negative: none), which its draw leaves out (the
            residual distribution; the returned log-probs are the processed
            distribution's, with it).

    Returns:
        ``(rows, out)``: the advanced rows and the :class:`StepOutput`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> rows = DecodeRows(
        ...     logits=jnp.log(jnp.array([[0.2, 0.8], [0.6, 0.4]])),
        ...     key=jax.random.key(0), generated=jnp.array([0, 0]),
        ...     limits=jnp.array([3, 3]), finish_reasons=jnp.array([0, 0]),
        ...     history=None, counts=None, stop_carry=())
        >>> knobs = SamplingKnobs(temperature=0.0).as_arrays()
        >>> rows, out = decode_step(rows, knobs, (), StepConfig(eos_ids=(0,)),
        ...                         step=jnp.int32(0))
        >>> out.tokens, jnp.exp(out.log_probs)
        (Array([1, 0], dtype=int32), Array([0.8, 0.6], dtype=float32))
        >>> rows.generated, rows.limits, rows.finish_reasons  # row 1: EOS
        (Array([1, 1], dtype=int32), Array([3, 1], dtype=int32), Array([0, 1], dtype=int32))
    """
    running = is_running(rows)
    if draft is not None:  # only the rows with a draft are verified
        running &= draft >= 0
    processed = _processed_logits(rows, knobs, config, step, context)
    chosen, key, accepted = _choose_tokens(
        rows, processed, knobs.temperature, step, config.row_axis, draft, rejected
    )
    log_prob, top_tokens, top_log_probs = _token_log_probs(
        rows, processed, chosen, config
    )
    bad = _loop.not_finite(rows.logits) & running
    blocked = jnp.zeros_like(bad)
    if rows.constraint is not None:
        blocked = running & ~bad & ~rows.constraint.any_allowed(rows.logits.shape[-1])
    emitted = running & ~bad & ~blocked & accepted
    token = jnp.where(emitted, chosen, config.pad_id)
    stop_carry, stopped = _update_stops(rows, stop, token, emitted)
    if knobs.min_new_tokens is not None:  # vLLM's rule for stop strings
        stopped = stopped & (jnp.asarray(step) + 1 >= knobs.min_new_tokens)
    if knobs.stop_tokens is not None:
        stopped = stopped | (_is_stop_token(knobs, token) & emitted)
    eos = _loop.is_eos(token, config.eos_ids) & emitted
    generated = rows.generated + emitted.astype(jnp.int32)
    limits = jnp.where(eos | stopped | bad | blocked, generated, rows.limits)
    reasons = jnp.where(stopped | blocked, FINISHED_STOP, rows.finish_reasons)
    reasons = jnp.where(eos, FINISHED_EOS, reasons)
    reasons = jnp.where(bad, FINISHED_BAD_LOGITS, reasons).astype(jnp.int32)
    history, counts = rows.history, rows.counts
    if history is not None:
        rolled = jnp.concatenate([history[:, 1:], chosen[:, None]], axis=1)
        history = jnp.where(emitted[:, None], rolled, history)
    if counts is not None:
        row_ids = jnp.arange(counts.shape[0])
        counts = counts.at[row_ids, chosen].add(emitted.astype(jnp.int32))
    new = DecodeRows(
        logits=rows.logits,
        key=key,
        generated=generated,
        limits=limits,
        finish_reasons=reasons,
        history=history,
        counts=counts,
        stop_carry=stop_carry,
        constraint=rows.constraint,
    )
    out = StepOutput(
        tokens=token,
        emitted=emitted,
        bad=bad,
        log_probs=jnp.where(emitted, log_prob, 0.0),
        top_tokens=jnp.where(emitted[:, None], top_tokens, config.pad_id),
        top_log_probs=jnp.where(emitted[:, None], top_log_probs, 0.0),
    )
    return new, out
