"""The HTTP service over a trained run: request checks and shape buckets
(:mod:`~lmhead.serve.requests`), the batching engine
(:mod:`~lmhead.serve.batching`) and the web app (:mod:`~lmhead.serve.web`)."""
