"""Tests for ``/v1/chat/completions`` (lmhead/serve/chat.py): the run's
template from ``tokenizer_config.json`` rendered as transformers renders it,
the default one, and chat's answers against completions of the rendered
prompt: the same tokens, log-probs in chat's shape, ``n``, stops, seeds,
usage and the streamed chunks."""

import json

import pytest

from lmhead.serve import chat, web
from lmhead.serve.requests import RequestError

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("jinja2")

MODEL = "lmhead"
# A template in the style of Hugging Face's (ChatML's), with the special
# tokens, a loop control, tojson and raise_exception.
HF_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message comes first') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ {'n': messages | length} | tojson }}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]


def test_a_runs_template_renders_as_transformers_does(tmp_path):
    config = {"chat_template": HF_TEMPLATE, "bos_token": {"content": "<s>"},
              "eos_token": "</s>"}  # fmt: skip
    (tmp_path / chat.TEMPLATE_FILE).write_text(json.dumps(config))
    template = chat.ChatTemplate.of_run(str(tmp_path), tokenizer=None)
    assert template.render(CHAT) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho?<|im_end|>\n"
        '<|im_start|>assistant\n{"n": 2}'
    )
    assert not template.render(CHAT, add_generation_prompt=False).endswith(
        'assistant\n{"n": 2}'
    )
    with pytest.raises(RequestError, match="a system message comes first") as raised:
        template.render(CHAT[::-1])
    assert raised.value.field == "messages"
    # Several named templates: the default one.
    config["chat_template"] = [{"name": "tool_use", "template": "x"},
                               {"name": "default", "template": "{{ eos_token }}"}]  # fmt: skip
    (tmp_path / chat.TEMPLATE_FILE).write_text(json.dumps(config))
    assert chat.ChatTemplate.of_run(str(tmp_path), None).render(CHAT) == "</s>"


def test_a_run_trained_here_gets_the_default_template(tmp_path):
    template = chat.ChatTemplate.of_run(str(tmp_path), tokenizer=None)
    assert template.source == chat.DEFAULT_TEMPLATE
    assert template.render(CHAT) == (
        "SYSTEM:\nBe brief.\n\nUSER:\nWho?\n\nASSISTANT:\n"
    )


@pytest.fixture(scope="module")
def url(wide_engine):
    app = web.make_app(wide_engine, web.ServiceConfig(model_name=MODEL))
    with web.BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_chat_is_a_completion_of_the_rendered_prompt(wide_engine, client):
    prompt = wide_engine.chat_template.render(CHAT)
    settings = dict(model=MODEL, temperature=0.9, seed=4, n=3, stop=["ee"])
    answer = client.chat.completions.create(
        messages=CHAT, max_completion_tokens=12, logprobs=True, top_logprobs=2,
        **settings,
    )  # fmt: skip
    completion = client.completions.create(
        prompt=prompt, max_tokens=12, logprobs=2, **settings
    )
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    for got, want in zip(answer.choices, completion.choices, strict=True):
        assert got.message.content == want.text
        assert got.finish_reason == want.finish_reason
        content = got.logprobs.content
        assert [c.token for c in content] == want.logprobs.tokens
        assert [c.logprob for c in content] == pytest.approx(
            want.logprobs.token_logprobs, abs=1e-6
        )
        for entry, top in zip(content, want.logprobs.top_logprobs):
            assert {t.token: t.logprob for t in entry.top_logprobs} == pytest.approx(
                top
            )
            assert entry.bytes == list(entry.token.encode())
    assert answer.usage.prompt_tokens == len(wide_engine.tokenizer.encode(prompt))
    assert answer.usage.completion_tokens == completion.usage.completion_tokens
    # max_tokens is the older name of max_completion_tokens.
    older = client.chat.completions.create(messages=CHAT, max_tokens=12, **settings)
    assert [c.message.content for c in older.choices] == [
        c.message.content for c in answer.choices
    ]


def test_streamed_chat_chunks_equal_the_answer(client):
    settings = dict(model=MODEL, messages=CHAT, max_completion_tokens=10, n=2, seed=8)
    answer = client.chat.completions.create(**settings)
    texts, finish, usage = {}, {}, None
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **settings
    )
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.index not in texts:
                assert choice.delta.role == "assistant"
            texts[choice.index] = texts.get(choice.index, "") + (
                choice.delta.content or ""
            )
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert [texts[i] for i in range(2)] == [c.message.content for c in answer.choices]
    assert [finish[i] for i in range(2)] == [c.finish_reason for c in answer.choices]
    assert usage.total_tokens == answer.usage.total_tokens
