"""Greedy decoding and sampling: :func:`generate`, one ``lax.while_loop``."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lmhead import _checks
from lmhead.decoding import _loop
from lmhead.decoding._loop import StepFn
from lmhead.decoding.knobs import SamplingKnobs
from lmhead.decoding.processors import NO_TOKEN, process_logits
from lmhead.head import NEG_INF


class SamplingState(NamedTuple):
    """The carry of :func:`generate`'s while loop.

    ``B`` rows (prompts times samples), ``N = max_new_tokens``, ``V`` tokens,
    ``H = P + N - 1`` history slots for a prompt of ``P`` tokens.

    Attributes:
        step: ``int32 []``, tokens generated so far by every row.
        logits: ``float32 [B, V]``, the model's logits for the next token.
        model_state: ``step_fn``'s state, every leaf ``[B, ...]``.
        key: PRNG key for the remaining steps.
        tokens: ``int32 [B, N]``, the output; ``pad_id`` after a row's end.
        log_probs: ``float32 [B, N]``, each token's log-probability under the
            processed distribution; 0 after a row's end, ``-inf`` where the
            model's logits were not finite (the row ends there).
        finished: ``bool [B]``, the row has produced EOS (or bad logits).
        lengths: ``int32 [B]``, tokens generated, EOS included.
        history: ``int32 [B, H]``, prompt then generated tokens, latest last,
            ``NO_TOKEN`` on the left; None when no processor reads it.
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


class _SamplingConfig(NamedTuple):
    """Static (hashable) settings of :func:`generate` besides the knobs'."""

    max_new_tokens: int
    eos_id: int | None
    pad_id: int


def _choose_tokens(
    key: jax.Array, processed: jax.Array, temperature: jax.Array
) -> jax.Array:
    """A draw from softmax(processed), or its argmax when ``temperature == 0``."""
    sampled = jax.random.categorical(key, processed, axis=-1)
    greedy = jnp.argmax(processed, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def _sampling_continues(s: SamplingState) -> jax.Array:
    return (s.step < s.tokens.shape[1]) & ~jnp.all(s.finished)


def _not_finite(logits: jax.Array) -> jax.Array:
    """``bool [B]``: the row has a NaN or ``+inf`` logit, or no finite one."""
    return jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1) | jnp.all(
        logits == NEG_INF, axis=-1
    )


def _sampling_step(
    s: SamplingState,
    *,
    step_fn: StepFn,
    params: Any,
    knobs: SamplingKnobs,
    config: _SamplingConfig,
) -> SamplingState:
    processed = process_logits(
        s.logits, knobs, history=s.history, num_generated=s.step, eos_id=config.eos_id
    )
    key, sample_key = jax.random.split(s.key)
    token = _choose_tokens(sample_key, processed, knobs.temperature)
    log_prob = jnp.take_along_axis(
        jax.nn.log_softmax(processed, axis=-1), token[:, None], axis=-1
    )[:, 0]
    bad = _not_finite(s.logits) & ~s.finished
    token = jnp.where(s.finished | bad, config.pad_id, token)
    log_prob = jnp.where(s.finished, 0.0, jnp.where(bad, NEG_INF, log_prob))
    finished = s.finished | bad
    if config.eos_id is not None:
        finished = finished | (token == config.eos_id)
    history = s.history
    if history is not None:
        history = jnp.concatenate([history[:, 1:], token[:, None]], axis=1)
    new = SamplingState(
        step=s.step + 1,
        logits=s.logits,
        model_state=s.model_state,
        key=key,
        tokens=s.tokens.at[:, s.step].set(token),
        log_probs=s.log_probs.at[:, s.step].set(log_prob),
        finished=finished,
        lengths=s.lengths + (~s.finished & ~bad).astype(jnp.int32),
        history=history,
    )
    logits, model_state = _loop.maybe_step(
        step_fn, params, _sampling_continues(new), token, s.logits, s.model_state
    )
    return new._replace(logits=logits, model_state=model_state)


def _run_sampling_loop(
    step_fn: StepFn,
    params: Any,
    logits: jax.Array,
    model_state: Any,
    key: jax.Array,
    history: jax.Array | None,
    knobs: SamplingKnobs,
    config: _SamplingConfig,
):
    """Tokens, log-probs, lengths, and the final model state (returned so that
    a donated state's buffers can alias it and be updated in place)."""
    batch, num_new = logits.shape[0], config.max_new_tokens
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
    )
    body = lambda s: _sampling_step(
        s, step_fn=step_fn, params=params, knobs=knobs, config=config
    )
    final = jax.lax.while_loop(_sampling_continues, body, init)
    return final.tokens, final.log_probs, final.lengths, final.model_state


_STATIC = ("step_fn", "config")
_sampling_loop = jax.jit(_run_sampling_loop, static_argnames=_STATIC)
# Without donation the loop must first copy the caller's state into buffers
# it may write: for a key/value cache, a cost that follows its capacity.
_donating_sampling_loop = jax.jit(
    _run_sampling_loop, static_argnames=_STATIC, donate_argnames="model_state"
)


def _initial_history(
    prompt_tokens: jax.typing.ArrayLike | None,
    batch: int,
    vocab_size: int,
    max_new_tokens: int,
) -> jax.Array:
    """``int32 [B, P + N - 1]``: the prompt right-aligned, ``NO_TOKEN`` before it."""
    if prompt_tokens is None:
        prompt = jnp.zeros((batch, 0), jnp.int32)
    else:
        _checks.check_integer("prompt_tokens", prompt_tokens)
        _checks.check_rank("prompt_tokens", prompt_tokens, 2, "[B, P]")
        if jnp.shape(prompt_tokens)[0] != batch:
            raise ValueError(
                f"prompt_tokens must have shape [B, P] with B = "
                f"{batch}; got {jnp.shape(prompt_tokens)}."
            )
        _checks.check_in_range("prompt_tokens", prompt_tokens, high=vocab_size - 1)
        prompt = jnp.asarray(prompt_tokens, jnp.int32)
    # Padding (negative ids) moves to the left, so that the prompt's tokens
    # and the generated ones form one contiguous sequence for the n-grams.
    prompt = jnp.take_along_axis(
        prompt, jnp.argsort(prompt >= 0, axis=1, stable=True), axis=1
    )
    prompt = jnp.where(prompt >= 0, prompt, NO_TOKEN)
    empty = jnp.full((batch, max_new_tokens - 1), NO_TOKEN, jnp.int32)
    return jnp.concatenate([empty, prompt], axis=1)


def generate(
    step_fn: StepFn,
    params: Any,
    logits: jax.typing.ArrayLike,
    state: Any,
    *,
    key: jax.Array,
    max_new_tokens: int,
    knobs: SamplingKnobs | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
    num_samples: int = 1,
    prompt_tokens: jax.typing.ArrayLike | None = None,
    donate_state: bool = False,
    **knob_values: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""Greedy decoding or sampling, with any combination of the processors.

    At step ``t`` every unfinished row draws

    .. math::
        y_t \sim \mathrm{softmax}(\tilde z_t), \qquad
        \tilde z_t = \mathrm{process\_logits}(z_t, \dots)

    (:func:`process_logits`), or takes :math:`\arg\max \tilde z_t` when
    ``temperature == 0``. The returned log-probabilities are
    :math:`\log \mathrm{softmax}(\tilde z_t)_{y_t}`, under the *processed*
    distribution (at ``temperature == 0``, the processed logits without any
    temperature), not under the model's raw one. A row that produces
    ``eos_id`` is finished: it emits ``pad_id`` with log-prob 0 from then on,
    and the loop stops as soon as every row is finished.

    A row whose model logits are not finite (a NaN or ``+inf``, or every
    logit ``-inf``) cannot be decoded, and inside the loop nothing can raise:
    the row ends at that step, which holds ``pad_id`` with log-prob ``-inf``
    and adds nothing to its length. ``-inf`` never occurs otherwise (a chosen
    token has positive probability), so ``jnp.isneginf(log_probs).any(-1)``
    flags exactly the rows that met such logits.

    Static arguments (changing them recompiles): ``step_fn`` (by hash),
    ``max_new_tokens``, ``num_samples``, the shapes of ``logits``, ``state``
    and ``prompt_tokens``, which processors are on (None or not), the static
    knobs (``no_repeat_ngram_size``, ``suppress_tokens``), ``eos_id``,
    ``pad_id`` and ``donate_state``. ``params``, ``key`` and the values of
    the traced knobs (``temperature``, 0 included, ``top_k``, ``top_p``,
    ``min_p``, ``repetition_penalty``, ``min_new_tokens``) are traced:
    changing them does not recompile. Inside an outer ``jit`` they cannot be
    checked; the processors' documented rules apply.

    Args:
        step_fn: ``step_fn(params, tokens int32[B], state) -> (logits [B, V],
            state)``; hashable; must keep the structure, shapes and dtypes of
            ``state``.
        params: any pytree, passed to every ``step_fn`` call (traced).
        logits: ``[B, V]`` next-token logits after each prompt.
        state: pytree whose every leaf has leading axis ``B`` (may be empty).
        key: PRNG key (unused when ``temperature == 0``).
        max_new_tokens: ``N >= 1`` tokens at most per row.
        knobs: a :class:`~lmhead.decoding.knobs.SamplingKnobs`, or None to
            give its fields as keywords (``temperature=0.8, top_k=40``), not
            both. ``temperature`` 0 is greedy; it, ``top_k``, ``top_p`` and
            ``min_p`` are a scalar or ``[B]``: rows may be greedy and sampled
            in one batch. See :func:`process_logits`.
        eos_id: id in ``[0, V)`` that ends a row, or None.
        pad_id: id written after a row's end.
        num_samples: ``S >= 1`` samples per prompt, drawn in one batch: the
            prompt rows of ``logits`` and ``state`` are repeated (``state``
            by ``step_fn.repeat(state, S)`` if ``step_fn`` has one), and output
            row ``b * S + s`` is sample ``s`` of prompt ``b``.
        prompt_tokens: ``int [B, P]``, the prompts, read by the repetition
            penalty and the n-gram filter (negative ids are padding, at either
            end). None: those processors see only the generated tokens.
        donate_state: True hands ``state``'s buffers (each leaf a distinct
            array) to the loop, which updates them in place and deletes the
            caller's arrays (on a backend that supports donation). False
            keeps ``state`` usable but copies it whole first, a per-call cost
            that grows with a cache's capacity, not its filled length: pass
            True for a state made for this call alone, such as
            :func:`lmhead.lm.model.prefill`'s. With ``num_samples > 1`` the loop
            always updates its own repeated copy in place. Inside an outer
            ``jit`` it changes nothing.

    Returns:
        ``tokens int32 [B*S, N]``, ``log_probs float32 [B*S, N]`` and
        ``lengths int32 [B*S]`` (generated tokens, EOS included).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> table = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.2, 0.1, 0.7],
        ...                            [0.5, 0.3, 0.2]]))
        >>> markov = lambda table, tokens, state: (table[tokens], state)
        >>> logits = table[jnp.array([0, 1])]  # prompts ending in 0 and in 1
        >>> tokens, log_probs, lengths = generate(
        ...     markov, table, logits, (), key=jax.random.key(0), max_new_tokens=4,
        ...     temperature=0.0, eos_id=0, pad_id=-1)
        >>> tokens
        Array([[ 1,  2,  0, -1],
               [ 2,  0, -1, -1]], dtype=int32)
        >>> lengths, jnp.exp(log_probs[1])
        (Array([3, 2], dtype=int32), Array([0.7, 0.5, 1. , 1. ], dtype=float32))
    """
    logits = _checks.as_logits(logits, "[B, V]")
    batch, vocab_size = logits.shape
    _loop.check_step_fn(step_fn)
    _loop.check_state(state, batch)
    _checks.check_count("max_new_tokens", max_new_tokens)
    _checks.check_count("num_samples", num_samples)
    knobs = SamplingKnobs.of(knobs, **knob_values)
    knobs.check(batch, vocab_size)
    knobs = knobs.as_arrays()
    _loop.check_token_id("eos_id", eos_id, vocab_size)
    history = None
    if knobs.reads_history:
        history = _initial_history(prompt_tokens, batch, vocab_size, max_new_tokens)
    if num_samples > 1:
        repeat = lambda x: jnp.repeat(x, num_samples, axis=0)
        logits, history = jax.tree.map(repeat, (logits, history))
        state = _loop.repeat_rows(step_fn, state, num_samples)
        knobs = knobs.repeat_rows(num_samples)
    config = _SamplingConfig(
        max_new_tokens=int(max_new_tokens),
        eos_id=None if eos_id is None else int(eos_id),
        pad_id=int(pad_id),
    )
    # The repeated state of num_samples > 1 is the loop's own to write.
    loop = (
        _donating_sampling_loop if donate_state or num_samples > 1 else _sampling_loop
    )
    return loop(step_fn, params, logits, state, key, history, knobs, config)[:3]
