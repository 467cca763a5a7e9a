"""Structured output over the experiment's tokenizers: every sample valid
under its JSON Schema (the ``jsonschema`` package), its regex (``re``), its
choices and its grammar (a ``lark`` parser), on the character tokenizer,
trained BPE and an imported GPT-2 tokenizer; bad constraints refused by
name; the model's own continuations constrained window after window."""

import json
import re
import string

import jax
import jax.numpy as jnp
import jsonschema
import lark
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import constraints, data, generation, gpt2_import
from lmhead.lm import model as model_lib
from tests.lm.gpt2_checkpoint import write_gpt2_checkpoint

SAMPLES = 20
TEXT = "Thou art more lovely and more temperate: rough winds do shake\n" * 40


def obj(properties, required=None, **more):
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **more,
    }


NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"}
# Real schemas: nested objects, arrays with minItems/maxItems, enums, bounded
# numbers, string patterns, anyOf, $ref, const, nullable, booleans.
SCHEMAS = {
    "person": obj(
        {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}
    ),
    "point": obj(
        {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "y": {"type": "number"},
        }
    ),
    "tags": obj(
        {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        }
    ),
    "order": obj(
        {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": obj(
                    {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),  # fmt: skip
            },
        }
    ),
    "status": obj(
        {"status": {"enum": ["ok", "error", "pending"]}, "code": {"const": 7}}
    ),
    "maybe": obj(
        {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "null"},
                    {"type": "boolean"},
                ]
            }
        }
    ),  # fmt: skip
    "ref": {
        "$defs": {
            "pair": obj(
                {
                    "a": {"type": "integer", "minimum": 0, "maximum": 5},
                    "b": {"type": "boolean"},
                }
            )
        },  # fmt: skip
        **obj({"first": {"$ref": "#/$defs/pair"}, "second": {"$ref": "#/$defs/pair"}}),
    },
    "nested": obj({"outer": obj({"inner": obj({"deep": {"type": "boolean"}})})}),
    "matrix": obj(
        {
            "rows": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {"type": "integer", "minimum": -9, "maximum": 9},
                },
            }
        }
    ),
    "optional": obj({"name": NAME, "nick": NAME}, required=["name"]),
    "date": obj(
        {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}
    ),
    "one_of": obj(
        {
            "shape": {
                "oneOf": [
                    obj({"circle": {"type": "integer", "minimum": 1, "maximum": 9}}),
                    obj({"square": {"type": "integer", "minimum": 1, "maximum": 9}}),
                ]
            }
        }
    ),  # fmt: skip
}
GRAMMAR = """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]?/
"""
REGEX = r"[A-Z][a-z]{2,5}, [0-9]{1,2} (May|June) 20[0-9]{2}"
CHOICES = ["to be", "not to be", "that is the question"]


def char_tokenizer():
    return data.CharTokenizer.train(string.printable, data.END_OF_TEXT)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The three kinds: characters, BPE trained here, imported GPT-2's."""
    folder = tmp_path_factory.mktemp("gpt2")
    write_gpt2_checkpoint(str(folder))
    imported, _ = gpt2_import.read_tokenizer(
        str(folder), gpt2_import.read_config(str(folder))
    )
    trained = data.BPETokenizer.train(
        TEXT + string.printable * 3, 400, data.END_OF_TEXT
    )
    return {"char": char_tokenizer(), "bpe": trained, "gpt2": imported}


def closing_step(table, tokens, state):
    """A model whose next logits do not depend on the past: ``table[0]``."""
    return jnp.broadcast_to(table[0], (tokens.shape[0], table.shape[1])), state


def closing_logits(tokenizer):
    """``[1, V]`` logits that favour the tokens that close a value (quotes,
    brackets, end-of-text), so that samples at temperature 1 end soon."""
    table = data.token_bytes(tokenizer)
    closing = [any(c in t for c in b'"}])') for t in table]
    logits = np.where(closing, 3.0, 0.0).astype(np.float32)
    logits[tokenizer.eos_id] = 3.0
    return jnp.asarray(logits[None])


def sample(tokenizer, constraint, rows=SAMPLES, max_new_tokens=160, seed=0):
    """``rows`` samples at temperature 1 under ``constraint``: their texts
    and finish reasons."""
    masker = constraints.masker_for(tokenizer)
    row_constraint = constraints.row_constraint(masker, [constraint] * rows)
    logits = closing_logits(tokenizer)
    out = jax.device_get(
        decoding.generate(
            closing_step, logits, jnp.repeat(logits, rows, 0), (),
            key=jax.random.split(jax.random.key(seed), rows),
            max_new_tokens=max_new_tokens, temperature=1.0, eos_id=tokenizer.eos_id,
            constraint=row_constraint,
        )
    )  # fmt: skip
    masker.release(row_constraint.ids.tolist())
    texts = []
    for tokens, length, reason in zip(out.tokens, out.lengths, out.finish_reasons):
        assert reason == decoding.FINISHED_EOS, tokenizer.decode(tokens[:length])
        texts.append(tokenizer.decode(tokens[: length - 1]))
    return texts


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_sample_is_valid_under_its_json_schema(name):
    schema = SCHEMAS[name]
    jsonschema.Draft202012Validator.check_schema(schema)
    texts = sample(char_tokenizer(), constraints.Constraint.json_schema(schema))
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # samples, not one forced text


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_each_tokenizer_samples_valid_json_regexes_choices_and_grammars(
    tokenizers, kind
):
    tokenizer = tokenizers[kind]
    for name in ("order", "maybe", "ref"):
        schema = SCHEMAS[name]
        texts = sample(tokenizer, constraints.Constraint.json_schema(schema), seed=1)
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
    for text in sample(tokenizer, constraints.Constraint.json_object(), seed=2):
        assert isinstance(json.loads(text), dict)
    for text in sample(tokenizer, constraints.Constraint.regex(REGEX), seed=3):
        assert re.fullmatch(REGEX, text), text
    texts = sample(tokenizer, constraints.Constraint.choice(CHOICES), seed=4)
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1
    parser = lark.Lark(GRAMMAR)
    for text in sample(tokenizer, constraints.Constraint.grammar(GRAMMAR), seed=5):
        parser.parse(text)


def test_a_gbnf_grammar_is_read_too():
    gbnf = 'root ::= "yes" | "no" | digit digit\ndigit ::= [0-9]'
    texts = sample(char_tokenizer(), constraints.Constraint.grammar(gbnf))
    assert all(re.fullmatch(r"yes|no|[0-9]{2}", t) for t in texts)


@pytest.mark.parametrize(
    "constraint, message",
    [
        (constraints.Constraint.json_schema("{not json"), "json_schema"),
        (constraints.Constraint.json_schema({"type": "nothing"}), "json_schema"),
        (
            constraints.Constraint.json_schema({"type": "string", "format": "x"}),
            "json_schema",
        ),
        (constraints.Constraint.regex("[a-"), "regex"),
        (constraints.Constraint.grammar("start: undefined_rule"), "grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_by_kind(constraint, message):
    masker = constraints.masker_for(char_tokenizer())
    with pytest.raises(constraints.ConstraintError, match=message) as raised:
        masker.compile(constraint)
    assert raised.value.kind == constraint.kind


def test_an_empty_choice_and_an_unknown_kind_are_refused():
    with pytest.raises(constraints.ConstraintError, match="non-empty list"):
        constraints.Constraint.choice([])
    with pytest.raises(constraints.ConstraintError, match="kind is one of"):
        constraints.Constraint("yaml", "a: 1")


def test_compiled_constraints_are_cached_by_their_text():
    masker = constraints.masker_for(char_tokenizer())
    first = masker.compile(constraints.Constraint.json_schema(SCHEMAS["person"]))
    again = masker.compile(
        constraints.Constraint.json_schema(json.dumps(SCHEMAS["person"]))
    )
    assert first is again
    assert constraints.masker_for(char_tokenizer()) is not masker  # per tokenizer


def test_without_end_of_text_a_row_ends_where_its_grammar_is_complete():
    tokenizer = data.CharTokenizer.train(string.ascii_lowercase + " ")
    assert tokenizer.eos_id is None
    masker = constraints.masker_for(tokenizer)
    row_constraint = constraints.row_constraint(
        masker, [constraints.Constraint.choice(["yes", "no"])] * 4
    )
    logits = jnp.zeros((4, tokenizer.vocab_size))
    out = decoding.generate(
        closing_step, logits, logits, (), key=jax.random.key(0), max_new_tokens=6,
        temperature=1.0, constraint=row_constraint,
    )  # fmt: skip
    for tokens, length, reason in zip(out.tokens, out.lengths, out.finish_reasons):
        assert tokenizer.decode(tokens[:length]) in ("yes", "no")
        assert reason == decoding.FINISHED_STOP


@pytest.fixture(scope="module")
def tiny_model():
    tokenizer = char_tokenizer()
    model = model_lib.DecoderLM(
        vocab_size=tokenizer.vocab_size, num_layers=1, num_heads=2, d_model=16,
        mlp_dim=32, max_len=16,
    )  # fmt: skip
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
    return model, params["params"], tokenizer


def test_continuations_follow_their_constraint_across_windows(tiny_model):
    model, params, tokenizer = tiny_model
    # A random model takes many tokens: the windows of 8 new tokens each
    # carry the automata on.
    for constraint, valid in (
        (constraints.Constraint.regex("[a-c]{3,20}"), lambda t: re.fullmatch("[a-c]{3,20}", t)),
        (constraints.Constraint.choice(CHOICES), lambda t: t in CHOICES),
    ):  # fmt: skip
        out = generation.continuations(
            model, params, tokenizer, "Q:", key=jax.random.key(1), num_samples=4,
            max_new_tokens=40, temperature=1.0, constraint=constraint,
        )  # fmt: skip
        for continuation in out:
            text = continuation.text[len("Q:") :]
            if continuation.finish_reason == "stop":
                assert valid(text), text
            else:  # cut by max_new_tokens: a prefix of a valid text
                assert len(continuation.tokens) == 40
    # Greedy under the constraint is the argmax of the masked logits (one
    # window: the prompt and 8 new tokens).
    short = ["yes", "no", "maybe", "nay"]
    out = generation.continuations(
        model, params, tokenizer, "Q:", key=jax.random.key(1), num_samples=1,
        max_new_tokens=8, temperature=0.0,
        constraint=constraints.Constraint.choice(short),
    )  # fmt: skip
    prompt, generated = tokenizer.encode("Q:"), []
    apply = jax.jit(model.apply)
    for token in out[0].tokens:
        logits = np.asarray(
            apply({"params": params}, jnp.asarray([prompt + generated]))
        )
        words = [tokenizer.encode(w) for w in short]
        going = [w for w in words if w[: len(generated)] == generated]
        options = {w[len(generated)] for w in going if len(w) > len(generated)}
        if generated in words:
            options.add(tokenizer.eos_id)
        masked = np.full(logits.shape[-1], -np.inf)
        masked[list(options)] = logits[0, -1, list(options)]
        assert token == int(np.argmax(masked))
        generated.append(token)
    assert out[0].finish_reason == "stop" and out[0].text[2:] in short


def test_continuations_refuse_a_constraint_with_beams(tiny_model):
    model, params, tokenizer = tiny_model
    with pytest.raises(ValueError, match="num_beams"):
        generation.continuations(
            model, params, tokenizer, "Q:", key=jax.random.key(1), num_samples=1,
            max_new_tokens=4, num_beams=2, constraint=constraints.Constraint.json_object(),
        )  # fmt: skip
