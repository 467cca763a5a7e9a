"""The experiment: a decoder-only Transformer trained on a text corpus.

Built on the head library (``lmhead``) and imported by nothing in it: the
model (:mod:`~lmhead.lm.model`) and its KV cache
(:mod:`~lmhead.lm.kv_cache`), the corpus, tokenizers and
batches (:mod:`~lmhead.lm.data`), the configuration
(:mod:`~lmhead.lm.configuration`), the training state and loop
(:mod:`~lmhead.lm.state`, :mod:`~lmhead.lm.train`), evaluation, checkpoints,
monitoring, preemption and sharding, and using a trained run
(:mod:`~lmhead.lm.generation`, :mod:`~lmhead.lm.scoring`). docs/training.md
describes a run's design.
"""
