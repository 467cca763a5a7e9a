"""Decoding: logits processors, greedy and sampled generation, beam search.

Every function here is pure. A model plugs in through one function,

    step_fn(params, tokens: int32[B], state) -> (logits: float[B, V], state),

which feeds one token per row and returns the next-token logits; every leaf of
``state`` (e.g. a key/value cache) has a leading batch axis ``B``.
:func:`generate` and :func:`beam_search` start from the logits after the prompt
and the matching ``state`` (what a model's prefill returns) and run one
``lax.while_loop`` with static shapes, calling ``step_fn`` once per new token.

The contract between a model and the decoders:

* **Parameters are arguments.** ``params`` (any pytree) goes to
  ``generate(step_fn, params, ...)`` / ``beam_search(step_fn, params, ...)``,
  which pass it, traced, to every ``step_fn`` call. A ``step_fn`` must not
  close over weights: the loops are compiled once per ``step_fn`` (compared
  by hash, so use a module-level function or a frozen dataclass such as
  ``lmhead.lm.model.make_step_fn``'s, not a fresh closure), shapes and static
  settings, and then serve every parameter set of those shapes; no weight
  becomes a constant of the compiled program.
* **A step costs what it uses.** The decoders only feed tokens and reorder
  rows; what a step reads is the model's business (``lmhead.lm.kv_cache``
  attends over the filled part of the cache only). Beam search reorders
  ``state`` with ``step_fn.reorder(state, rows)`` when ``step_fn`` has one, so
  that a cache can move pointers instead of keys and values
  (``lmhead.lm.kv_cache``'s does); otherwise with :func:`gather_rows`. Beam search and ``num_samples``
  repeat ``state``'s rows with ``step_fn.repeat(state, repeats)`` when
  ``step_fn`` has one, otherwise with ``jnp.repeat`` of every leaf.
* **Sampling knobs** are defined once, by :class:`SamplingKnobs`, which
  :func:`process_logits`, :func:`generate` and :func:`beam_search` take (or
  build from keywords); every traced knob is a scalar or one value per row
  ``[B]``, except ``logit_bias``, one value per token (``[V]`` or ``[B, V]``).

Conventions shared by everything below:

* A removed token has logit :data:`NEG_INF`, i.e. probability exactly 0.
* Ties are broken towards the lower token id everywhere (argmax, top-k, top-p,
  beam ranking), so ``top_k=1`` is exactly greedy.
* A sequence's length counts generated tokens up to and including EOS; the
  positions after it hold ``pad_id``.

Modules: :mod:`~lmhead.decoding.knobs` (:class:`SamplingKnobs`),
:mod:`~lmhead.decoding.processors` (the logits processors),
:mod:`~lmhead.decoding.top_set` (the top-k and top-p cut without a sort),
:mod:`~lmhead.decoding.step` (:func:`decode_step`, the one step that
:func:`generate`, :func:`generate_stream` and the slots run),
:mod:`~lmhead.decoding.sampling` (:func:`generate`),
:mod:`~lmhead.decoding.split` (a loop per device when ``step_fn`` splits the
rows over a mesh),
:mod:`~lmhead.decoding.stopping` (:class:`StopCondition`, :class:`StopSequences`),
:mod:`~lmhead.decoding.streaming` (:func:`generate_stream`),
:mod:`~lmhead.decoding.beam_search` (:func:`beam_search`),
:mod:`~lmhead.decoding.text` (:func:`detokenize`, which needs only a
``decode`` method, not a tokenizer library, and :func:`trim_at_stop`),
:mod:`~lmhead.decoding.stop_strings` (:class:`StopStrings`, text stop strings
checked in the loop on each token's bytes), :mod:`~lmhead.decoding.slots`
(continuous batching: :func:`empty_slots`, :func:`fill_slots`,
:func:`step_slots`, :func:`free_slots`).
"""

from lmhead.decoding._loop import StepFn
from lmhead.decoding.beam_search import (
    PENALTIES,
    BeamResult,
    BeamState,
    beam_search,
    gather_rows,
    length_penalty_divisor,
)
from lmhead.decoding.knobs import SamplingKnobs, logit_bias_vector, stop_token_mask
from lmhead.decoding.processors import (
    NO_TOKEN,
    TOP_P_TOLERANCE,
    apply_logit_bias,
    apply_min_new_tokens,
    apply_min_p,
    apply_no_repeat_ngram,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_suppress_tokens,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    process_logits,
)
from lmhead.decoding.sampling import Generation, SamplingState, generate
from lmhead.decoding.slots import (
    SlotChunk,
    SlotState,
    empty_slots,
    fill_slots,
    free_slots,
    full_knobs,
    step_slots,
)
from lmhead.decoding.step import (
    FINISHED_BAD_LOGITS,
    FINISHED_EOS,
    FINISHED_LENGTH,
    FINISHED_STOP,
    DecodeRows,
    ProcessorContext,
    StepConfig,
    StepOutput,
    decode_step,
)
from lmhead.decoding.stop_strings import StopStrings, token_bytes_from_decode
from lmhead.decoding.stopping import StopCondition, StopSequences
from lmhead.decoding.streaming import generate_stream
from lmhead.decoding.text import TokenDecoder, detokenize, find_stop, trim_at_stop
from lmhead.head import NEG_INF
