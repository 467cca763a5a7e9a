r"""Speculative decoding: proposals checked by the one decoding step.

A *proposer* (:class:`Proposer`: the run's MTP heads,
``lmhead.lm.inference.MTPProposer``; n-gram lookup in the prompt and the text so
far, :class:`NGramProposer`) guesses the ``k`` tokens after the one a row
has just chosen. One speculative step (:func:`speculative_step`) is:

1. :func:`~lmhead.decoding.step.decode_step` on the row's carried logits,
   less the draft rejected there (the residual), which emits :math:`y_0`;
2. the proposals :math:`d_1 \dots d_k` after it;
3. one model call on :math:`[y_0, d_1, \dots, d_k]` (``step_fn.verify``):
   the logits after each, :math:`z_1 \dots z_{k+1}`;
4. ``decode_step`` again at :math:`z_j` with ``draft`` :math:`d_j`, for
   :math:`j = 1 \dots k` while the row's drafts are accepted
   (:func:`~lmhead.decoding.step.accepts_draft`: greedy keeps the argmax,
   sampling Leviathan/Chen's rule), every processor, the hook, the
   stops, the log-probs and the counts updated token by token as plain
   decoding does;
5. the model state keeps the accepted positions (``step_fn.rewind``), and
   the row carries :math:`z_{a+1}` after its :math:`a` accepted drafts,
   with :math:`d_{a+1}` as the token its next draw leaves out if it was
   rejected.

So greedy speculation emits plain greedy's tokens, and sampling draws each
token from plain decoding's distribution, whatever the proposals. A row
emits ``1 + a`` tokens per model call. The tests of step 4 end at the
first depth where every row has rejected, stopped or run out of drafts:
when no row has a proposal the call feeds :math:`y_0` alone (``step_fn``
itself) and tests nothing. The one key leaves the call split as all ``k``
tests would split it. Rows with a grammar constraint are not speculated:
they get no proposals (checking proposals against the automaton would
advance and roll back the host's automaton per draft). Beam search is not
speculated. docs/decoding.md, "Speculative decoding", has the design and
the measurements.
"""

import dataclasses
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from lmhead import _checks
from lmhead.decoding.processors import NO_TOKEN
from lmhead.decoding.step import (
    ProcessorContext,
    StepOutput,
    advance_constraint,
    decode_step,
    is_running,
    key_after_steps,
)
from lmhead.head import NEG_INF


class ProposalContext(NamedTuple):
    """What a proposer sees (``B`` rows, ``H`` history slots).

    Attributes:
        last: ``int32 [B]``, each row's token just chosen, not yet fed to
            the model (``pad_id`` where the row chose none).
        emitted: ``bool [B]``, whether the row chose one.
        history: ``int32 [B, H]``, the prompt and the generated tokens up to
            ``last``, latest last, ``NO_TOKEN`` on the left; None unless the
            proposer ``reads_history``.
    """

    last: jax.Array
    emitted: jax.Array
    history: jax.Array | None


@runtime_checkable
class Proposer(Protocol):
    """A source of proposals: ``num_tokens`` (``k``), ``reads_history``, and
    ``propose(params, state, context) -> (drafts int32 [B, k], state)``
    (``NO_TOKEN`` where it has none; a row's proposals after its first
    ``NO_TOKEN`` are ignored). ``state`` is the model's (a proposer from the
    model's own heads may read and write it); hashable, as it is static."""

    num_tokens: int
    reads_history: bool

    def propose(self, params: Any, state: Any, context: ProposalContext) -> tuple: ...


class SpeculationStats(NamedTuple):
    """What speculation did (``B`` rows, ``k`` proposals per call).

    Attributes:
        calls: ``int32 [B]``, the model calls in which each row was running
            (each emitted ``1 +`` its accepted drafts).
        tested: ``int32 [k]``, drafts ``j`` tested, over the rows.
        accepted: ``int32 [k]``, drafts ``j`` accepted: ``accepted / tested``
            is depth ``j``'s acceptance rate given the drafts before it.
    """

    calls: jax.Array
    tested: jax.Array
    accepted: jax.Array

    @staticmethod
    def empty(batch: int, num_tokens: int) -> "SpeculationStats":
        zeros = jnp.zeros((num_tokens,), jnp.int32)
        return SpeculationStats(jnp.zeros((batch,), jnp.int32), zeros, zeros)


@dataclasses.dataclass(frozen=True)
class NGramProposer:
    r"""Prompt-lookup (n-gram) proposals: the tokens that followed the
    latest earlier occurrence of the row's last ``n`` tokens, in the prompt
    and the text so far, for the longest ``n`` in ``[min_ngram,
    max_ngram]`` that occurs, read on as a copy (where they reach the
    text's end, the copy repeats: an occurrence ``p`` tokens back proposes
    period ``p``). Hugging Face's ``prompt_lookup_num_tokens`` and vLLM's
    ``ngram`` speculator take the earliest occurrence and stop at the text's
    end; the latest follows the text's most recent turn. No parameters, any
    model.

    Attributes:
        num_tokens: ``k >= 1``, the tokens proposed per call.
        max_ngram, min_ngram: ``1 <= min_ngram <= max_ngram``.

    Examples:
        >>> history = jnp.array([[-1, 5, 6, 7, 8, 5, 6]])
        >>> context = ProposalContext(jnp.array([6]), jnp.array([True]), history)
        >>> NGramProposer(3).propose(None, (), context)[0]
        Array([[7, 8, 5]], dtype=int32)
        >>> repeated = ProposalContext(jnp.array([2]), jnp.array([True]),
        ...                            jnp.array([[-1, -1, 1, 2, 1, 2]]))
        >>> NGramProposer(3).propose(None, (), repeated)[0]  # period 2
        Array([[1, 2, 1]], dtype=int32)
    """

    num_tokens: int
    max_ngram: int = 3
    min_ngram: int = 1
    reads_history = True

    def __post_init__(self):
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            _checks.check_count(name, getattr(self, name))
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"min_ngram must be at most max_ngram; got {self.min_ngram} > "
                f"{self.max_ngram}."
            )

    def propose(self, params: Any, state: Any, context: ProposalContext) -> tuple:
        del params
        history = context.history
        batch, width = history.shape
        ends = jnp.arange(width - 1)  # where an earlier occurrence may end
        drafts = jnp.full((batch, self.num_tokens), NO_TOKEN, jnp.int32)
        found = jnp.zeros((batch,), bool)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n >= width:
                continue
            suffix_real = jnp.all(history[:, width - n :] >= 0, axis=1)
            match = jnp.ones((batch, width - 1), bool)
            for i in range(n):
                # history[:, e - i] == history[:, width - 1 - i], e - i >= 0
                shifted = jnp.pad(history, ((0, 0), (i, 0)), constant_values=NO_TOKEN)
                match &= shifted[:, : width - 1] == history[:, width - 1 - i, None]
            match &= (ends >= n - 1) & suffix_real[:, None]
            latest = jnp.max(jnp.where(match, ends, -1), axis=1)
            # What followed the match, read on as a copy: past the text's end
            # it repeats with the period width - 1 - latest.
            period = jnp.maximum(width - 1 - latest, 1)[:, None]
            at = latest[:, None] + 1 + jnp.arange(self.num_tokens) % period
            following = jnp.take_along_axis(history, jnp.clip(at, 0, width - 1), 1)
            use = (latest >= 0) & ~found
            drafts = jnp.where(use[:, None], following, drafts)
            found |= latest >= 0
        return drafts, state


def check_speculation(proposer: Any, step_fn: Any, state: Any) -> None:
    """Raises unless ``proposer`` is a :class:`Proposer` and ``step_fn`` can
    verify it: ``verify`` and ``rewind`` (a model whose state holds
    positions), or a state with no arrays (then ``step_fn`` is called once per
    fed token)."""
    if not isinstance(proposer, Proposer):
        raise TypeError(
            "speculative must be a Proposer (num_tokens, reads_history, "
            f"propose); got {type(proposer).__name__}."
        )
    _checks.check_count("num_speculative_tokens", proposer.num_tokens)
    try:
        hash(proposer)
    except TypeError as error:
        raise TypeError(
            f"speculative must be hashable (it is static in the compiled loop); {error}."
        ) from None
    can_rewind = hasattr(step_fn, "verify") and hasattr(step_fn, "rewind")
    if not can_rewind and jax.tree.leaves(state):
        raise ValueError(
            "speculative decoding needs a step_fn with verify(params, tokens [B, T], "
            "state) and rewind(state, num_positions [B]), or a state with no "
            "arrays; this step_fn has neither."
        )


def _verify(step_fn, params, tokens, state):
    """``step_fn.verify``, or a stateless step fed one token at a time."""
    verify = getattr(step_fn, "verify", None)
    if verify is not None:
        logits, state = verify(params, tokens, state)
        return jnp.asarray(logits, jnp.float32), state
    columns = []
    for j in range(tokens.shape[1]):
        logits, state = step_fn(params, tokens[:, j], state)
        columns.append(jnp.asarray(logits, jnp.float32))
    return jnp.stack(columns, axis=1), state


def _rewind(step_fn, state, num_positions):
    rewind = getattr(step_fn, "rewind", None)
    return state if rewind is None else rewind(state, num_positions)


def write_columns(s: Any, out: StepOutput, at: jax.Array) -> Any:
    """The loop state ``s`` with ``out`` written at column ``at[b]`` of each
    row that emitted (or met non-finite logits); the others keep theirs."""
    columns = jnp.where(out.emitted | out.bad, at, s.tokens.shape[1])
    rows = jnp.arange(at.shape[0])

    def put(whole, value):
        return whole.at[rows, columns].set(value, mode="drop")

    return s._replace(
        tokens=put(s.tokens, out.tokens),
        log_probs=put(s.log_probs, jnp.where(out.bad, NEG_INF, out.log_probs)),
        top_tokens=put(s.top_tokens, out.top_tokens),
        top_log_probs=put(s.top_log_probs, out.top_log_probs),
    )


class _DraftTests(NamedTuple):
    """The carry of :func:`speculate`'s draft tests: the ``depth`` to test
    next, the ``rows`` and ``sink`` after the ones before it, each row's
    ``rejected`` draft and ``accepted`` count, whether it is ``in_block``
    (every draft so far accepted), the steps' outputs ``outs`` (leaves
    ``[k, B, ...]``) and the tests and acceptances per depth (``[k]``)."""

    depth: jax.Array
    rows: Any
    sink: Any
    rejected: jax.Array
    accepted: jax.Array
    in_block: jax.Array
    outs: StepOutput
    tested_at: jax.Array
    accepted_at: jax.Array


class Speculation(NamedTuple):
    """The static parts of a speculative step besides the knobs.

    Attributes:
        proposer: the :class:`Proposer`.
        step: the :class:`~lmhead.decoding.step.StepConfig`.
        reset_rows: whether the rows that emit nothing have their model state
            emptied before the call (``step_fn.reset_rows``: continuous
            batching's free slots).
    """

    proposer: Any
    step: Any
    reset_rows: bool = False


def speculate(
    rows: Any,
    model_state: Any,
    rejected: jax.Array,
    sink: Any,
    *,
    step_fn: Any,
    params: Any,
    knobs: Any,
    stop: tuple,
    spec: Speculation,
    emit: Any,
    context: Any = None,
) -> tuple:
    """One speculative step (the module's steps 1-5) of the rows'
    :class:`~lmhead.decoding.step.DecodeRows`.

    Args:
        rows, model_state: the rows and ``step_fn``'s state.
        rejected: ``int32 [B]``, each row's draft rejected at its logits.
        sink: the caller's record of the outputs: ``emit(sink, out, at)``
            returns it with ``out`` (a :class:`StepOutput`) emitted at
            position ``at: int32 [B]`` of each row; called after the first
            step and after each draft test in order, the tests inside a
            ``lax.while_loop``, so it returns a sink of the same structure,
            shapes and dtypes (the outputs also come back stacked: ``outs``
            below). The tests end at the first depth where no row has a
            draft left to test (each row rejected, stopped or without
            drafts; at depth 0 when no row has a draft): the steps after it,
            which would emit nothing, are skipped, neither ``emit`` nor
            ``context`` called for them, nor the stop conditions' ``update``.
        context: None, or ``context(sink, rows)``: the hook's
            :class:`ProcessorContext` of the rows about to step.

    Returns:
        ``(rows, model_state, rejected, sink, outs, tested [k], accepted
        [k])``: ``outs`` the ``k + 1`` steps' :class:`StepOutput`, stacked
        (leaves ``[k + 1, B, ...]``; the depths left untested emit
        nothing), and the draft tests and acceptances at each depth, over
        the rows.
    """
    proposer, config = spec.proposer, spec.step
    k, batch = proposer.num_tokens, rejected.shape[0]
    context = context or (lambda sink, rows: None)
    decoded, out = decode_step(
        rows, knobs, stop, config, step=rows.generated,
        context=context(sink, rows), rejected=rejected,
    )  # fmt: skip
    sink = emit(sink, out, rows.generated)
    decoded = advance_constraint(decoded, out)
    if spec.reset_rows:  # a free slot's next position is its cache's first
        model_state = step_fn.reset_rows(model_state, ~out.emitted)
    drafts, model_state = proposer.propose(
        params,
        model_state,
        ProposalContext(
            out.tokens, out.emitted, decoded.history if proposer.reads_history else None
        ),
    )
    speculated = out.emitted & is_running(decoded)
    if decoded.constraint is not None:  # constrained rows are not speculated
        speculated &= decoded.constraint.ids < 0
    drafts = jnp.where(speculated[:, None], drafts, NO_TOKEN)
    fed_tokens = jnp.concatenate(
        [out.tokens[:, None], jnp.where(drafts >= 0, drafts, config.pad_id)], 1
    )
    logits, model_state, fed = _model_call(
        step_fn, params, fed_tokens, rows.logits, model_state,
        jnp.any(is_running(decoded)), jnp.any(drafts >= 0),
    )  # fmt: skip

    def test_draft(t: _DraftTests) -> _DraftTests:
        """Depth ``t.depth`` of the block: its drafts tested at the logits
        after them (one program for the ``k`` depths, not ``k`` copies)."""
        j = t.depth
        draft = jnp.where(t.in_block, drafts[:, j], NO_TOKEN)
        at = t.rows.generated
        rows_j, out_j = decode_step(
            t.rows._replace(logits=logits[:, j]), knobs, stop, config, step=at,
            context=context(t.sink, t.rows), draft=draft,
        )  # fmt: skip
        tested = draft >= 0
        return _DraftTests(
            depth=j + 1,
            rows=rows_j,
            sink=emit(t.sink, out_j, at),
            rejected=jnp.where(
                tested & ~out_j.emitted & is_running(rows_j), draft, t.rejected
            ),
            accepted=t.accepted + out_j.emitted.astype(jnp.int32),
            in_block=t.in_block & out_j.emitted & is_running(rows_j),
            outs=jax.tree.map(lambda whole, x: whole.at[j].set(x), t.outs, out_j),
            tested_at=t.tested_at.at[j].set(jnp.sum(tested, dtype=jnp.int32)),
            accepted_at=t.accepted_at.at[j].set(
                jnp.sum(out_j.emitted, dtype=jnp.int32)
            ),
        )

    def some_row_tests(t: _DraftTests) -> jax.Array:
        """Whether some row has a draft to test at depth ``t.depth``: the
        tests end at the first depth where every row has rejected, stopped or
        run out of drafts (the depths after it would emit nothing)."""
        at_depth = drafts[:, jnp.minimum(t.depth, k - 1)]
        return (t.depth < k) & jnp.any(t.in_block & (at_depth >= 0))

    # What a depth that tests no draft leaves in ``outs``: nothing emitted.
    untested = jax.tree.map(lambda x: jnp.zeros((k,) + x.shape, x.dtype), out)
    untested = untested._replace(
        tokens=jnp.full((k,) + out.tokens.shape, config.pad_id, jnp.int32),
        top_tokens=jnp.full((k,) + out.top_tokens.shape, config.pad_id, jnp.int32),
    )
    zeros = jnp.zeros((k,), jnp.int32)
    t = jax.lax.while_loop(
        some_row_tests,
        test_draft,
        _DraftTests(
            depth=jnp.int32(0), rows=decoded, sink=sink,
            rejected=jnp.full((batch,), NO_TOKEN, jnp.int32),
            accepted=jnp.zeros((batch,), jnp.int32), in_block=speculated,
            outs=untested, tested_at=zeros, accepted_at=zeros,
        ),
    )  # fmt: skip
    outs = jax.tree.map(
        lambda first, rest: jnp.concatenate([first[None], rest]), out, t.outs
    )
    kept = jnp.minimum(jnp.where(out.emitted, 1 + t.accepted, 0), fed)
    model_state = _rewind(step_fn, model_state, fed - kept)
    carried = jnp.take_along_axis(logits, t.accepted[:, None, None], axis=1)[:, 0]
    decoded = t.rows._replace(
        logits=jnp.where(out.emitted[:, None], carried, rows.logits),
        # The call leaves the one key split as k tests split it, wherever the
        # tests ended (the depths left untested would have split it too):
        # the draws after the call do not depend on it.
        key=key_after_steps(decoded.key, knobs.temperature, k),
    )
    return decoded, model_state, t.rejected, t.sink, outs, t.tested_at, t.accepted_at


def speculative_step(
    s: Any,
    *,
    step_fn: Any,
    params: Any,
    knobs: Any,
    stop: tuple,
    rows: Any,
    config: Any,
) -> Any:
    """One step of ``generate``'s loop with speculation (:func:`speculate`):
    ``s`` is its ``SamplingState`` with ``rejected`` and ``speculation``,
    ``config.proposer`` the :class:`Proposer`; the hook's context has each
    row's own ``step`` (``[B]``: rows advance apart)."""

    def context(s, decoded):
        if config.step.processor is None:
            return None
        generated = decoded.generated
        return ProcessorContext(generated, s.tokens, generated, rows.prompt_lengths)

    started = is_running(s.rows)
    decoded, model_state, rejected, s, _, tested, accepted = speculate(
        s.rows, s.model_state, s.rejected, s, step_fn=step_fn, params=params,
        knobs=knobs, stop=stop, spec=Speculation(config.proposer, config.step),
        emit=write_columns, context=context,
    )  # fmt: skip
    stats = s.speculation
    return s._replace(
        step=s.step + 1,
        rows=decoded,
        model_state=model_state,
        rejected=rejected,
        speculation=SpeculationStats(
            stats.calls + started.astype(jnp.int32),
            stats.tested + tested,
            stats.accepted + accepted,
        ),
    )


def _model_call(step_fn, params, fed_tokens, logits, state, any_running, any_draft):
    """``(logits [B, k + 1, V], state, positions fed)``: the verification of
    ``fed_tokens [B, k + 1]``; ``step_fn`` on the first column alone when no
    row has a draft; nothing when no row runs (a cache sized for the
    longest generation has no slot for more)."""
    batch, width = fed_tokens.shape
    wide = lambda first: (
        jnp.zeros((batch, width) + first.shape[1:], jnp.float32).at[:, 0].set(first)
    )

    def verify():
        verified, new_state = _verify(step_fn, params, fed_tokens, state)
        return verified, new_state, jnp.int32(width)

    def single():
        new_logits, new_state = step_fn(params, fed_tokens[:, 0], state)
        return wide(jnp.asarray(new_logits, jnp.float32)), new_state, jnp.int32(1)

    def nothing():
        return wide(logits), state, jnp.int32(0)

    which = jnp.where(any_running, jnp.where(any_draft, 2, 1), 0)
    return jax.lax.switch(which, [nothing, single, verify])
