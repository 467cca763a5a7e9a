"""The HTTP service over a trained run: the request bodies' pydantic models
(:mod:`~lmhead.serve.protocol`), the checks that depend on the run and the
shape buckets (:mod:`~lmhead.serve.requests`), the run's engine
(:mod:`~lmhead.serve.engine`), continuous batching
(:mod:`~lmhead.serve.continuous`), the answers (:mod:`~lmhead.serve.completions`,
chat's in :mod:`~lmhead.serve.chat`) and the web app (:mod:`~lmhead.serve.web`)."""
