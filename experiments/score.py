r"""Scores texts under a trained run: nats, bits per character, perplexity.

    python experiments/score.py --workdir=runs/nanogpt_tied --file=a.txt --file=b.txt
    python experiments/score.py --workdir=runs/nanogpt_tied --text="To be, or not to be"
    python experiments/score.py --workdir=... --file=a.txt --json --per_token=a.tsv
    python experiments/score.py --workdir=... --file=a.txt --prefix_eos

A text longer than the model's context is scored window by window (see
``lmhead/lm/scoring.py``); ``--stride`` trades context for time. The first
token is only context, unless ``--prefix_eos`` puts the run's end-of-text
token before the text (as each work follows it in training, and as
lm-evaluation-harness's rolling log-likelihood does). The end-of-text token
counts no characters in bits per character.
"""

import cli  # experiments/cli.py, beside this file
from absl import app, flags

from lmhead.lm import generation, scoring

cli.workdir_flag()
flags.DEFINE_multi_string("file", [], "UTF-8 text file to score (repeatable).")
flags.DEFINE_multi_string("text", [], "Text to score (repeatable).")
flags.DEFINE_integer(
    "stride",
    None,
    "Tokens between window starts, in [1, max_len]; default max_len // 2.",
    lower_bound=1,
)
flags.DEFINE_integer("batch_size", 8, "Windows per model call.", lower_bound=1)
flags.DEFINE_string(
    "per_token",
    None,
    "Write a TSV of (name, token, log_prob) of every scored token to this path.",
)
flags.DEFINE_bool("json", False, "Print the totals as JSON.")
flags.DEFINE_bool(
    "prefix_eos",
    False,
    "Score the text after the run's end-of-text token, its first token included.",
)


def main(argv):
    f = cli.start(argv)
    if not f.file and not f.text:
        raise app.UsageError("Give --file=PATH or --text=TEXT (either repeatable).")
    _, tokenizer, model, params = generation.load_run(f.workdir)
    sources = scoring.read_texts(f.file, f.text)
    scores = [
        scoring.score_text(
            model,
            params,
            tokenizer,
            text,
            name=name,
            stride=f.stride,
            batch_size=f.batch_size,
            prefix_eos=f.prefix_eos,
        )
        for name, text in sources
    ]
    if f.per_token:
        scoring.write_token_table(f.per_token, scores)
    print(
        scoring.format_json(scores)
        if f.json
        else "\n".join(scoring.format_score(s) for s in scores)
    )


if __name__ == "__main__":
    app.run(main)
