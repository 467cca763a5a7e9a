"""A random GPT-2-layout checkpoint in Hugging Face's files, and GPT-2's
forward pass in float64 numpy: the import's tests' input and reference.

:func:`write_gpt2_checkpoint` is what a fixture calls to get a directory that
``lmhead.lm.gpt2_import`` imports (``config.json``, ``model.safetensors``
with Hugging Face's names, a byte-level BPE ``tokenizer.json`` made with
``tokenizers`` whose last token is ``<|endoftext|>``, as GPT-2's is). The
reference, :func:`gpt2_logits`, is written from GPT-2's definition (Radford
et al. 2019; Hugging Face's ``modeling_gpt2.py``), independent of lmhead's
model.
"""

import json
import math
import os

import numpy as np
import tokenizers
from safetensors.numpy import save_file
from scipy import special
from tokenizers import decoders, models, pre_tokenizers, trainers

from tests import references

END_OF_TEXT = "<|endoftext|>"
# Blank lines between the lines, so that "\n\n" is a merge, as GPT-2's 628.
TEXT = (
    "To be, or not to be, that is the question:\n\n\n"
    "Whether 'tis nobler in the mind to suffer\n\n\n"
    "The slings and arrows of outrageous fortune,\n\n\n"
) * 4


def byte_level_tokenizer(merges: int = 40) -> tokenizers.Tokenizer:
    """GPT-2's kind of tokenizer: byte-level BPE (256 bytes, ``merges``
    merges at most) trained on :data:`TEXT`, ``<|endoftext|>`` last."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([TEXT], trainer=trainer)
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


def gpt2_fields(tokens: int, **changes) -> dict:
    """A tiny GPT-2 ``config.json`` as Hugging Face writes it, for a
    vocabulary of ``tokens``, ``<|endoftext|>`` last."""
    fields = {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": tokens - 1,
        "embd_pdrop": 0.1,
        "eos_token_id": tokens - 1,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 16,
        "n_embd": 16,
        "n_head": 2,
        "n_inner": None,
        "n_layer": 2,
        "n_positions": 16,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.1,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "summary_activation": None,
        "summary_type": "cls_index",
        "torch_dtype": "float32",
        "transformers_version": "4.40.0",
        "use_cache": True,
        "vocab_size": tokens,
    }
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not ...}


def random_weights(fields: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2's weights by name (no ``transformer.`` prefix), random: large
    enough that the logits of different tokens are far apart."""
    rng = np.random.default_rng(seed)
    v, p, d = fields["vocab_size"], fields["n_positions"], fields["n_embd"]
    f = fields.get("n_inner") or 4 * d

    def normal(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    weights = {
        "wte.weight": normal(v, d),
        "wpe.weight": normal(p, d),
        "ln_f.weight": 1 + normal(d, scale=0.1),
        "ln_f.bias": normal(d, scale=0.1),
    }
    for i in range(fields["n_layer"]):
        for ln in ("ln_1", "ln_2"):
            weights[f"h.{i}.{ln}.weight"] = 1 + normal(d, scale=0.1)
            weights[f"h.{i}.{ln}.bias"] = normal(d, scale=0.1)
        for name, (n_in, n_out) in {
            "attn.c_attn": (d, 3 * d),
            "attn.c_proj": (d, d),
            "mlp.c_fc": (d, f),
            "mlp.c_proj": (f, d),
        }.items():
            weights[f"h.{i}.{name}.weight"] = normal(n_in, n_out)
            weights[f"h.{i}.{name}.bias"] = normal(n_out, scale=0.1)
    return weights


def write_gpt2_checkpoint(
    directory,
    *,
    prefix: bool = True,
    vocab_files: bool = False,
    seed: int = 0,
    edit=None,
    **changes,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Writes a random tiny GPT-2 checkpoint to ``directory``; returns its
    ``(config.json fields, weights)``.

    Args:
        prefix: name the weights ``transformer.*`` and add ``lm_head.weight``
            (``GPT2LMHeadModel``'s file) and the causal-mask buffers; else
            bare names (``GPT2Model``'s).
        vocab_files: ``vocab.json`` + ``merges.txt`` instead of
            ``tokenizer.json``.
        edit: a function of the file's tensors by name, which it may change
            before they are written (a bad checkpoint).
        changes: ``config.json`` fields to set (``...`` removes one);
            ``tie_word_embeddings=False`` adds a random ``lm_head.weight``.
    """
    os.makedirs(directory, exist_ok=True)
    tokenizer = byte_level_tokenizer()
    fields = gpt2_fields(tokenizer.get_vocab_size(), **changes)
    # The weights of the fields a removed one had.
    shapes = gpt2_fields(
        tokenizer.get_vocab_size(), **{k: v for k, v in changes.items() if v is not ...}
    )
    weights = random_weights(shapes, seed)
    if not fields.get("tie_word_embeddings", True):
        weights["lm_head.weight"] = random_weights(shapes, seed + 1)["wte.weight"]
    tensors = dict(weights)
    if prefix:
        tensors = {f"transformer.{k}": x for k, x in weights.items()}
        tensors["lm_head.weight"] = weights.get("lm_head.weight", weights["wte.weight"])
        tensors.pop("transformer.lm_head.weight", None)
        p = shapes["n_positions"]
        for i in range(shapes["n_layer"]):
            tensors[f"transformer.h.{i}.attn.bias"] = np.tril(
                np.ones((1, 1, p, p), np.float32)
            )
    if edit is not None:
        edit(tensors)
    save_file(tensors, os.path.join(directory, "model.safetensors"), {"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(fields, f, indent=2)
    if vocab_files:
        saved = json.loads(tokenizer.to_str())["model"]
        with open(os.path.join(directory, "vocab.json"), "w") as f:
            json.dump({**saved["vocab"], END_OF_TEXT: len(saved["vocab"])}, f)
        with open(os.path.join(directory, "merges.txt"), "w") as f:
            f.write("#version: 0.2\n")
            f.writelines(" ".join(m) + "\n" for m in saved["merges"])
    else:
        tokenizer.save(os.path.join(directory, "tokenizer.json"))
    return fields, weights


def imported_gpt2_run(folder, **options) -> tuple[dict, dict[str, np.ndarray], str]:
    """Writes a random checkpoint (:func:`write_gpt2_checkpoint`'s
    ``options``) to ``folder/hf`` and imports it into ``folder/run``;
    returns ``(config.json fields, weights, the run directory)``, e.g. for a
    fixture that serves it."""
    from lmhead.lm import gpt2_import

    fields, weights = write_gpt2_checkpoint(os.path.join(folder, "hf"), **options)
    workdir = os.path.join(folder, "run")
    gpt2_import.import_gpt2(os.path.join(folder, "hf"), workdir)
    return fields, weights, workdir


def _layer_norm(x, scale, bias, epsilon=1e-5):
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + epsilon) * scale + bias


def _gelu(x, activation):
    if activation == "gelu":
        return 0.5 * x * (1 + special.erf(x / math.sqrt(2)))
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    return 0.5 * x * (1 + np.tanh(inner))


def gpt2_logits(fields: dict, weights: dict, ids) -> np.ndarray:
    """GPT-2's next-token logits ``[T, V]`` after each of ``ids: [T]``, in
    float64; the head is ``lm_head.weight`` if given, else tied."""
    w = {k: np.asarray(x, np.float64) for k, x in weights.items()}
    heads, time = fields["n_head"], len(ids)
    x = w["wte.weight"][np.asarray(ids)] + w["wpe.weight"][:time]
    causal = np.tril(np.ones((time, time), bool))
    for i in range(fields["n_layer"]):
        h = _layer_norm(x, w[f"h.{i}.ln_1.weight"], w[f"h.{i}.ln_1.bias"])
        qkv = h @ w[f"h.{i}.attn.c_attn.weight"] + w[f"h.{i}.attn.c_attn.bias"]
        q, k, v = (a.reshape(time, heads, -1) for a in np.split(qkv, 3, axis=-1))
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
        attention = special.softmax(np.where(causal, scores, -np.inf), axis=-1)
        out = np.einsum("hts,shd->thd", attention, v).reshape(time, -1)
        x = x + out @ w[f"h.{i}.attn.c_proj.weight"] + w[f"h.{i}.attn.c_proj.bias"]
        h = _layer_norm(x, w[f"h.{i}.ln_2.weight"], w[f"h.{i}.ln_2.bias"])
        h = _gelu(
            h @ w[f"h.{i}.mlp.c_fc.weight"] + w[f"h.{i}.mlp.c_fc.bias"],
            fields.get("activation_function", "gelu_new"),
        )
        x = x + h @ w[f"h.{i}.mlp.c_proj.weight"] + w[f"h.{i}.mlp.c_proj.bias"]
    x = _layer_norm(x, w["ln_f.weight"], w["ln_f.bias"])
    return x @ w.get("lm_head.weight", w["wte.weight"]).T


def gpt2_log_softmax(fields: dict, weights: dict, ids) -> np.ndarray:
    """``log p(next token | ids[:t + 1])``, ``[T, V]``, float64."""
    return references.log_softmax(gpt2_logits(fields, weights, ids))


def gpt2_greedy(fields: dict, weights: dict, ids, new_tokens: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence at each step."""
    ids = list(ids)
    for _ in range(new_tokens):
        ids.append(int(np.argmax(gpt2_logits(fields, weights, ids)[-1])))
    return ids[-new_tokens:]
