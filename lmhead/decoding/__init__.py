"""Decoding: logits processors, greedy and sampled generation, beam search.

Every function here is pure. A model plugs in through one function,

    step_fn(params, tokens: int32[B], state) -> (logits: float[B, V], state),

which feeds one token per row and returns the next-token logits; every leaf of
``state`` (e.g. a key/value cache) has a leading batch axis ``B``.
:func:`generate` and :func:`beam_search` start from the logits after the prompt
and the matching ``state`` (what a model's prefill returns), and pass
``params`` to every ``step_fn`` call, traced: ``step_fn`` is compared by hash
and must not close over weights. ``step_fn`` may bring ``reorder(state,
rows)`` and ``repeat(state, repeats)`` (beam search and ``num_samples``; else
:func:`gather_rows` and ``jnp.repeat``). The knobs are one
:class:`SamplingKnobs`; a constraint (structured output) is a
:class:`TokenConstraint`, each row's allowed-token mask, which the step reads
and a host :class:`TokenMasker` advances. A removed token has logit :data:`NEG_INF`; ties go to
the lower token id; a length counts generated tokens up to and including EOS,
``pad_id`` after. ``docs/decoding.md`` describes the modules and the contract.
"""

from lmhead.decoding._loop import StepFn
from lmhead.decoding.beam_search import (
    PENALTIES,
    BeamResult,
    BeamState,
    beam_generation,
    beam_search,
    gather_rows,
    length_penalty_divisor,
)
from lmhead.decoding.constraint import (
    TokenConstraint,
    TokenMasker,
    apply_token_mask,
    mask_width,
    pack_token_mask,
    unpack_token_mask,
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
from lmhead.decoding.sampling import (
    Generation,
    SamplingState,
    generate,
    generate_stream,
)
from lmhead.decoding.slots import (
    SlotChunk,
    SlotState,
    empty_slots,
    fill_slots,
    free_slots,
    full_knobs,
    step_slots,
)
from lmhead.decoding.speculative import (
    NGramProposer,
    ProposalContext,
    Proposer,
    SpeculationStats,
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
    accepts_draft,
    decode_step,
)
from lmhead.decoding.stop_strings import (
    StopStrings,
    encode_stop_strings,
    token_bytes_from_decode,
)
from lmhead.decoding.stopping import StopCondition, StopSequences
from lmhead.decoding.text import TokenDecoder, detokenize, find_stop, trim_at_stop
from lmhead.head import NEG_INF
