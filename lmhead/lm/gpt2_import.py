"""GPT-2-layout checkpoints from a Hugging Face directory, as lmhead runs.

:func:`import_gpt2` turns a directory in Hugging Face's GPT-2 layout
(``config.json``, ``model.safetensors`` or its shards, ``tokenizer.json`` or
``vocab.json`` + ``merges.txt``) into a run directory like the ones training
writes, which ``generation.load_run`` loads as any run. Weights are read with
``safetensors``' numpy API and the tokenizer with ``tokenizers``, without torch
or transformers. docs/gpt2_checkpoints.md lists the names and their params, the
``config.json`` fields read, refused and ignored, and what the run holds.

References:
    Radford et al. 2019, "Language Models are Unsupervised Multitask
    Learners" (GPT-2); Hugging Face ``transformers``' ``modeling_gpt2.py``
    and ``configuration_gpt2.py`` (the names, the layout, the defaults).
"""

import functools
import json
import math
import os
import re
import shutil
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tokenizers
from safetensors import safe_open
from tokenizers import decoders, models, pre_tokenizers, processors

from lmhead.lm import checkpoints, configuration, data, versions
from lmhead.lm import model as model_lib
from lmhead.lm import state as state_lib

END_OF_TEXT = data.END_OF_TEXT
# What a run directory gets besides checkpoints/ and the project's files.
IMPORT_FILE = "import.json"
# Hugging Face's tokenizer settings, copied as they are when present: the
# service reads its chat_template (lmhead/serve/chat.py).
TOKENIZER_CONFIG = "tokenizer_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# config.json fields that must be present.
REQUIRED = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
# Fields read when present, with Hugging Face's GPT2Config defaults.
OPTIONAL = {
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
    "eos_token_id": None,
    "model_type": "gpt2",
    "reorder_and_upcast_attn": False,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
}
READ = REQUIRED + tuple(OPTIONAL)
# Hugging Face's names of the GELUs lmhead has: layers.ACTIVATIONS.
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}
# Fields that lmhead's model computes one way only: the value it computes.
REQUIRED_VALUES = {
    "model_type": "gpt2",
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
}
# Hugging Face's names (without "transformer.") -> model.DecoderLM's params.
TOP_WEIGHTS = {
    "wte.weight": ("embed", "embedding"),
    "wpe.weight": ("position_embedding",),
    "ln_f.weight": ("final_norm", "scale"),
    "ln_f.bias": ("final_norm", "bias"),
}
# The same for the names of each block after "h.{i}.", under blocks_{i}.
LAYER_WEIGHTS = {
    "ln_1.weight": ("attention_norm", "scale"),
    "ln_1.bias": ("attention_norm", "bias"),
    "attn.c_attn.weight": ("attention", "qkv", "kernel"),
    "attn.c_attn.bias": ("attention", "qkv", "bias"),
    "attn.c_proj.weight": ("attention", "out", "kernel"),
    "attn.c_proj.bias": ("attention", "out", "bias"),
    "ln_2.weight": ("mlp_norm", "scale"),
    "ln_2.bias": ("mlp_norm", "bias"),
    "mlp.c_fc.weight": ("mlp_in", "kernel"),
    "mlp.c_fc.bias": ("mlp_in", "bias"),
    "mlp.c_proj.weight": ("mlp_out", "kernel"),
    "mlp.c_proj.bias": ("mlp_out", "bias"),
}
# The attention's causal-mask buffers, which older checkpoints hold.
BUFFERS = re.compile(r"h\.\d+\.attn\.(masked_)?bias")


class GPT2Config(NamedTuple):
    """What lmhead reads of a GPT-2 ``config.json``.

    Attributes:
        vocab_size: ``V``.
        n_positions: ``P``, the context (the model's ``max_len``).
        n_embd: ``D``.
        n_layer: ``L``.
        n_head: ``H``, dividing ``D``.
        n_inner: ``F``, the MLP's width.
        activation: one of ``layers.ACTIVATIONS``.
        tied: the head is the token table.
        eos_token_id: the end-of-text id, ``<|endoftext|>``'s, or None.
        ignored: the fields not read, sorted.
    """

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    activation: str
    tied: bool
    eos_token_id: int | None
    ignored: tuple[str, ...]


def read_config(source: str) -> GPT2Config:
    """The :class:`GPT2Config` of ``source/config.json`` (:func:`parse_config`).

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: as :func:`parse_config`.
    """
    path = os.path.join(source, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{source} has no config.json.")
    with open(path, encoding="utf-8") as f:
        fields = json.load(f)
    return parse_config(fields, path)


def parse_config(fields: dict, path: str = "config.json") -> GPT2Config:
    """The :class:`GPT2Config` of a GPT-2 ``config.json``'s ``fields``.

    Raises:
        ValueError: a required field is missing, a field has a value of the
            wrong type, or one lmhead cannot represent
            (docs/gpt2_checkpoints.md lists them); the message names
            ``path`` and the field.

    Examples:
        >>> fields = dict(vocab_size=50257, n_positions=1024, n_embd=768,
        ...               n_layer=12, n_head=12, n_ctx=1024, resid_pdrop=0.1)
        >>> gpt2 = parse_config(fields)
        >>> gpt2.n_inner, gpt2.activation, gpt2.tied, gpt2.ignored
        (3072, 'gelu_tanh', True, ('n_ctx', 'resid_pdrop'))
        >>> parse_config({**fields, "activation_function": "relu"})
        Traceback (most recent call last):
        ...
        ValueError: config.json: activation_function='relu' is not supported; lmhead's MLP computes the GELUs 'gelu', 'gelu_python', 'gelu_new', 'gelu_pytorch_tanh', 'gelu_fast'.
    """
    if not isinstance(fields, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    for name in REQUIRED:
        if name not in fields:
            raise ValueError(f"{path}: the field {name} is missing; GPT-2 has it.")
        _check_count(path, name, fields[name])
    values = {**OPTIONAL, **{k: fields[k] for k in OPTIONAL if k in fields}}
    for name, wanted in REQUIRED_VALUES.items():
        if values[name] != wanted:
            raise ValueError(
                f"{path}: {name}={values[name]!r} is not supported; lmhead's "
                f"model computes GPT-2's {name}={wanted!r} only."
            )
    activation = values["activation_function"]
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(
            f"{path}: activation_function={activation!r} is not supported; "
            f"lmhead's MLP computes the GELUs {', '.join(map(repr, ACTIVATIONS))}."
        )
    epsilon = values["layer_norm_epsilon"]
    if not isinstance(epsilon, (int, float)) or not math.isclose(
        epsilon, model_lib.LAYER_NORM_EPSILON, rel_tol=1e-6
    ):
        raise ValueError(
            f"{path}: layer_norm_epsilon={epsilon!r} is not supported; "
            f"lmhead's LayerNorm uses {model_lib.LAYER_NORM_EPSILON}."
        )
    n_inner = values["n_inner"]
    if n_inner is None:
        n_inner = 4 * fields["n_embd"]
    _check_count(path, "n_inner", n_inner)
    if fields["n_embd"] % fields["n_head"]:
        raise ValueError(
            f"{path}: n_head={fields['n_head']} must divide n_embd={fields['n_embd']}."
        )
    for name in ("tie_word_embeddings", "reorder_and_upcast_attn"):
        if not isinstance(values[name], bool):
            raise ValueError(f"{path}: {name} must be true or false.")
    eos = values["eos_token_id"]
    if eos is not None and (
        isinstance(eos, bool) or not isinstance(eos, int) or eos < 0
    ):
        raise ValueError(f"{path}: eos_token_id must be a token id; got {eos!r}.")
    return GPT2Config(
        vocab_size=fields["vocab_size"],
        n_positions=fields["n_positions"],
        n_embd=fields["n_embd"],
        n_layer=fields["n_layer"],
        n_head=fields["n_head"],
        n_inner=n_inner,
        activation=ACTIVATIONS[activation],
        tied=values["tie_word_embeddings"],
        eos_token_id=eos,
        ignored=tuple(sorted(k for k in fields if k not in READ)),
    )


def _check_count(path: str, name: str, value: Any) -> None:
    """ValueError unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: {name} must be an integer >= 1; got {value!r}.")


def weight_paths(gpt2: GPT2Config) -> dict[str, tuple[str, ...]]:
    """Every weight's name (without ``transformer.``) and its path in
    ``model.DecoderLM``'s params.

    Examples:
        >>> gpt2 = GPT2Config(17, 8, 4, 1, 2, 16, "gelu", True, None, ())
        >>> paths = weight_paths(gpt2)
        >>> len(paths), paths["h.0.attn.c_attn.weight"]
        (16, ('blocks_0', 'attention', 'qkv', 'kernel'))
    """
    paths = dict(TOP_WEIGHTS)
    for i in range(gpt2.n_layer):
        paths.update(
            {f"h.{i}.{name}": (f"blocks_{i}", *p) for name, p in LAYER_WEIGHTS.items()}
        )
    if not gpt2.tied:
        paths["lm_head.weight"] = ("head", "unembedding")
    return paths


def expected_shapes(
    model: model_lib.DecoderLM, paths: dict[str, tuple[str, ...]]
) -> dict[str, tuple[int, ...]]:
    """The shape of each weight of ``paths`` in ``model``'s params."""
    tokens = jax.ShapeDtypeStruct((1, model.max_len), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    return {
        name: functools.reduce(lambda node, key: node[key], path, params).shape
        for name, path in paths.items()
    }


def _weight_files(source: str) -> list[str]:
    """``model.safetensors``, or the shards its index lists."""
    index = os.path.join(source, WEIGHTS_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map.")
        return [os.path.join(source, name) for name in sorted(set(weight_map.values()))]
    path = os.path.join(source, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{source} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX} "
            "(lmhead reads safetensors files, not pytorch_model.bin)."
        )
    return [path]


def read_weights(
    source: str, shapes: dict[str, tuple[int, ...]], tied: bool
) -> dict[str, np.ndarray]:
    """The float32 weights of ``source``, by name without ``transformer.``:
    those of ``shapes`` (:func:`expected_shapes`), with those shapes.

    Raises:
        FileNotFoundError: no safetensors file (or a shard the index names).
        ValueError: a weight is missing, unexpected, of another shape,
            not floating-point or not finite, or (``tied``)
            ``lm_head.weight`` differs from ``wte.weight``; the message names
            the weight.
    """
    weights, origin = {}, {}
    for path in _weight_files(source):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}, listed in {WEIGHTS_INDEX}, is missing.")
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                name = key.removeprefix("transformer.")
                if BUFFERS.fullmatch(name):
                    continue
                if name not in shapes and not (name == "lm_head.weight" and tied):
                    raise ValueError(
                        f"{path}: the weight {key} is not part of GPT-2's "
                        "language model; lmhead would ignore it, so it refuses "
                        "the checkpoint."
                    )
                if name in weights:
                    raise ValueError(
                        f"{path}: the weight {key} is there twice "
                        f"(also as {origin[name]})."
                    )
                weights[name], origin[name] = f.get_tensor(key), key
    missing = [name for name in shapes if name not in weights]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(
            f"{source}: the weights {', '.join(missing[:3])}{more} are missing; "
            f"config.json's shapes need all {len(shapes)}."
        )
    for name, x in weights.items():
        wanted = shapes.get(name, shapes["wte.weight"])
        if x.shape != wanted:
            raise ValueError(
                f"{source}: the weight {origin[name]} has shape {x.shape}; "
                f"config.json's sizes give {wanted}."
            )
        if not np.issubdtype(x.dtype, np.floating) and x.dtype.name != "bfloat16":
            raise ValueError(
                f"{source}: the weight {origin[name]} is {x.dtype}, not floating-point."
            )
        weights[name] = x = np.asarray(x, np.float32)
        if not np.isfinite(x).all():
            raise ValueError(f"{source}: the weight {origin[name]} is not finite.")
    if tied and "lm_head.weight" in weights:
        if not np.array_equal(weights.pop("lm_head.weight"), weights["wte.weight"]):
            raise ValueError(
                f"{source}: lm_head.weight differs from wte.weight, but "
                "config.json's tie_word_embeddings is true."
            )
    return weights


def to_params(
    weights: dict[str, np.ndarray], paths: dict[str, tuple[str, ...]]
) -> dict[str, Any]:
    """The nested params of ``weights``, each at its path of ``paths``.

    Examples:
        >>> to_params({"ln_f.bias": 0, "ln_f.weight": 1}, TOP_WEIGHTS)
        {'final_norm': {'bias': 0, 'scale': 1}}
    """
    params: dict[str, Any] = {}
    for name, x in weights.items():
        *parents, leaf = paths[name]
        node = params
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = x
    return params


def read_tokenizer(
    source: str, gpt2: GPT2Config
) -> tuple[data.BPETokenizer, int | None]:
    """``(tokenizer, eos_id)`` of ``source``: ``tokenizer.json``, or GPT-2's
    byte-level BPE of ``vocab.json`` and ``merges.txt``; ``<|endoftext|>``,
    when the vocabulary has it, is a special token and the end-of-text token
    (``eos_id``, else None).

    Raises:
        FileNotFoundError: neither form is there.
        ValueError: the vocabulary's size is not ``gpt2.vocab_size``, or
            ``eos_token_id`` is given and is not ``<|endoftext|>``'s id.
    """
    path = os.path.join(source, "tokenizer.json")
    vocab, merges = (os.path.join(source, n) for n in ("vocab.json", "merges.txt"))
    if os.path.isfile(path):
        tokenizer = tokenizers.Tokenizer.from_file(path)
    elif os.path.isfile(vocab) and os.path.isfile(merges):
        tokenizer = tokenizers.Tokenizer(models.BPE.from_file(vocab, merges))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        raise FileNotFoundError(
            f"{source} has neither tokenizer.json nor vocab.json and merges.txt."
        )
    eos_id = tokenizer.token_to_id(END_OF_TEXT)
    if gpt2.eos_token_id is not None and gpt2.eos_token_id != eos_id:
        raise ValueError(
            f"{source}: config.json's eos_token_id={gpt2.eos_token_id} is not "
            f"the tokenizer's {END_OF_TEXT} (id {eos_id}), which is lmhead's "
            "end-of-text token."
        )
    if tokenizer.post_processor is None:
        # Adds no token; marks a tokenizer that encodes texts whole, as GPT-2's
        # (data.BPETokenizer), not line by line as one trained here.
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    if eos_id is not None:
        tokenizer.add_special_tokens([tokenizers.AddedToken(END_OF_TEXT, special=True)])
    if tokenizer.get_vocab_size() != gpt2.vocab_size:
        raise ValueError(
            f"{source}: the tokenizer has {tokenizer.get_vocab_size()} tokens and "
            f"config.json's vocab_size is {gpt2.vocab_size}; they must be equal."
        )
    return data.BPETokenizer(tokenizer), eos_id


def run_config(
    gpt2: GPT2Config, vocab_size: int, end_of_text: bool = True
) -> ml_collections.ConfigDict:
    """``configs/default.py``'s config with the model and tokenizer of ``gpt2``;
    ``end_of_text``: whether the tokenizer has ``<|endoftext|>``.

    Examples:
        >>> gpt2 = GPT2Config(50257, 1024, 768, 12, 12, 3072, "gelu_tanh",
        ...                   True, 50256, ())
        >>> config = run_config(gpt2, 50257)
        >>> config.data.block_size, config.model.mlp_dim, config.model.activation
        (1024, 3072, 'gelu_tanh')
    """
    config = configuration.load_config()
    with config.unlocked():
        config.data.tokenizer = "bpe"
        config.data.vocab_size = vocab_size
        config.data.block_size = gpt2.n_positions
        config.data.end_of_text = end_of_text
        config.model.update(
            num_layers=gpt2.n_layer,
            num_heads=gpt2.n_head,
            d_model=gpt2.n_embd,
            mlp_dim=gpt2.n_inner,
            dropout_rate=0.0,
            tied=gpt2.tied,
            positions="learned",
            use_bias=True,
            head_bias=False,
            dtype="float32",
            activation=gpt2.activation,
        )
    return config


class ImportedRun(NamedTuple):
    """What :func:`import_gpt2` wrote.

    Attributes:
        workdir: the run directory.
        config: its config.
        eos_id: the end-of-text id (``<|endoftext|>``'s), or None.
        ignored: ``config.json``'s fields not read.
        seconds: the import's wall time.
    """

    workdir: str
    config: ml_collections.ConfigDict
    eos_id: int | None
    ignored: tuple[str, ...]
    seconds: float


def import_gpt2(source: str, workdir: str) -> ImportedRun:
    """Writes the run directory ``workdir`` of the GPT-2-layout checkpoint in
    ``source`` (docs/gpt2_checkpoints.md lists what is read and refused).

    Everything is read and checked before anything is written. ``workdir``
    must not hold checkpoints already.

    Examples:
        >>> import_gpt2("/nonexistent", "/tmp/run")
        Traceback (most recent call last):
        ...
        FileNotFoundError: /nonexistent has no config.json.
    """
    start = time.perf_counter()
    if checkpoints.has_saved_step(workdir):
        raise FileExistsError(
            f"{workdir} holds checkpoints already; import into a new --workdir."
        )
    gpt2 = read_config(source)
    tokenizer, eos_id = read_tokenizer(source, gpt2)
    config = run_config(gpt2, tokenizer.vocab_size, eos_id is not None)
    model = configuration.make_model(config, tokenizer.vocab_size)
    paths = weight_paths(gpt2)
    weights = read_weights(source, expected_shapes(model, paths), gpt2.tied)
    params = to_params(weights, paths)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    tokenizer.save(os.path.join(workdir, data.TOKENIZER_FILE))
    if os.path.isfile(os.path.join(source, TOKENIZER_CONFIG)):
        shutil.copyfile(
            os.path.join(source, TOKENIZER_CONFIG),
            os.path.join(workdir, TOKENIZER_CONFIG),
        )
    versions.write_versions(workdir)
    record = {
        "source": os.path.abspath(source),
        "weights": [os.path.basename(p) for p in _weight_files(source)],
        "read": list(READ),
        "ignored": list(gpt2.ignored),
        "eos_id": eos_id,
    }
    with open(os.path.join(workdir, IMPORT_FILE), "w") as f:
        json.dump(record, f, indent=2)
    _save_state(workdir, model, config, params)
    return ImportedRun(
        workdir, config, eos_id, gpt2.ignored, time.perf_counter() - start
    )


def _save_state(workdir: str, model, config, params) -> None:
    """``checkpoints/0``: ``params`` and a fresh AdamW state, the state
    training would restore (``state.restore_or_init``)."""
    params = jax.device_put(params)
    state = state_lib.TrainState.create(
        apply_fn=model.apply, params=params, tx=state_lib.make_optimizer(config)
    ).replace(step=jnp.zeros((), jnp.int32))
    manager = checkpoints.checkpoint_manager(workdir)
    try:
        checkpoints.save(manager, 0, state)
    finally:
        manager.close()
