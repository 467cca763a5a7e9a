r"""Sweep file: tied vs untied head across vocabulary sizes and widths, for a
bigger machine; ``experiments/sweep.py`` runs it.

2 heads x 5 vocabularies (characters; byte-level BPE with 1024, 2048, 4096,
8192 tokens) x 2 widths (d_model 128 and 256, MLP 4x) x 3 seeds = 60 runs of
``configs/default.py:nanogpt`` trained for 5000 steps. Seeds are the outer
loop, so an interrupted sweep already has every setting once.

On one GPU, several runs at a time (each process takes a tenth of the
memory instead of JAX's default three quarters)::

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 python experiments/sweep.py \
        --sweep=configs/sweeps/tied_vs_untied_large.py \
        --workdir=runs/tied_vs_untied_large --parallel=6

On a cluster: ``--dry_run`` prints the 60 commands, one a line, for a Slurm
array or ``parallel -j N``; then ``python experiments/report.py
--workdir=runs/tied_vs_untied_large``.

Arguments (comma-separated ``key=value``; ``+`` separates list items)::

    base=nanogpt                configs/default.py argument(s) for every run
    steps=5000                  training steps per run
    seeds=3                     seeds 0 .. seeds-1
    bpe=1024+2048+4096+8192     BPE vocabulary sizes
    d_model=128+256             widths; the MLP is 4 x d_model
"""

from lmhead.lab import sweeps

DEFAULTS = dict(
    base=("nanogpt",),
    steps=5000,
    seeds=3,
    bpe=(1024, 2048, 4096, 8192),
    d_model=(128, 256),
)


def get_sweep(arg=None):
    args = sweeps.parse_arg(arg, DEFAULTS)
    base = ",".join([*args["base"], f"steps={args['steps']}"])
    widths = sweeps.zipped(
        sweeps.sweep("model.d_model", list(args["d_model"])),
        sweeps.sweep("model.mlp_dim", [4 * d for d in args["d_model"]]),
    )
    vocabularies = [{"data.tokenizer": "char"}] + [
        {"data.tokenizer": "bpe", "data.vocab_size": size} for size in args["bpe"]
    ]
    return base, sweeps.product(
        sweeps.sweep("train.seed", list(range(args["seeds"]))),
        widths,
        vocabularies,
        sweeps.sweep("model.tied", [True, False]),
    )
