"""lmhead: the output head of a language model in JAX and Flax.

The pure functions live in :mod:`lmhead.head` (unembedding, softmax),
:mod:`lmhead.losses` (cross-entropy, smoothing, z-loss, metrics),
:mod:`lmhead.fused` (a linear + cross-entropy that never builds the logits),
:mod:`lmhead.decoding` (logits processors, sampling, beam search),
:mod:`lmhead.quantize` (half-precision and int8 unembeddings for inference)
and :mod:`lmhead.vocab_parallel` (the loss with the vocabulary split over
devices); parameters live in :mod:`lmhead.modules`. This package is the head
library: it imports jax, flax, numpy and itself only. Above it, each in a
folder of its own: the experiment (:mod:`lmhead.lm`: the Transformer, data,
training), the service (:mod:`lmhead.serve`), the sweep tooling
(:mod:`lmhead.lab`) and the studies (:mod:`lmhead.studies`).
"""

from lmhead import decoding
from lmhead import head
from lmhead import losses
from lmhead import modules
from lmhead import vocab_parallel
from lmhead import quantize
from lmhead.decoding import beam_search
from lmhead.decoding import detokenize
from lmhead.decoding import generate
from lmhead.decoding import process_logits
from lmhead.fused import fused_cross_entropy
from lmhead.head import apply_softcap
from lmhead.head import last_positions
from lmhead.head import log_probs
from lmhead.head import output_distribution
from lmhead.head import probs
from lmhead.head import sequence_log_prob
from lmhead.head import token_log_probs
from lmhead.head import unembed
from lmhead.losses import bits_per_character
from lmhead.losses import bits_per_token
from lmhead.losses import cross_entropy
from lmhead.losses import expected_calibration_error
from lmhead.losses import perplexity
from lmhead.modules import LMHead
from lmhead.quantize import QuantizedTable
from lmhead.quantize import quantize_unembedding

__version__ = "0.1.0"
