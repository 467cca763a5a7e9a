r"""Turns a Hugging Face GPT-2-layout directory into an lmhead run directory.

    python experiments/import_gpt2.py --from=path/to/gpt2 --workdir=runs/gpt2
    python experiments/generate.py --workdir=runs/gpt2 --prompt="Hello" --temperature=0
    python experiments/score.py --workdir=runs/gpt2 --file=a.txt
    python experiments/serve.py --workdir=runs/gpt2

``--from`` holds ``config.json``, ``model.safetensors`` (or its sharded
index) and ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``), as
Hugging Face saves GPT-2; nothing is downloaded, and neither torch nor
transformers is needed. ``lmhead/lm/gpt2_import.py`` says which
``config.json`` fields are read, refused and ignored; ``docs/gpt2_checkpoints.md``
what an import costs.
"""

import cli  # experiments/cli.py, beside this file
from absl import app, flags

from lmhead.lm import gpt2_import

flags.DEFINE_string(
    "from", None, "A Hugging Face GPT-2-layout directory.", required=True
)
cli.workdir_flag()  # the run to write: new, or without checkpoints


def main(argv):
    f = cli.start(argv)
    run = gpt2_import.import_gpt2(f["from"].value, f.workdir)
    model = run.config.model
    print(
        f"Imported {f['from'].value} into {run.workdir} in {run.seconds:.1f} s: "
        f"{model.num_layers} layers, d_model {model.d_model}, {model.num_heads} "
        f"heads, MLP {model.mlp_dim}, {model.activation}, context "
        f"{run.config.data.block_size}, vocabulary {run.config.data.vocab_size}, "
        f"{'tied' if model.tied else 'untied'} head, end-of-text id {run.eos_id}."
    )
    if run.ignored:
        print(f"Ignored config.json fields: {', '.join(run.ignored)}.")


if __name__ == "__main__":
    app.run(main)
