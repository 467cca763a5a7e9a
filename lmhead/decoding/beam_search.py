"""Beam search: :func:`beam_search`, one ``lax.while_loop`` over ``K`` beams per prompt."""

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks
from lmhead.decoding import _loop, split
from lmhead.decoding._loop import StepFn
from lmhead.decoding.knobs import SamplingKnobs
from lmhead.decoding.sampling import Generation
from lmhead.decoding.step import FINISHED_BAD_LOGITS, FINISHED_EOS, FINISHED_LENGTH
from lmhead.head import NEG_INF

# The length penalties of length_penalty_divisor.
PENALTIES = ("gnmt", "hf")


def gather_rows(state: Any, rows: jax.Array) -> Any:
    """``state`` with every leaf's rows reordered: ``leaf[rows]``.

    The reorder :func:`beam_search` uses when ``step_fn`` brings none of its
    own (it copies every leaf whole).

    Args:
        state: pytree whose every leaf has leading axis ``M``.
        rows: ``int32 [M]``, the row each new row copies.

    Examples:
        >>> import jax.numpy as jnp
        >>> gather_rows({"prev": jnp.array([5, 6, 7])}, jnp.array([2, 2, 0]))
        {'prev': Array([7, 7, 5], dtype=int32)}
    """
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), state)


def _reorder(step_fn: StepFn, state: Any, rows: jax.Array) -> Any:
    """``step_fn.reorder(state, rows)`` if ``step_fn`` has one, else
    :func:`gather_rows`."""
    return getattr(step_fn, "reorder", gather_rows)(state, rows)


def _trim(step_fn: StepFn, state: Any, num_steps: int) -> Any:
    """``step_fn.trim(state, num_steps)`` if ``step_fn`` has one, else ``state``."""
    trim = getattr(step_fn, "trim", None)
    return state if trim is None else trim(state, num_steps)


def length_penalty_divisor(
    length: jax.typing.ArrayLike, alpha: jax.typing.ArrayLike, penalty: str = "gnmt"
) -> jax.Array:
    r"""The divisor of a hypothesis's summed log-probs in beam search.

    .. math::
        \mathrm{gnmt}: \left(\frac{5 + L}{6}\right)^\alpha, \qquad
        \mathrm{hf}: L^\alpha

    ``L`` counts generated tokens, EOS included. Both are positive and
    monotone in ``L`` (increasing for ``alpha > 0``); ``alpha = 0`` gives 1.

    Args:
        length: ``L >= 1``, any shape.
        alpha: the exponent (``length_penalty`` of :func:`beam_search`).
        penalty: ``"gnmt"`` (Wu et al.; T5X, Flax WMT) or ``"hf"`` (Hugging
            Face).

    Returns:
        float32 array of ``length``'s shape.

    Examples:
        >>> length_penalty_divisor(7, 0.6), length_penalty_divisor(7, 0.6, "hf")
        (Array(1.51572, dtype=float32), Array(3.21410, dtype=float32))

    References:
        Wu et al., `Google's Neural Machine Translation System
        <https://arxiv.org/abs/1609.08144>`_, 2016.
    """
    _checks.check_choice("penalty", penalty, PENALTIES)
    length = jnp.asarray(length, jnp.float32)
    base = (5.0 + length) / 6.0 if penalty == "gnmt" else length
    return base ** jnp.asarray(alpha, jnp.float32)


class BeamState(NamedTuple):
    """The carry of :func:`beam_search`'s while loop.

    ``B`` prompts, ``K = num_beams``, ``n = num_return_sequences``,
    ``N = max_new_tokens``, ``V`` tokens; beam ``k`` of prompt ``b`` is row
    ``b * K + k`` of the flat arrays.

    Attributes:
        step: ``int32 []``, tokens generated so far by every live beam.
        logits: ``float32 [B*K, V]``, each live beam's next-token logits.
        model_state: ``step_fn``'s state, every leaf ``[B*K, ...]``.
        live_tokens: ``int32 [B, K, N]``, the live beams (not ended by EOS);
            ``pad_id`` from ``step`` on.
        live_log_probs: ``float32 [B, K]``, each live beam's summed log-probs;
            ``-inf`` for an empty beam.
        live_token_log_probs: ``float32 [B, K, N]``, the raw log-prob of each
            token of ``live_tokens``; 0 from ``step`` on.
        finished_tokens: ``int32 [B, n, N]``, the best ended hypotheses so
            far, best first; ``pad_id`` after each one's end.
        finished_scores: ``float32 [B, n]``, their scores; ``-inf`` for an
            empty slot.
        finished_lengths: ``int32 [B, n]``, their lengths; 0 for an empty slot.
        finished_log_probs: ``float32 [B, n, N]``, the raw log-prob of each of
            their tokens; 0 after each one's end.
    """

    step: jax.Array
    logits: jax.Array
    model_state: Any
    live_tokens: jax.Array
    live_log_probs: jax.Array
    live_token_log_probs: jax.Array
    finished_tokens: jax.Array
    finished_scores: jax.Array
    finished_lengths: jax.Array
    finished_log_probs: jax.Array


class BeamResult(NamedTuple):
    """What :func:`beam_search` returns, best hypothesis first.

    ``B`` prompts, ``n = num_return_sequences``, ``N = max_new_tokens``.

    Attributes:
        tokens: ``int32 [B, n, N]``; ``pad_id`` after each hypothesis's end.
        scores: ``float32 [B, n]``: summed log-probs over the length penalty;
            ``-inf`` for a missing hypothesis.
        lengths: ``int32 [B, n]``, generated tokens, EOS included; 0 for a
            missing hypothesis.
        log_probs: ``float32 [B, n, N]``, each token's raw model log-prob
            ``log_softmax(logits)[token]``; 0 after the end. Along a
            hypothesis they sum to its score times the length penalty.
    """

    tokens: jax.Array
    scores: jax.Array
    lengths: jax.Array
    log_probs: jax.Array


def beam_generation(
    result: BeamResult, eos_id: int | Sequence[int] | set[int] | None = None
) -> Generation:
    """Beam search's hypotheses as :func:`~lmhead.decoding.generate`'s
    :class:`~lmhead.decoding.Generation`: row ``b * n + k`` is hypothesis
    ``k`` (best first) of prompt ``b``, so that a text layer reads both
    decoders' rows alike.

    A row's finish reason is :data:`FINISHED_EOS` where its last token is
    one of ``eos_id``, :data:`FINISHED_LENGTH` where it has ``N`` tokens,
    and :data:`FINISHED_BAD_LOGITS` otherwise (a hypothesis that ended
    early without EOS, or a missing one: beam search ends a beam there when
    its logits are not finite). ``log_probs`` are the raw model log-probs of
    :class:`BeamResult`; there are no top log-probs (``k = 0``).

    Args:
        result: a :class:`BeamResult`, ``[B, n, N]``.
        eos_id: the ``eos_id`` the search was given (None, an id or ids).

    Returns:
        A :class:`~lmhead.decoding.Generation` of ``B * n`` rows.

    Examples:
        >>> result = BeamResult(
        ...     tokens=jnp.array([[[2, 1, 0], [2, 2, 2]]]), scores=jnp.zeros([1, 2]),
        ...     lengths=jnp.array([[2, 3]]), log_probs=jnp.zeros([1, 2, 3]))
        >>> out = beam_generation(result, eos_id=1)
        >>> out.tokens.shape, out.lengths, out.finish_reasons  # EOS, length
        ((2, 3), Array([2, 3], dtype=int32), Array([1, 0], dtype=int32))
    """
    batch, n, width = jnp.shape(result.tokens)
    rows = lambda x: jnp.reshape(x, (batch * n, *jnp.shape(x)[2:]))
    tokens = rows(jnp.asarray(result.tokens, jnp.int32))
    lengths = rows(jnp.asarray(result.lengths, jnp.int32))
    last = jnp.take_along_axis(tokens, jnp.maximum(lengths - 1, 0)[:, None], axis=1)
    ended = jnp.zeros(jnp.shape(lengths), bool)
    if eos_id is not None:
        ids = [eos_id] if isinstance(eos_id, (int, np.integer)) else sorted(eos_id)
        ended = (lengths > 0) & jnp.isin(last[:, 0], jnp.asarray(ids, jnp.int32))
    reasons = jnp.where(lengths == width, FINISHED_LENGTH, FINISHED_BAD_LOGITS)
    return Generation(
        tokens=tokens,
        log_probs=rows(jnp.asarray(result.log_probs, jnp.float32)),
        lengths=lengths,
        finish_reasons=jnp.where(ended, FINISHED_EOS, reasons).astype(jnp.int32),
        top_tokens=jnp.zeros((batch * n, width, 0), jnp.int32),
        top_log_probs=jnp.zeros((batch * n, width, 0), jnp.float32),
    )


class _BeamConfig(NamedTuple):
    """Static (hashable) settings of :func:`beam_search`."""

    num_beams: int
    num_return_sequences: int
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    penalty: str


def _append_to_parents(
    sequences: jax.Array, beam: jax.Array, value: jax.Array, step: jax.Array
) -> jax.Array:
    """``sequences[b, beam[b, m]]`` with ``value[b, m]`` written at ``step``."""
    picked = jnp.take_along_axis(sequences, beam[..., None], axis=1)
    return picked.at[:, :, step].set(value)


def _beam_continues(s: BeamState, alpha: jax.Array, config: _BeamConfig) -> jax.Array:
    """False once no live beam can still enter the finished n-best: its best
    score ``S / max(d(l + 1), d(N))`` (``S <= 0``, ``d`` monotone) is not above
    the worst kept one; an exact bound (``docs/decoding.md``)."""
    num_new = config.max_new_tokens
    divisor = jnp.maximum(
        length_penalty_divisor(s.step + 1, alpha, config.penalty),
        length_penalty_divisor(num_new, alpha, config.penalty),
    )
    best_possible = jnp.max(s.live_log_probs, axis=-1) / divisor
    can_improve = best_possible > s.finished_scores[:, -1]
    return (s.step < num_new) & jnp.any(can_improve)


def _keep_best_finished(
    s: BeamState,
    scores: jax.Array,
    token_log_probs: jax.Array,
    length: jax.Array,
    pad_id: int,
) -> dict[str, jax.Array]:
    """Merges hypotheses ending now (``scores [B, K*V]``, -inf if not; their
    last token's log-prob ``token_log_probs [B, K*V]``) into the n-best."""
    num_kept = s.finished_scores.shape[1]
    vocab_size = s.logits.shape[-1]
    # Kept hypotheses come first, so on a tie lax.top_k prefers the older one.
    best_scores, best = jax.lax.top_k(
        jnp.concatenate([s.finished_scores, scores], axis=1), num_kept
    )
    was_kept = best < num_kept
    old = jnp.minimum(best, num_kept - 1)
    new = jnp.maximum(best - num_kept, 0)
    parent = new // vocab_size
    tokens = jnp.where(
        was_kept[..., None],
        jnp.take_along_axis(s.finished_tokens, old[..., None], axis=1),
        _append_to_parents(s.live_tokens, parent, new % vocab_size, s.step),
    )
    log_probs = jnp.where(
        was_kept[..., None],
        jnp.take_along_axis(s.finished_log_probs, old[..., None], axis=1),
        _append_to_parents(
            s.live_token_log_probs,
            parent,
            jnp.take_along_axis(token_log_probs, new, axis=1),
            s.step,
        ),
    )
    lengths = jnp.where(
        was_kept, jnp.take_along_axis(s.finished_lengths, old, axis=1), length
    )
    empty = best_scores == NEG_INF
    return dict(
        finished_tokens=jnp.where(empty[..., None], pad_id, tokens),
        finished_scores=best_scores,
        finished_lengths=jnp.where(empty, 0, lengths),
        finished_log_probs=jnp.where(empty[..., None], 0.0, log_probs),
    )


def _beam_step(
    s: BeamState, *, step_fn: StepFn, params: Any, alpha: jax.Array, config: _BeamConfig
) -> BeamState:
    batch, num_beams, _ = s.live_tokens.shape
    vocab_size = s.logits.shape[-1]
    length = s.step + 1
    # A beam whose logits cannot be decoded has no continuation.
    token_log_probs = jnp.where(
        _loop.not_finite(s.logits)[:, None],
        NEG_INF,
        jax.nn.log_softmax(s.logits, axis=-1),
    ).reshape(batch, -1)
    totals = s.live_log_probs[..., None] + token_log_probs.reshape(
        batch, num_beams, vocab_size
    )
    is_eos = _loop.is_eos(jnp.arange(vocab_size), config.eos_ids)
    # Every candidate ends at the last step, with or without EOS.
    ends_now = is_eos | (length == config.max_new_tokens)
    ending_scores = jnp.where(
        ends_now,
        totals / length_penalty_divisor(length, alpha, config.penalty),
        NEG_INF,
    )
    finished = _keep_best_finished(
        s, ending_scores.reshape(batch, -1), token_log_probs, length, config.pad_id
    )
    live_log_probs, best = jax.lax.top_k(
        jnp.where(is_eos, NEG_INF, totals).reshape(batch, -1), num_beams
    )
    beam, token = best // vocab_size, best % vocab_size
    new = s._replace(
        step=length,
        live_log_probs=live_log_probs,
        live_tokens=_append_to_parents(s.live_tokens, beam, token, s.step),
        live_token_log_probs=_append_to_parents(
            s.live_token_log_probs,
            beam,
            jnp.take_along_axis(token_log_probs, best, axis=1),
            s.step,
        ),
        **finished,
    )
    rows = (jnp.arange(batch)[:, None] * num_beams + beam).reshape(-1)
    model_state = _reorder(step_fn, s.model_state, rows)
    logits, model_state, _ = _loop.maybe_step(
        step_fn,
        params,
        _beam_continues(new, alpha, config),
        token.reshape(-1),
        s.logits,
        model_state,
    )
    return new._replace(logits=logits, model_state=model_state)


@functools.partial(jax.jit, static_argnames=("step_fn", "config"))
def _beam_loop(
    step_fn: StepFn,
    params: Any,
    logits: jax.Array,
    model_state: Any,
    alpha: jax.Array,
    config: _BeamConfig,
):
    batch = logits.shape[0]
    beams, kept, num_new = (
        config.num_beams,
        config.num_return_sequences,
        config.max_new_tokens,
    )
    # The identity reorder first: a state may change its structure once there
    # (a model's cache adds its slot pointers), never inside the loop.
    # All beams start as the same empty hypothesis; only one may expand.
    first_only = jnp.where(jnp.arange(beams) == 0, 0.0, NEG_INF)
    init = BeamState(
        step=jnp.zeros((), jnp.int32),
        logits=jnp.repeat(logits, beams, axis=0),
        model_state=_loop.repeat_rows(
            step_fn, _reorder(step_fn, model_state, jnp.arange(batch)), beams
        ),
        live_tokens=jnp.full((batch, beams, num_new), config.pad_id, jnp.int32),
        live_log_probs=jnp.broadcast_to(first_only, (batch, beams)),
        live_token_log_probs=jnp.zeros((batch, beams, num_new), jnp.float32),
        finished_tokens=jnp.full((batch, kept, num_new), config.pad_id, jnp.int32),
        finished_scores=jnp.full((batch, kept), NEG_INF, jnp.float32),
        finished_lengths=jnp.zeros((batch, kept), jnp.int32),
        finished_log_probs=jnp.zeros((batch, kept, num_new), jnp.float32),
    )
    final = jax.lax.while_loop(
        lambda s: _beam_continues(s, alpha, config),
        lambda s: _beam_step(
            s, step_fn=step_fn, params=params, alpha=alpha, config=config
        ),
        init,
    )
    return BeamResult(
        tokens=final.finished_tokens,
        scores=final.finished_scores,
        lengths=final.finished_lengths,
        log_probs=final.finished_log_probs,
    )


def beam_search(
    step_fn: StepFn,
    params: Any,
    logits: jax.typing.ArrayLike,
    state: Any,
    *,
    num_beams: int,
    max_new_tokens: int,
    eos_id: int | Sequence[int] | set[int] | None,
    length_penalty: jax.typing.ArrayLike = 0.6,
    penalty: str = "gnmt",
    num_return_sequences: int = 1,
    pad_id: int = 0,
    knobs: SamplingKnobs | None = None,
) -> BeamResult:
    r"""Beam search for the n best continuations under a length penalty.

    A hypothesis :math:`y_{1..L}` ends with EOS or at ``L = N``; its score is

    .. math::
        s(y) = \frac{\sum_{t=1}^{L} \log p(y_t \mid y_{<t})}{d(L)}

    with ``d`` from :func:`length_penalty_divisor` (``L`` counts EOS). Each
    step extends the ``K`` live beams by every token, moves the candidates
    that end (EOS, or any token at step ``N``) into a separate n-best store,
    and keeps the ``K`` best other candidates by summed log-probs as the new
    live beams, ``step_fn``'s state reordered to their parent rows. It stops
    early only when no live beam can still enter the n-best (an exact bound),
    so with ``K >= V ** (N - 1)`` the result is the exact n-best over all
    sequences. Scores use the model's raw log-probs: no sampling knob
    applies. A beam whose model logits are not finite ends there with no
    continuation; a prompt left with no hypothesis has only missing ones.

    Static arguments: ``step_fn`` (by hash), ``num_beams``, ``max_new_tokens``,
    ``eos_id`` (as a set of ids), ``penalty``, ``num_return_sequences``,
    ``pad_id`` and the shapes; ``params`` and ``length_penalty`` are traced.

    Args:
        step_fn: ``step_fn(params, tokens int32[M], state) -> (logits [M, V],
            state)`` for any number of rows ``M``; hashable; may have
            ``reorder(state, rows int32[M])`` (else :func:`gather_rows`),
            ``repeat(state, repeats)`` and ``trim(state, num_steps)``, called
            first with ``N - 1``, the calls the search makes (a cache drops
            the room they cannot reach). A step that splits the rows over a
            mesh makes each device search its own prompts
            (``decoding/split.py``) when the devices divide ``B``.
        params: any pytree, passed to every ``step_fn`` call (traced).
        logits: ``[B, V]`` next-token logits after each prompt.
        state: pytree whose every leaf has leading axis ``B``; repeated to
            ``B * num_beams`` rows.
        num_beams: ``K >= 1``.
        max_new_tokens: ``N >= 1``.
        eos_id: None, an id in ``[0, V)`` that ends a hypothesis, or a
            sequence or set of such ids, any of which ends one.
        length_penalty: the exponent ``alpha`` (0: plain log-prob sums).
        penalty: ``"gnmt"`` or ``"hf"``.
        num_return_sequences: ``1 <= n <= K`` hypotheses returned per prompt.
        pad_id: id written after a hypothesis's end.
        knobs: None, or a :class:`~lmhead.decoding.knobs.SamplingKnobs`
            whose :meth:`~lmhead.decoding.knobs.SamplingKnobs.active` is
            empty, e.g. the knobs of a request that sets none.

    Returns:
        A :class:`BeamResult`: ``tokens int32 [B, n, N]``, ``scores float32
        [B, n]``, ``lengths int32 [B, n]`` and each token's raw log-prob
        ``log_probs float32 [B, n, N]``, best first. If fewer than ``n``
        hypotheses exist (tiny ``V`` and ``N``), the missing ones have score
        ``-inf`` and length 0.

    Examples:
        >>> import jax.numpy as jnp
        >>> table = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.2, 0.1, 0.7],
        ...                            [0.5, 0.3, 0.2]]))
        >>> markov = lambda table, tokens, state: (table[tokens], state)
        >>> tokens, scores, lengths, log_probs = beam_search(
        ...     markov, table, table[jnp.array([1])], (), num_beams=3,
        ...     max_new_tokens=3, eos_id=0, length_penalty=0.0,
        ...     num_return_sequences=2, pad_id=-1)
        >>> tokens
        Array([[[ 2,  0, -1],
                [ 0, -1, -1]]], dtype=int32)
        >>> scores.round(4).tolist(), lengths.tolist()  # log(0.7 * 0.5), log 0.2
        ([[-1.0498, -1.6094]], [[2, 1]])
        >>> log_probs.round(4).tolist()  # log 0.7, log 0.5; log 0.2
        [[[-0.3567, -0.6931, 0.0], [-1.6094, 0.0, 0.0]]]

    References:
        Wu et al., `Google's Neural Machine Translation System
        <https://arxiv.org/abs/1609.08144>`_, 2016.
    """
    logits, _, vocab_size = _loop.check_call(step_fn, logits, state)
    _checks.check_count("num_beams", num_beams)
    _checks.check_count("max_new_tokens", max_new_tokens)
    _checks.check_count("num_return_sequences", num_return_sequences)
    if num_return_sequences > num_beams:
        raise ValueError(
            f"num_return_sequences must be <= num_beams = "
            f"{num_beams}; got {num_return_sequences}."
        )
    _checks.check_choice("penalty", penalty, PENALTIES)
    eos_ids = _loop.eos_ids(eos_id, vocab_size)
    if not _checks.is_traced(length_penalty) and not np.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be finite; got {length_penalty}.")
    active = SamplingKnobs.of(knobs).active()
    if active:
        raise ValueError(
            f"{active[0]} does not apply to beam search, which ranks "
            "hypotheses by the model's raw log-probs; leave it off."
        )
    config = _BeamConfig(
        num_beams=int(num_beams),
        num_return_sequences=int(num_return_sequences),
        max_new_tokens=int(max_new_tokens),
        eos_ids=eos_ids,
        pad_id=int(pad_id),
        penalty=penalty,
    )
    state = _trim(step_fn, state, config.max_new_tokens - 1)
    alpha = jnp.asarray(length_penalty, jnp.float32)
    mesh = split.rows_mesh(step_fn, logits.shape[0])
    if mesh is None:
        return _beam_loop(step_fn, params, logits, state, alpha, config)
    loop = _split_beam_loop(step_fn.per_device(), mesh, config)
    return loop(params, logits, state, alpha)


@functools.lru_cache(maxsize=64)
def _split_beam_loop(step_fn: StepFn, mesh: Any, config: _BeamConfig):
    """``_beam_loop`` run by each device of ``mesh`` on its own prompts."""
    rows = jax.sharding.PartitionSpec(mesh.axis_names[0])
    whole = jax.sharding.PartitionSpec()
    local = lambda params, logits, state, alpha: _beam_loop(
        step_fn, params, logits, state, alpha, config
    )
    return jax.jit(split.split_rows(local, mesh, (whole, rows, rows, whole)))
