r"""Tied vs untied head, over characters and BPE, three seeds: ``make compare``.

    python experiments/sweep.py --sweep=configs/sweeps/tied_vs_untied.py \
        --workdir=runs/tied_vs_untied

2 heads (tied, untied) x 2 vocabularies (84 characters; byte-level BPE with
2048 tokens, where the untied head's [V, D] table is a large share of the
parameters) x 3 seeds = 12 runs of ``configs/default.py:compare`` (nanoGPT's
model and recipe, shortened to ``steps`` steps and evaluated every 100).
Seeds are the outer loop, so an interrupted sweep already has every setting
once.

Arguments (comma-separated ``key=value``; ``+`` separates list items)::

    base=compare      configs/default.py argument(s) every run starts from
    steps=600         training steps per run
    seeds=3           seeds 0 .. seeds-1
    bpe=2048          BPE vocabulary sizes, e.g. bpe=512+2048; bpe= for none

e.g. ``--sweep=configs/sweeps/tied_vs_untied.py:base=tiny,steps=40,seeds=2``
for a check in about a minute.
"""

from lmhead import sweeps

DEFAULTS = dict(base=("compare",), steps=600, seeds=3, bpe=(2048,))


def vocabularies(bpe_sizes) -> list[dict]:
    """Characters, then byte-level BPE at each size."""
    return [{"data.tokenizer": "char"}] + [
        {"data.tokenizer": "bpe", "data.vocab_size": size} for size in bpe_sizes]


def get_sweep(arg=None):
    args = sweeps.parse_arg(arg, DEFAULTS)
    base = ",".join([*args["base"], f"steps={args['steps']}"])
    return base, sweeps.product(
        sweeps.sweep("train.seed", list(range(args["seeds"]))),
        vocabularies(args["bpe"]),
        sweeps.sweep("model.tied", [True, False]))
