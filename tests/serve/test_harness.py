"""lm-evaluation-harness's three request types against the real server
(lmhead/serve), as its ``local-completions`` model sends them
(``lm_eval/models/openai_completions.py`` and ``api_models.py``): token-id
prompts, a batch of them per request, and what it reads from the answers.

References: the scorer of ``experiments/score.py``
(``lmhead.lm.scoring.score_text``), a numpy ``log_softmax`` of the model's
logits, and ``lmhead.decoding.generate``.
"""

import logging

import jax
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import generation, inference, scoring
from lmhead.serve import engine as engine_lib
from lmhead.serve import requests, web
from tests.lm import gpt2_checkpoint
from tests.serve.tiny_run import BUCKETS, eos_id, numpy_log_softmax, text_of

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "lmhead"
SEED = 1234  # the harness's
BATCH = 4  # prompts per request: the tiny run's largest batch
TEXT = (
    "KING HENRY. Now, lords, for France; the enterprise whereof shall be to "
    "you, as us, like glorious. We doubt not of a fair and lucky war."
)


@pytest.fixture(scope="module", params=["trained", "imported_gpt2"])
def served(request, tmp_path_factory):
    """``(run, engine)``: the tiny run trained here (conftest.py), or a
    random GPT-2-layout checkpoint of a 16-token context with a byte-level
    BPE tokenizer, imported (``tests/lm/gpt2_checkpoint.py``)."""
    if request.param == "trained":
        return request.getfixturevalue("run"), request.getfixturevalue("engine")
    folder = str(tmp_path_factory.mktemp("gpt2"))
    _, _, workdir = gpt2_checkpoint.imported_gpt2_run(folder)
    _, tokenizer, model, params = generation.load_run(workdir)
    engine = engine_lib.Engine(model, params, tokenizer, BUCKETS)
    engine.warm_up()
    return (model, params, tokenizer), engine


@pytest.fixture(scope="module")
def url(served):
    app = web.make_app(served[1], web.ServiceConfig(model_name=MODEL))
    with web.BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="module")
def capped_url(served):
    """A service that cuts ``max_tokens`` to the room a prompt leaves
    (``--cap_max_tokens``), as a harness's fixed 256 new tokens needs on a
    16-token model."""
    limits = requests.Limits(cap_max_tokens=True)
    app = web.make_app(served[1], web.ServiceConfig(model_name=MODEL, limits=limits))
    with web.BackgroundServer(app) as url:
        yield url


def end_of_text(url, run):
    """The harness's prefix token and stop string: ``/tokenizer_info``'s
    ``eos_token``, and its id as ``RemoteTokenizer.eos_token_id`` finds it
    (the first id of the token's text)."""
    info = httpx.get(url + "/tokenizer_info", timeout=60).json()
    prefix = encode(url, info["eos_token"])[0]
    assert prefix == info["eos_token_id"] == eos_id(run) is not None
    return prefix, info["eos_token"]


def encode(url, text):
    """``lm_eval.utils.RemoteTokenizer.encode``."""
    body = {"prompt": text, "add_special_tokens": False}
    answer = httpx.post(url + "/tokenize", json=body, timeout=60).json()
    assert answer["count"] == len(answer["tokens"])
    return answer["tokens"]


def loglikelihood_payload(prompts):
    """``LocalCompletionsAPI._create_payload(generate=False)``."""
    return {
        "model": MODEL,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": SEED,
        "echo": True,
    }


def parse_logprobs(answer, ctxlens):
    """``LocalCompletionsAPI.parse_logprobs``: each choice's log-likelihood
    of its continuation, whether it is greedy, and its per-token values."""
    out = []
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(v == max(top.values()) for v, top in zip(values, tops))
        out.append((sum(values), greedy, values, tops))
    return out


def harness_inputs(pairs, max_length):
    """``TemplateAPI.batch_loglikelihood_requests``: each (context,
    continuation) left-cut to ``max_length`` tokens, and its context length."""
    inputs, ctxlens = [], []
    for context, continuation in pairs:
        inp = (context + continuation)[-max_length:]
        inputs.append(inp)
        ctxlens.append(
            len(context) - max(0, len(context) + len(continuation) - max_length)
        )
    return inputs, ctxlens


def rolling_windows(tokens, prefix, max_seq_len):
    """``lm_eval.utils.get_rolling_token_windows`` (context_len 1), then
    ``make_disjoint_window``: (context, continuation) pairs that predict
    every token once, the first after the ``prefix`` token."""
    first = min(max_seq_len, len(tokens))
    windows = [([prefix] + tokens[: first - 1], tokens[:first])]
    predicted = first
    while predicted < len(tokens):
        count = min(len(tokens) - predicted, max_seq_len)
        end = predicted + count
        windows.append(
            (tokens[end - max_seq_len - 1 : end - 1], tokens[end - count : end])
        )
        predicted += count
    return [(a[: len(a) - (len(b) - 1)], b) for a, b in windows]


def check_against_the_scorer(run, inp, ctxlen, values, tops):
    """The harness's slice equals the scorer's log-probs of the same tokens
    (``experiments/score.py``'s ``strided_log_probs`` of the window, as
    ``score_text`` calls it on the window's text), and its top-1 the numpy
    argmax of the model's distribution."""
    model, params, tokenizer = run
    scored = scoring.strided_log_probs(
        scoring.ModelLogits(model), params, np.asarray(inp, np.int32),
        window=model.max_len,
    )  # fmt: skip
    np.testing.assert_allclose(values, scored[ctxlen - 1 :], atol=1e-5)
    full = numpy_log_softmax(run, inp)
    for j, top in zip(range(ctxlen, len(inp)), tops, strict=True):
        best = int(np.argmax(full[j - 1]))
        assert list(top) == [tokenizer.decode([best])]
        np.testing.assert_allclose(list(top.values()), [full[j - 1, best]], atol=1e-5)


def test_loglikelihood(served, url):
    """Multiple choice: a batch of token-id prompts, one cut to the whole
    context (the harness's max_length = the context)."""
    run = served[0]
    context = run[0].max_len
    ids = encode(url, "KING HENRY")
    back = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=60).json()
    assert back == {"prompt": "KING HENRY"}
    pairs = [
        (encode(url, "KING HENRY"), encode(url, ". Now")),
        (encode(url, "KING HENRY"), encode(url, " lords")),
        (encode(url, TEXT[:60]), encode(url, TEXT[60:64])),  # longer: left-cut
    ]
    inputs, ctxlens = harness_inputs(pairs, context - 1)  # + 1 new token
    assert len(inputs[2]) == context - 1
    answer = httpx.post(
        url + "/v1/completions", json=loglikelihood_payload(inputs), timeout=60
    )
    assert answer.status_code == 200, answer.text
    results = parse_logprobs(answer.json(), ctxlens)
    full = [numpy_log_softmax(run, inp) for inp in inputs]
    for inp, ctxlen, (total, greedy, values, tops), lp in zip(
        inputs, ctxlens, results, full
    ):
        check_against_the_scorer(run, inp, ctxlen, values, tops)
        want = [lp[j - 1, inp[j]] for j in range(ctxlen, len(inp))]
        np.testing.assert_allclose(total, sum(want), atol=1e-5)
        assert greedy == all(
            inp[j] == int(np.argmax(lp[j - 1])) for j in range(ctxlen, len(inp))
        )


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_loglikelihood_rolling_windows_of_the_whole_context(served, url, max_tokens):
    """Perplexity: windows of the whole context, each after the end-of-text
    id (the harness run with max_length = the context + 1, so that its one
    token of room is the echoed prompt's own)."""
    run = served[0]
    prefix, _ = end_of_text(url, run)
    context = run[0].max_len
    tokens = encode(url, TEXT)
    pairs = rolling_windows(tokens, prefix, max_seq_len=context - 1)
    inputs, ctxlens = harness_inputs(pairs, context)
    assert {len(inp) for inp in inputs[:-1]} == {context}
    assert inputs[0][0] == prefix and ctxlens[0] == 1
    choices = []
    for start in range(0, len(inputs), BATCH):  # the harness's batch_size
        chunk = inputs[start : start + BATCH]
        body = dict(loglikelihood_payload(chunk), max_tokens=max_tokens)
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        choices += sorted(answer.json()["choices"], key=lambda c: c["index"])
    predicted = []
    for choice, inp, ctxlen in zip(choices, inputs, ctxlens, strict=True):
        entries = choice["logprobs"]["token_logprobs"]
        assert len(entries) == len(inp) + max_tokens
        # The harness drops the last entry: with max_tokens 0 it is the
        # prompt's own last token, so the replay reads one more here.
        values = entries[ctxlen:] if max_tokens == 0 else entries[ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen : ctxlen + len(values)]
        check_against_the_scorer(run, inp, ctxlen, values, tops)
        predicted += inp[ctxlen:]
    assert predicted == tokens  # every token once


def test_generate_until(served, url, capped_url):
    """Generation: 8 stops, the end-of-text string among them, the
    harness's 256 new tokens: cut to the room each prompt leaves where the
    service caps ``max_tokens`` (``--cap_max_tokens``), refused naming the
    prompt where it does not (vLLM's rule)."""
    run = served[0]
    model, params, tokenizer = run
    _, eos_text = end_of_text(url, run)
    prompts = [encode(url, "KING HENRY."), encode(url, "To be")]
    until = ["\n\n", "KING", "Q:", "</s>", "<|im_end|>", "###", "\n\nQuestion:"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 256, "temperature": 0,
            "stop": until + [eos_text], "seed": SEED}  # fmt: skip
    refused = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert "maximum context length is 16 tokens" in refused.json()["error"]["message"]
    answer = httpx.post(capped_url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
    for prompt, choice in zip(prompts, choices, strict=True):
        logits, cache = inference.prefill(model, params, np.asarray([prompt]))
        tokens, _, lengths, *_ = decoding.generate(
            inference.make_step_fn(model), params, logits, cache,
            key=jax.random.key(0), max_new_tokens=model.max_len - len(prompt),
            temperature=0.0, eos_id=eos_id(run),
        )  # fmt: skip
        text = text_of(run, tokens[0, : int(lengths[0])])
        assert choice["text"] == decoding.trim_at_stop(text, until + [eos_text])
        ended = choice["text"] != text or int(lengths[0]) < tokens.shape[1]
        assert choice["finish_reason"] == ("stop" if ended else "length")


class _Compiles(logging.Handler):
    """Records JAX's log lines of the programs it compiles."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        if "compil" in record.getMessage().lower():
            self.lines.append(record.getMessage())


def test_no_request_compiles_after_the_warm_up(served, url):
    """The harness's shapes and every served knob run the programs the
    warm-up (``web.make_app``, ``Engine.warm_up``) compiled: whole-context
    echo with 0 or 1 new tokens, 20 log-probs, 16 stops of 64 characters,
    stop ids, min_tokens, ignore_eos, sampling knobs and penalties, seeds,
    one row or as many as the largest batch (beam search compiles its
    shapes on first use, as docs/serving.md says)."""
    run = served[0]
    ids = encode(url, TEXT)[: run[0].max_len]
    bodies = [
        {"prompt": [ids], "echo": True, "max_tokens": 0, "logprobs": 1},
        {"prompt": [ids, ids[:5]], "echo": True, "max_tokens": 1, "logprobs": 20},
        {"prompt": "KING", "max_tokens": 9, "logprobs": 7,
         "stop": [f"{i:02d}" + "x" * 62 for i in range(15)] + ["\n"]},
        {"prompt": "KING", "max_tokens": 9, "stop_token_ids": [1, 2],
         "min_tokens": 3, "ignore_eos": True, "temperature": 0.7, "n": 2},
        {"prompt": ["K", "To", "be"], "max_tokens": 3, "top_p": 0.9, "min_p": 0.1,
         "top_k": 5, "repetition_penalty": 1.3, "presence_penalty": 0.5,
         "frequency_penalty": 0.2, "logit_bias": {"1": 2}},
        {"prompt": "KING", "seed": 3, "n": 4, "max_tokens": 2},
        # A new constraint of each kind, and a chat, compile nothing either.
        {"prompt": "K", "max_tokens": 6, "guided_regex": "[a-z]+ [A-Z]"},
        {"prompt": "K", "max_tokens": 6, "structured_outputs": {"json_object": True}},
        {"prompt": "K", "max_tokens": 6, "guided_choice": ["KING", "LEAR"], "n": 3},
        {"messages": [{"role": "user", "content": "K"}], "max_tokens": 3,
         "add_generation_prompt": False,  # the template's text fits 16 tokens
         "response_format": {"type": "json_schema", "json_schema": {
             "name": "a", "schema": {"enum": ["I", "O"]}}}},
    ]  # fmt: skip
    handler, logger = _Compiles(), logging.getLogger("jax")
    level, logged = logger.level, jax.config.jax_log_compiles
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    try:
        for body in bodies:
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = httpx.post(url + route,
                                  json={"model": MODEL, **body}, timeout=60)  # fmt: skip
            assert response.status_code == 200, response.text
        assert handler.lines == []
        jax.jit(lambda x: x * 3 + 1)(np.ones(7))  # the check sees a compile
        assert handler.lines
    finally:
        jax.config.update("jax_log_compiles", logged)
        logger.removeHandler(handler)
        logger.setLevel(level)
