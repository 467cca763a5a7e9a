r"""Continues a prompt with a trained run's newest checkpoint and tokenizer.

    python experiments/generate.py --workdir=runs/nanogpt_tied \
        --prompt="ROMEO:" --max_new_tokens=200 --temperature=0.8 --top_k=40
    python experiments/generate.py --workdir=runs/nanogpt_tied \
        --prompt="ROMEO:" --num_beams=4           # beam search
    python experiments/generate.py --workdir=... --temperature=0   # greedy
    python experiments/generate.py --workdir=... --quantize=int8   # int8 head
    python experiments/generate.py --workdir=... --stop='\n\n' --stop=ROMEO: \
        --presence_penalty=0.5 --frequency_penalty=0.3 --top_logprobs=3
    python experiments/generate.py --workdir=... --json_schema=person.json
    python experiments/generate.py --workdir=... --regex='[A-Z][a-z]+, [0-9]{4}'
    python experiments/generate.py --workdir=... --choice=yes --choice=no
    python experiments/generate.py --workdir=... --grammar=arithmetic.lark
    python experiments/generate.py --workdir=... --speculative=ngram \
        --num_speculative_tokens=4      # prompt lookup: same tokens, faster
    python experiments/generate.py --workdir=runs/mtp --speculative=mtp  # MTP heads

A sample ends at the run's end-of-text token (``<|endoftext|>``, which new
runs put between works), which is not printed; ``--ignore_eos`` goes on past
it and prints it. A stop string ends a sample and is not printed, nor what
follows it; its
``\n``, ``\t`` and ``\uXXXX`` escapes are read as in Python. With
``--top_logprobs=k`` each sample's text is followed by one line per
generated token: the token and its step's ``k`` likeliest tokens with their
log-probabilities. ``--json_schema``, ``--regex``, ``--choice`` and
``--grammar`` (at most one) constrain every sample's continuation
(``lmhead.lm.constraints``, docs/decoding.md). ``--speculative`` decodes
speculatively (docs/decoding.md, "Speculative decoding"): the same text
greedily, the same distribution sampled; a constrained sample is not
speculated, and beam search refuses it. After the text it prints, on stderr, the time to first
token (prefill and one step) and the milliseconds per new token of the
compiled programs.
"""

import sys

import cli  # experiments/cli.py, beside this file
import jax
from absl import app, flags

from lmhead.decoding import knobs
from lmhead.lm import constraints, generation

cli.workdir_flag()
flags.DEFINE_string("prompt", "\n", "Text to continue.")
flags.DEFINE_integer("max_new_tokens", 200, "Tokens to add.", lower_bound=1)
flags.DEFINE_integer("num_samples", 1, "Continuations to print.", lower_bound=1)
flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 is greedy.")
flags.DEFINE_integer("top_k", None, "Sample among the k likeliest tokens (0: all).")
flags.DEFINE_float("top_p", None, "Sample from the smallest set of mass >= p.")
flags.DEFINE_integer(
    "num_beams",
    None,
    "Beam search with this many beams (ignores the sampling flags).",
    lower_bound=1,
)
flags.DEFINE_multi_string(
    "stop", None, "A stop string (repeat the flag for several); escapes as in Python."
)
flags.DEFINE_float(
    "presence_penalty", None, "Subtract this from the logit of every generated token."
)
flags.DEFINE_float(
    "frequency_penalty",
    None,
    "Subtract this times its count from the logit of every generated token.",
)
flags.DEFINE_integer(
    "top_logprobs", 0, "Print this many likeliest tokens per step.", lower_bound=0
)
flags.DEFINE_bool(
    "ignore_eos",
    False,
    "Go on past the end-of-text token instead of ending the sample there.",
)
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_enum(
    "quantize",
    None,
    ["int8", "bfloat16", "float16"],
    "Decode with the head's table in this type (the embedding lookup keeps float32).",
)
flags.DEFINE_string(
    "json_schema", None, "A JSON Schema file every continuation must follow."
)
flags.DEFINE_string("regex", None, "A regex every continuation must match whole.")
flags.DEFINE_multi_string(
    "choice", None, "A string a continuation must be (repeat the flag for each)."
)
flags.DEFINE_string(
    "grammar", None, "A Lark or GBNF grammar file every continuation must follow."
)
flags.register_multi_flags_validator(
    ["json_schema", "regex", "choice", "grammar"],
    lambda values: sum(v is not None for v in values.values()) <= 1,
    message="give at most one of --json_schema, --regex, --choice and --grammar.",
)
flags.DEFINE_enum(
    "speculative",
    None,
    list(generation.SPECULATIVE),
    "Speculative decoding: proposals from the run's MTP heads or from n-gram "
    "lookup in the text so far.",
)
flags.DEFINE_integer(
    "num_speculative_tokens", 3, "Proposals per model call with --speculative."
)
flags.DEFINE_bool(
    "timings",
    True,
    "Report time to first token and ms per new token on stderr (of "
    "speculative decoding with --speculative).",
)
SAMPLING_FLAGS = (
    "temperature",
    "top_k",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
)


def knob_validator(name: str):
    """The check of flag ``name``: the range and message of the sampling knob
    of that name (``lmhead.decoding.knobs``), as the library applies them."""

    def check(value) -> bool:
        try:
            knobs.check_knob(name, value)
        except (ValueError, TypeError) as error:
            raise flags.ValidationError(str(error)) from None
        return True

    return check


for _name in SAMPLING_FLAGS:
    flags.register_validator(_name, knob_validator(_name))


def unescape(text: str) -> str:
    """``text`` with Python's backslash escapes read (``\\n`` -> newline);
    other characters stay as they are."""
    return text.encode("raw_unicode_escape").decode("unicode_escape")


def top_logprobs_lines(continuation, tokenizer) -> str:
    """One line per generated token and its step's likeliest tokens; empty
    when there are none."""
    lines = [
        f"{tokenizer.decode([token])!r}: "
        + " ".join(f"{alt!r} {p:.3f}" for alt, p in top)
        for token, top in zip(
            continuation.tokens, continuation.top_logprobs, strict=True
        )
        if top
    ]
    return "".join("\n" + line for line in lines)


def read_constraint(f) -> constraints.Constraint | None:
    """The constraint the flags give, or None; its files read as UTF-8."""
    if f.json_schema is not None:
        with open(f.json_schema, encoding="utf-8") as file:
            return constraints.Constraint.json_schema(file.read())
    if f.grammar is not None:
        with open(f.grammar, encoding="utf-8") as file:
            return constraints.Constraint.grammar(file.read())
    if f.regex is not None:
        return constraints.Constraint.regex(f.regex)
    if f.choice is not None:
        return constraints.Constraint.choice(f.choice)
    return None


def _continuations(f, model, params, tokenizer, stop):
    return generation.continuations(
        model,
        params,
        tokenizer,
        f.prompt,
        key=jax.random.key(f.seed),
        num_samples=f.num_samples,
        max_new_tokens=f.max_new_tokens,
        temperature=f.temperature,
        top_k=f.top_k,
        top_p=f.top_p,
        num_beams=f.num_beams,
        stop=stop,
        presence_penalty=f.presence_penalty,
        frequency_penalty=f.frequency_penalty,
        top_logprobs=f.top_logprobs,
        ignore_eos=f.ignore_eos,
        constraint=read_constraint(f),
        speculative=f.speculative,
        num_speculative_tokens=f.num_speculative_tokens,
    )


def main(argv):
    f = cli.start(argv)
    _, tokenizer, model, params = generation.load_run(f.workdir)
    if f.quantize:
        params = generation.quantize_for_decoding(model, params, f.quantize)
    stop = [unescape(s) for s in f.stop] if f.stop else None
    try:  # refused by name before anything compiles
        speculative = generation.proposer(
            model, f.speculative, f.num_speculative_tokens, f.num_beams
        )
    except ValueError as error:
        raise app.UsageError(f"--{error}") from None
    try:
        continuations = _continuations(f, model, params, tokenizer, stop)
    except constraints.ConstraintError as error:
        raise app.UsageError(f"--{error}") from None  # "--regex: ..."
    texts = [c.text + top_logprobs_lines(c, tokenizer) for c in continuations]
    print(generation.SAMPLE_SEPARATOR.join(texts), flush=True)
    if f.timings:
        prompt, new_tokens = generation.timing_prompt(
            model, tokenizer, f.prompt, f.num_samples, f.max_new_tokens
        )
        timings = generation.time_generation(
            model,
            params,
            prompt,
            max_new_tokens=new_tokens,
            temperature=f.temperature,
            top_k=f.top_k,
            top_p=f.top_p,
            key=jax.random.key(f.seed),
            speculative=speculative,
        )
        print(generation.format_timings(timings, f.num_samples), file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
