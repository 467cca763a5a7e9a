"""The run a service serves (:class:`Engine`), and the requests that run
whole, as one program each, instead of in the decode slots of
:mod:`lmhead.serve.continuous`: beam search (the ``num_beams`` extension)
and echo-only scoring (``max_tokens`` 0); ``docs/serving.md``.
"""

import itertools
from typing import Any

import jax
import numpy as np

from lmhead import decoding
from lmhead.lm import inference
from lmhead.lm import model as model_lib
from lmhead.serve import chat, completions, requests
from lmhead.serve.requests import CompletionRequest, bucket


class Engine:
    """A run to serve, within the buckets.

    Args:
        model, params, tokenizer: a run's, as :func:`generation.load_run` gives.
        buckets: the shapes to compile (checked against ``model.max_len``).
        seed: the key of the requests that give no seed.
        score_batch_size: windows per call of the scorer (echoed prompts).
        chat_template: how a chat becomes a prompt (the run's,
            :meth:`chat.ChatTemplate.of_run`); default
            :data:`chat.DEFAULT_TEMPLATE`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from lmhead.lm import data
        >>> from lmhead.serve import protocol
        >>> tokenizer = data.CharTokenizer("abcd")
        >>> model = model_lib.DecoderLM(vocab_size=4, num_layers=1, num_heads=2,
        ...                             d_model=8, mlp_dim=16, max_len=8)
        >>> init = jax.jit(model.init)
        >>> params = init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> buckets = requests.Buckets((2,), (4,), (4,), (2,))
        >>> engine = Engine(model, params, tokenizer, buckets)
        >>> body = protocol.body_models(16, 16, 64).completion(
        ...     model="m", prompt="ab", max_tokens=4, num_beams=2, n=2)
        >>> request = requests.completion_request(
        ...     body, tokenizer, buckets, requests.Limits(), "m", context=8)
        >>> [c["index"] for c in engine.run_whole(request)["choices"]]
        [0, 1]
    """

    def __init__(
        self,
        model: model_lib.DecoderLM,
        params: Any,
        tokenizer: Any,
        buckets: requests.Buckets,
        *,
        seed: int = 0,
        score_batch_size: int = 8,
        chat_template: chat.ChatTemplate | None = None,
    ):
        buckets.check(model.max_len)
        self.chat_template = chat_template or chat.ChatTemplate(
            chat.DEFAULT_TEMPLATE, eos_token=getattr(tokenizer, "eos_token", None)
        )
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.buckets, self.score_batch_size = buckets, score_batch_size
        self._step_fn = inference.make_step_fn(model)
        self._key = jax.random.key(seed)
        self._batch_index = itertools.count()

    def _prefill(self, prompts: list[np.ndarray]):
        """Logits and cache of the prompts padded to their buckets (padding
        rows: a one-token prompt)."""
        rows = bucket(len(prompts), self.buckets.batch_sizes)
        width = self.buckets.prompt_lengths[-1]
        history = np.zeros([rows, width], np.int32)
        lengths = np.ones([rows], np.int32)
        for row, ids in enumerate(prompts):
            history[row, : len(ids)], lengths[row] = ids, len(ids)
        time_ = bucket(int(lengths.max()), self.buckets.prompt_lengths)
        return inference.prefill(self.model, self.params, history[:, :time_], lengths)

    def run_whole(self, request: CompletionRequest) -> dict:
        """A beam or echo-only request's :func:`completions.request_result`."""
        prompts = range(len(request.prompt_ids))
        if request.num_beams > 1:
            beams, n = request.num_beams, request.n
            rows = [(p * beams + s, p, s) for p in prompts for s in range(n)]
            return completions.request_result(
                self, request, rows, self._beam(request), {}
            )
        if request.max_tokens != 0:
            raise ValueError("run_whole runs beam and echo-only requests.")
        scores = completions.echo_scores(self, request)
        return completions.request_result(
            self, request, [(None, p, 0) for p in prompts], None, scores
        )

    def _beam(self, request: CompletionRequest) -> decoding.Generation:
        """:func:`decoding.beam_search` of each prompt (knobs neutral:
        :func:`requests.completion_request` refuses sampling knobs with beams):
        prompt ``p``'s sequences, best first, in rows ``p * num_beams``
        on (:func:`decoding.beam_generation`; beam requests refuse
        log-probs)."""
        logits, cache = self._prefill(request.prompt_ids)
        eos_id = completions.eos_id(self, request)
        beams = decoding.beam_search(
            self._step_fn,
            self.params,
            logits,
            cache,
            num_beams=request.num_beams,
            max_new_tokens=request.max_tokens,
            eos_id=eos_id,
            num_return_sequences=request.num_beams,
        )
        return jax.device_get(decoding.beam_generation(beams, eos_id))

    def warm_up(self) -> int:
        """Compiles the log-probs of echoed prompts: the scorer and the top
        log-probs, one program each whatever the text; returns the number of
        programs run. Beam search compiles a shape on its first use."""
        completions.prompt_log_probs(self, np.zeros([2], np.int32), 1)
        return 2
