"""The HTTP service over a trained run: request checks and shape buckets
(:mod:`~lmhead.serve.requests`), the run's engine (:mod:`~lmhead.serve.engine`),
continuous batching (:mod:`~lmhead.serve.continuous`), the answers
(:mod:`~lmhead.serve.completions`) and the web app (:mod:`~lmhead.serve.web`)."""
