r"""A small decoder-only Transformer on the embedded Shakespeare corpus.

The argument ``nanogpt`` is nanoGPT's CPU example (``train_shakespeare_char``
with ``--device=cpu --block_size=64 --batch_size=12 --n_layer=4 --n_head=4
--n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0``): 4
layers, 4 heads, d_model 128, block 64, batch 12, 2000 steps, lr 1e-3 with 100
warmup steps and cosine decay to 1e-4, AdamW (0.9, 0.99), weight decay 0.1,
gradient clipping 1.0, dropout 0, no biases in the blocks and LayerNorms
(nanoGPT's ``bias=False``), characters, the last 10% of the text for
validation. The defaults are the same values but keep the biases
(``model.use_bias=True``, GPT-2's layout). The differences from nanoGPT
(weight decay, evaluations, the end-of-text token) are in
docs/nanogpt_parity.md.

Train, tied and untied (one command each)::

    python experiments/train.py --config=configs/default.py:nanogpt,tied \
        --workdir=runs/nanogpt_tied
    python experiments/train.py --config=configs/default.py:nanogpt,untied \
        --workdir=runs/nanogpt_untied

What they reach, and nanoGPT's own numbers, are in docs/nanogpt_parity.md;
``make compare`` measures tied against untied over seeds.

Arguments (comma-separated, applied left to right)::

    tied | untied   the head shares the embedding table, or owns one
    nanogpt         nanoGPT's CPU example, value by value (the defaults, no biases)
    compare         nanogpt for 600 steps, evaluated every 100 steps on 40
                    fixed validation batches, without the end-of-text token:
                    the runs of docs/large_vocab.md's rank table, which
                    make compare trained before it became the tying study's
                    small preset (configs/sweeps/tying_study.py:small, on
                    nanogpt: 1000 steps, every 50 steps on 16 batches)
    tiny            a few seconds on a CPU; for tests
    bpe=N           byte-level BPE with a vocabulary of N tokens
    steps=N         train for N steps (the cosine decay follows); the warmup
                    becomes at most N // 2 steps (SHORT_RUN_WARMUP), so that
                    a short run needs no --config.optim.warmup_steps, which
                    still wins when given

Any value can then be set on the command line, e.g.
``--config.model.d_model=256 --config.loss.label_smoothing=0.1``.
"""

import ml_collections
from ml_collections import config_dict

ARGUMENTS = ("tied", "untied", "nanogpt", "compare", "tiny", "bpe", "steps")
# steps=N shortens the warmup to at most this fraction of the N steps: it
# must end before the run does, and it leaves every run of at least twice
# the configured warmup (nanogpt: 200 steps) as it was.
SHORT_RUN_WARMUP = 0.5


def nanogpt_values() -> dict:
    """nanoGPT's CPU example, section by section."""
    return {
        "data": dict(tokenizer="char", val_fraction=0.1, block_size=64),
        "model": dict(
            num_layers=4,
            num_heads=4,
            d_model=128,
            mlp_dim=512,
            dropout_rate=0.0,
            positions="learned",
            use_bias=False,
            head_bias=False,
        ),
        "optim": dict(
            lr=1e-3,
            warmup_steps=100,
            min_lr=1e-4,
            weight_decay=0.1,
            b1=0.9,
            b2=0.99,
            grad_clip=1.0,
        ),
        "train": dict(steps=2000, batch_size=12, microbatches=2),
    }


def compare_values() -> dict:
    """nanogpt shortened to 600 steps, with an evaluation every 100 steps on
    40 fixed batches (480 evenly spaced validation windows), so that the loss
    curves have points to plot, and no end-of-text token: the runs that
    ``make compare`` trained before it ran the tying study's ``small``
    preset, and that docs/large_vocab.md's rank table was measured on."""
    values = nanogpt_values()
    # Those runs had no end-of-text token.
    values["data"] = dict(values["data"], end_of_text=False)
    values["train"] = dict(
        values["train"],
        steps=600,
        eval_every=100,
        eval_batches=40,
        checkpoint_every=300,
    )
    return values


def tiny_values() -> dict:
    """Seconds on a CPU: a 1-layer model, 40 steps, short samples."""
    return {
        "data": dict(block_size=16),
        "model": dict(num_layers=1, num_heads=2, d_model=32, mlp_dim=64),
        "optim": dict(lr=3e-3, warmup_steps=5, min_lr=3e-4),
        "train": dict(
            steps=40,
            batch_size=8,
            log_every=10,
            eval_every=20,
            checkpoint_every=20,
            eval_batches=2,
        ),
        "sample": dict(num_samples=2, max_new_tokens=24, prompt="KING"),
    }


def data_defaults() -> ml_collections.ConfigDict:
    """The defaults of ``config.data``."""
    data = ml_collections.ConfigDict()
    data.path = ""  # "" is the embedded Shakespeare; else a UTF-8 file
    data.tokenizer = "char"  # "char" | "bpe"
    data.vocab_size = config_dict.placeholder(int)  # bpe only
    # "tail": the last val_fraction of the text is validation, no test split
    # (nanoGPT's). "works": whole works to train / validation / test, about
    # val_fraction and test_fraction of the characters (lmhead/lm/data/corpus.py
    # says which); a plain text file is cut into blocks train | val | test.
    data.split = "tail"
    data.val_fraction = 0.1
    data.test_fraction = 0.1  # split="works" only
    # The fraction of the training split that is trained on (and BPE is
    # trained on it): the data-limited regime.
    data.train_fraction = 1.0
    # Where that fraction starts, as a fraction of the training split: subsets
    # at other places in the corpus, so that a result is not one location's.
    # train_offset + train_fraction <= 1.
    data.train_offset = 0.0
    # The first fraction of the training split that BPE is trained on, from
    # its start whatever train_offset is; None: the used training text. An
    # ensemble whose members train on different text shares one tokenizer,
    # trained on a prefix that covers all of it (lmhead/lm/members.py).
    data.tokenizer_fraction = config_dict.placeholder(float)
    # Held-out windows of the training plays: every round(1 / holdout_fraction)-th
    # chunk of holdout_chunk characters of the training split is left out of
    # training and evaluated (heldout/...; docs/training.md). 0: none.
    data.holdout_fraction = 0.0
    data.holdout_chunk = 1024
    # GPT-2's end-of-text token <|endoftext|> after each work of the embedded
    # corpus (a text file: where its own literals stand), the last id of both
    # tokenizers; generation stops at it. False: no such token (a saved config
    # without the key reads as False).
    data.end_of_text = True
    data.block_size = 64
    return data


def model_defaults() -> ml_collections.ConfigDict:
    """The defaults of ``config.model``."""
    model = ml_collections.ConfigDict()
    model.num_layers = 4
    model.num_heads = 4
    model.d_model = 128
    model.mlp_dim = 512
    model.dropout_rate = 0.0
    model.tied = True
    model.positions = "learned"  # "learned" | "rope"
    model.use_bias = True  # in blocks and LayerNorms; nanogpt: False
    model.head_bias = False
    # A factorized head of this rank, w = A @ B with A [V, r] and B [r, D]
    # (tied: the input embedding is factorized the same way and shared);
    # None: a [V, D] head. lmhead/modules.py's docstring has the savings.
    model.head_rank = config_dict.placeholder(int)
    model.head_scale = config_dict.placeholder(float)
    model.logits_softcap = config_dict.placeholder(float)
    model.dtype = "float32"  # compute dtype: "float32" | "bfloat16"
    # The MLP's GELU: "gelu" (exact) | "gelu_tanh" (GPT-2's tanh form, which
    # runs imported by experiments/import_gpt2.py compute).
    model.activation = "gelu"
    # Attention over a sequence (training, scoring; decoding reads the cache in
    # XLA): "xla" (the softmax written out) | "cudnn" (flash attention through
    # jax.nn.dot_product_attention: an NVIDIA GPU, model.dtype bfloat16; with
    # dropout_rate > 0 training writes the weights out in XLA) | "auto"
    # (cuDNN's where it runs, else XLA's). The two agree to rounding; a run may
    # resume, or be loaded, with the other.
    model.attention_implementation = "auto"
    # Untied models only: the steps before this one train tied (the embedding
    # table is the head), then the head starts as a copy of the table, with
    # the table's AdamW moments, and trains on its own (lmhead/lm/train.py's
    # train_step). None: untied from the start.
    model.untie_step = config_dict.placeholder(int)
    # Multi-token prediction (lmhead/lm/mtp.py): k further heads, depth i
    # predicting the token i past the next one; 0 is the plain model.
    # "sequential" (DeepSeek-V3's chained modules) | "parallel" (Gloeckle et
    # al.'s blocks on the trunk); their unembedding "shared" (the main head's)
    # | "own" (one [V, D] table for the depths). loss.mtp_weight weighs them.
    model.mtp_heads = 0
    model.mtp_design = "sequential"
    model.mtp_unembedding = "shared"
    return model


def loss_defaults() -> ml_collections.ConfigDict:
    """The defaults of ``config.loss``."""
    loss = ml_collections.ConfigDict()
    # "materialized" | "fused" (no [N, V] logits) | "vocab_parallel" (the
    # vocabulary split over mesh.model): the same losses to float32 rounding
    # (docs/fused_loss.md). Evaluation builds one batch's logits whatever it
    # says: the calibration error (eval/ece) needs every token's probability.
    loss.loss_impl = "fused"
    loss.label_smoothing = 0.0
    loss.smoothing = "uniform"  # "uniform" | "normalized"
    loss.z_loss = 0.0
    loss.chunk_size = config_dict.placeholder(int)  # blocked losses only
    # Gradient filtering of loss_impl="fused" (docs/fused_loss.md, "Gradient
    # filtering and dw's accumulation"): None, the exact gradient; a number
    # >= 0 or "auto" (finfo(dtype).eps / 32 of the head's inputs): a tile
    # of tokens x vocabulary rows whose every |p - onehot| is below it adds
    # nothing to the gradients loss.filter_target names ("both" | "dh" |
    # "dw"). The loss and the metrics stay exact. docs/training.md has what
    # it did to the compare config's test bits/char.
    loss.filter_eps = config_dict.placeholder(object)
    loss.filter_target = "both"
    # The fused sweep's row order of the vocabulary (docs/fused_loss.md,
    # "Vocabulary sorting"), invisible to the loss and its gradients: None
    # (the table's), "frequency" (the training split's token counts, most
    # frequent first, counted once) or "mean_logit" (each step's rows by
    # their mean logit over its batch). It changes which tiles a filter skips.
    loss.vocab_order = config_dict.placeholder(str)
    # lambda of the MTP loss, CE_main + lambda / k * sum_i CE_i (model.mtp_heads
    # = k > 0; DeepSeek-V3's 0.3).
    loss.mtp_weight = 0.3
    return loss


def optim_defaults() -> ml_collections.ConfigDict:
    """The defaults of ``config.optim``."""
    optim = ml_collections.ConfigDict()
    optim.lr = 1e-3
    optim.warmup_steps = 100
    optim.min_lr = 1e-4  # end of the cosine decay, at train.steps
    optim.weight_decay = 0.1  # dense kernels only
    optim.b1 = 0.9
    optim.b2 = 0.99
    optim.grad_clip = 1.0  # global norm; 0 turns clipping off
    # The [V, D] tables (the embedding and the untied head's unembedding)
    # train at this multiple of the schedule's rate; the rest at the rate.
    optim.table_lr_multiplier = 1.0
    return optim


def mesh_defaults() -> ml_collections.ConfigDict:
    """The defaults of ``config.mesh``."""
    # Devices: data * model must be all of them (-1: the rest). "data" splits
    # the batch; "model" splits the vocabulary of the [V, D] tables.
    mesh = ml_collections.ConfigDict()
    mesh.data = -1
    mesh.model = 1
    # An ensemble's members split over this many devices (shard_map; the
    # rest: data and model). None: on a CPU, the most CPU devices that divide
    # the members; 1 on a GPU or TPU (docs/training.md, "Speed of an ensemble").
    mesh.members = config_dict.placeholder(int)
    return mesh


def train_defaults() -> ml_collections.ConfigDict:
    """The defaults of ``config.train``."""
    train = ml_collections.ConfigDict()
    train.steps = 2000
    train.batch_size = 12
    # Gradient accumulation over this many microbatches of each batch (the
    # same step up to rounding; docs/nanogpt_parity.md, "Microbatches and CPU
    # devices", says when it pays).
    train.microbatches = 1
    # An ensemble's members in one vmap; the rest go one group after another
    # in a lax.map. None: 1 on a CPU, all of them on a GPU or TPU (the same
    # results to float32 rounding).
    train.vmap_members = config_dict.placeholder(int)
    train.seed = 0
    train.log_every = 100
    train.eval_every = 500
    train.checkpoint_every = 500
    # Batches of evenly spaced validation windows; None: the whole split.
    # Each evaluation also reports the standard error of its loss.
    train.eval_batches = config_dict.placeholder(int)
    # Batches of evenly spaced training windows evaluated with validation
    # (train_eval/...), for the train-validation gap; 0: none.
    train.eval_train_batches = 0
    # Stop after this many evaluations in a row without a lower validation
    # loss, keeping the best one's checkpoint (best_checkpoint/); 0: never.
    train.patience = 0
    # Evaluate once on the whole test split after training, with the best
    # parameters when patience > 0 (else the last). None: when split="works".
    train.test_eval = config_dict.placeholder(bool)
    # A non-finite loss, gradient norm or parameter stops the run with an
    # error naming the step, before anything is saved.
    train.stop_on_nonfinite = True
    return train


def sample_defaults() -> ml_collections.ConfigDict:
    """The defaults of ``config.sample``."""
    sample = ml_collections.ConfigDict()
    sample.num_samples = 2
    sample.max_new_tokens = 300
    sample.temperature = 0.8  # 0 is greedy
    sample.top_k = config_dict.placeholder(int)
    sample.top_p = config_dict.placeholder(float)
    sample.prompt = "\n"
    return sample


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The config for ``arg``, a comma-separated list of ARGUMENTS."""
    config = ml_collections.ConfigDict()
    config.data = data_defaults()
    config.model = model_defaults()
    config.loss = loss_defaults()
    config.optim = optim_defaults()
    config.mesh = mesh_defaults()
    config.train = train_defaults()
    config.sample = sample_defaults()
    for name, value in _parse(arg):
        if name in ("tied", "untied"):
            config.model.tied = name == "tied"
        elif name == "nanogpt":
            config.update(nanogpt_values())
        elif name == "compare":
            config.update(compare_values())
        elif name == "tiny":
            config.update(tiny_values())
        elif name == "bpe":
            config.data.tokenizer = "bpe"
            config.data.vocab_size = value
        elif name == "steps":
            config.train.steps = value
            config.optim.warmup_steps = min(
                config.optim.warmup_steps, int(value * SHORT_RUN_WARMUP)
            )
    config.lock()
    return config


def _parse(arg: str | None) -> list[tuple[str, int | None]]:
    """``"tied,bpe=2048"`` -> ``[("tied", None), ("bpe", 2048)]``."""
    parsed = []
    for item in filter(None, (arg or "").split(",")):
        name, _, value = item.partition("=")
        if name not in ARGUMENTS:
            raise ValueError(
                f"Unknown config argument {item!r}; the arguments "
                f"are {', '.join(ARGUMENTS)}."
            )
        takes_value = name in ("bpe", "steps")
        if takes_value != bool(value):
            usage = f"{name}=N" if takes_value else name
            raise ValueError(f"Config argument {item!r}: write it as {usage}.")
        try:
            parsed.append((name, int(value) if takes_value else None))
        except ValueError as e:
            raise ValueError(f"Config argument {item!r}: N must be an integer.") from e
    return parsed
