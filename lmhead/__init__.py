"""lmhead: the output head of a language model in JAX and Flax.

This package is the head library (pure functions of arrays, and the
``LMHead`` module); it imports jax, flax, chex, numpy and itself only. Above
it, each in a folder of its own: the experiment (:mod:`lmhead.lm`), the
service (:mod:`lmhead.serve`) and the sweep tooling (:mod:`lmhead.lab`). The
studies are a project beside the package (``studies/`` in the repository),
which neither ``import lmhead`` nor ``pip install lmhead`` carries.
docs/design.md lists every module.
"""

from lmhead import (
    decoding,
    distillation,
    head,
    kto,
    losses,
    metrics,
    modules,
    policy_gradient,
    preference,
    quantize,
    sparse_distillation,
    token_logprobs,
    vocab_parallel,
)
from lmhead.decoding import (
    SamplingKnobs,
    beam_search,
    detokenize,
    generate,
    process_logits,
)
from lmhead.distillation import distillation_loss, fused_distillation_loss
from lmhead.fused import fused_cross_entropy
from lmhead.head import (
    apply_softcap,
    last_positions,
    log_probs,
    output_distribution,
    probs,
    sequence_log_prob,
    token_log_probs,
    unembed,
)
from lmhead.kto import fused_kto_loss, kto_loss, kto_reference_point
from lmhead.losses import cross_entropy
from lmhead.metrics import (
    bits_per_character,
    bits_per_token,
    expected_calibration_error,
    perplexity,
)
from lmhead.modules import LMHead
from lmhead.policy_gradient import fused_policy_gradient_loss, policy_gradient_loss
from lmhead.preference import fused_preference_loss, preference_loss
from lmhead.quantize import QuantizedTable, quantize_unembedding
from lmhead.sparse_distillation import (
    fused_sparse_distillation_loss,
    sparse_distillation_loss,
)
from lmhead.token_logprobs import fused_token_logprobs

__version__ = "0.1.0"
