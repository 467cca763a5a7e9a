"""Helpers of ``bench_head.py``: the memory and byte formats its tables
share, and its ``--quantized`` tables (the inference head with a smaller
table: bfloat16, float16, int8 with per-row scales, against float32), and
its ``--post_training`` programs (DPO and GRPO, fused and materialized),
and its ``--filter_eps`` table (gradient filtering).

Not a command: ``python experiments/bench/bench_head.py --quantized``.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import timing  # experiments/bench/timing.py, beside this file

from lmhead import (
    _sweep_options,
    fused,
    head,
    losses,
    policy_gradient,
    preference,
    quantize,
)
from lmhead.lm import data, generation
from lmhead.lm import model as model_lib

GIB = 2.0**30


def available_bytes() -> float:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def format_ratio(ratio: float) -> str:
    return f"1/{1 / ratio:.0f}" if ratio < 0.5 else f"{ratio:.2f}"


def format_bytes(size: float) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"


TABLE_DTYPES = ("float32",) + quantize.DTYPES


def smaller_tables(w: jax.Array) -> dict:
    """``w`` itself and its quantized forms, by dtype name."""
    return {
        "float32": w,
        **{dtype: quantize.quantize_unembedding(w, dtype) for dtype in quantize.DTYPES},
    }


def table_bytes(table) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(table))


@functools.partial(jax.jit, static_argnames=("scale", "softcap"))
def agreement_sums(h, reference, table, bias, *, scale, softcap):
    """Over the rows of ``h``: how many argmaxes agree, and the summed
    KL(softmax(reference logits) || softmax(table's logits)) in nats."""
    options = dict(scale=scale, softcap=softcap)
    log_p = head.log_probs(head.unembed(h, reference, bias, **options))
    log_q = head.log_probs(head.unembed(h, table, bias, **options))
    same = jnp.argmax(log_p, -1) == jnp.argmax(log_q, -1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    return jnp.sum(same), jnp.sum(kl)


def accuracy_rows(
    label: str, h, w, bias=None, scale=None, softcap=None, block: int = 512
) -> list[str]:
    """One table line per quantized dtype: agreement and KL against ``w``."""
    tables = smaller_tables(w)
    lines = []
    for dtype in quantize.DTYPES:
        same = kl = 0.0
        for start in range(0, h.shape[0], block):
            sums = agreement_sums(
                h[start : start + block],
                w,
                tables[dtype],
                bias,
                scale=scale,
                softcap=softcap,
            )
            same, kl = same + float(sums[0]), kl + float(sums[1])
        lines.append(
            f"| {label} | {w.shape[0]} | {w.shape[1]} | {h.shape[0]} | "
            f"{dtype} | {table_bytes(tables[dtype]) / table_bytes(w):.3f}"
            f" | {same / h.shape[0]:.2%} | {kl / h.shape[0]:.2e} |"
        )
    return lines


def trained_accuracy(workdir: str, positions: int) -> list[str]:
    """Accuracy on a run's head and the hidden states of its validation text
    (evenly spaced windows of the run's block size)."""
    config, _, model, params = generation.load_run(workdir)
    val = data.load_dataset(config.data, workdir).val_tokens
    block = model.max_len
    count = max(1, positions // block)
    starts = np.linspace(0, len(val) - block, count).astype(int)
    tokens = jnp.asarray(val[starts[:, None] + np.arange(block)], jnp.int32)
    h = model.apply({"params": params}, tokens, method=model_lib.DecoderLM.hidden)
    w = params["embed"]["embedding"] if model.tied else params["head"]["unembedding"]
    return accuracy_rows(
        f"trained ({workdir})",
        h.reshape(-1, h.shape[-1]),
        w,
        params.get("head", {}).get("bias"),
        model.head_scale,
        model.logits_softcap,
    )


def random_table(v: int, d: int, seed: int = 0) -> jax.Array:
    """Normal entries of std 3 / sqrt(D): logits of std 3 for unit-normal h."""
    return 3.0 / np.sqrt(d) * jax.random.normal(jax.random.key(seed), (v, d))


def speed_rows(v: int, d: int, batch: int, matmul, repeats: int) -> list[str]:
    """Table bytes and median unembed time of each table, float32's in the
    same alternating rounds."""
    tables = smaller_tables(random_table(v, d))
    h = jax.random.normal(jax.random.key(1), (batch, d))
    compiled = {
        dtype: jax.jit(head.unembed).lower(h, table).compile()
        for dtype, table in tables.items()
    }
    times = {name: [] for name in TABLE_DTYPES + ("matmul",)}
    for _ in range(repeats + 1):  # the first round warms up
        for dtype in TABLE_DTYPES:
            times[dtype].append(
                timing.call_seconds(compiled[dtype], (h, tables[dtype]))
            )
        times["matmul"].append(matmul.seconds())
    median = {name: float(np.median(t[1:])) for name, t in times.items()}
    float32_bytes = table_bytes(tables["float32"])
    return [
        f"| {v} | {d} | {batch} | {dtype} | "
        f"{format_bytes(table_bytes(tables[dtype]))} | "
        f"{table_bytes(tables[dtype]) / float32_bytes:.3f} | "
        f"{median[dtype] * 1e3:.3g} | "
        f"{median[dtype] / median['float32']:.2f} | "
        f"{matmul.flops / median['matmul'] / 1e9:.0f} |"
        for dtype in TABLE_DTYPES
    ]


def print_quantized(vocab_sizes, rows, width, positions, workdir, repeats, matmul):
    """Prints the speed table (each ``V`` in ``vocab_sizes`` and ``B`` in
    ``rows``) and the accuracy table (on ``workdir``'s run when given, and on
    random-normal tables)."""
    print(
        "| V | D | B | table | table memory | x float32 bytes | unembed ms | "
        "x float32 time | matmul GFLOP/s |\n|" + "---|" * 9,
        flush=True,
    )
    for v in vocab_sizes:
        for batch in rows:
            print("\n".join(speed_rows(v, width, batch, matmul, repeats)), flush=True)
    print(
        "\n| weights | V | D | rows | table | x float32 bytes | top-1 agreement "
        "| mean KL(float32 || table) nats |\n|" + "---|" * 8,
        flush=True,
    )
    if workdir:
        print("\n".join(trained_accuracy(workdir, positions)), flush=True)
    h = jax.random.normal(jax.random.key(2), (positions, width))
    for v in vocab_sizes:
        print(
            "\n".join(
                accuracy_rows("random-normal, not trained", h, random_table(v, width))
            ),
            flush=True,
        )


# ----------------------------------------------------------------------------
# --post_training: DPO and GRPO, fused against materialized.
# ----------------------------------------------------------------------------

POST_TRAINING = {
    "dpo": "sigmoid DPO on N / (2T) pairs of T tokens, a reference head",
    "grpo": "GRPO (dapo, k3 KL 0.04) on N / T rollouts of T tokens, old and "
    "reference log-probs given",
}


def sequence_length(n: int) -> int:
    """T of the post-training rows: N / 16 tokens (512 at N = 8192)."""
    return n // 16 if n % 16 == 0 else n // 2


def post_training_target(key, n, d, v, dtype, loss):
    """The inputs of a post-training row besides ``h`` and ``w``: the ids,
    a mask whose first quarter of each sequence is the prompt, and for
    ``dpo`` the reference head ``(h_ref, w_ref)``, for ``grpo`` the
    advantages and the old and reference log-probs."""
    t = sequence_length(n)
    keys = jax.random.split(key, 4)
    ids = jax.random.randint(keys[0], (n // t, t), 0, v)
    mask = jnp.broadcast_to(jnp.arange(t) >= t // 4, ids.shape).astype(jnp.float32)
    if loss == "dpo":
        h_ref = jax.random.normal(keys[1], (n, d), dtype)
        w_ref = (0.02 * jax.random.normal(keys[2], (v, d))).astype(dtype)
        return ids, mask, h_ref, w_ref
    logps = -jnp.log(v) + 0.1 * jax.random.normal(keys[1], (2,) + ids.shape)
    return ids, mask, jax.random.normal(keys[2], ids.shape[:1]), logps[0], logps[1]


def post_training_steps(loss, chunk_size, vocab_chunk_size):
    """``{"fused": step, "materialized": step}``: jitted ``value_and_grad``
    w.r.t. ``h`` and ``w`` of ``loss`` (``dpo`` or ``grpo``), ``step(h, w,
    target)`` with ``target`` from :func:`post_training_target`."""
    fused_options = dict(chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)

    def materialized_logps(h, w, ids):
        logits = head.unembed(h.reshape(ids.shape + h.shape[-1:]), w)
        return jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1)[
            ..., 0
        ]

    def dpo(h, w, target, fused):
        ids, mask, h_ref, w_ref = target
        pairs = ids.shape[0] // 2
        if fused:
            hs = h.reshape(ids.shape + h.shape[-1:])
            hr = h_ref.reshape(hs.shape)
            return preference.fused_preference_loss(
                hs[:pairs],
                hs[pairs:],
                w,
                ids[:pairs],
                ids[pairs:],
                mask[:pairs],
                mask[pairs:],
                reference_head=(hr[:pairs], hr[pairs:], w_ref),
                **fused_options,
            )
        logps = materialized_logps(h, w, ids)
        ref = jax.lax.stop_gradient(materialized_logps(h_ref, w_ref, ids))
        return preference.preference_loss(
            logps[:pairs],
            logps[pairs:],
            mask[:pairs],
            mask[pairs:],
            ref_chosen_logps=ref[:pairs],
            ref_rejected_logps=ref[pairs:],
        )

    def grpo(h, w, target, fused):
        ids, mask, advantages, old, ref = target
        options = dict(old_logps=old, ref_logps=ref, beta=0.04, loss_type="dapo")
        if fused:
            return policy_gradient.fused_policy_gradient_loss(
                h.reshape(ids.shape + h.shape[-1:]),
                w,
                ids,
                mask,
                advantages,
                **options,
                **fused_options,
            )
        return policy_gradient.policy_gradient_loss(
            materialized_logps(h, w, ids), mask, advantages, **options
        )

    loss_fn = {"dpo": dpo, "grpo": grpo}[loss]
    return {
        name: jax.jit(
            jax.value_and_grad(
                functools.partial(loss_fn, fused=name == "fused"),
                argnums=(0, 1),
                has_aux=True,
            )
        )
        for name in ("fused", "materialized")
    }


def synthetic_peaked(key, n, d, v, dtype):
    """``(h, w, labels)`` whose softmax looks trained (synthetic, not a model):
    labels Zipf-distributed over ids in frequency order (as BPE's are, roughly),
    the first feature of ``w`` each id's log-frequency (a unigram prior that
    ``h``'s first feature, 1, reads), and each ``h`` pointing at its label's
    row of the others, so the label takes about half the mass."""
    rank = np.arange(1, v + 1)
    log_freq = -np.log(rank) - np.log(np.sum(1.0 / rank))
    labels = np.random.default_rng(0).choice(v, n, p=np.exp(log_freq))
    w_key, h_key = jax.random.split(key)
    w = jax.random.normal(w_key, (v, d)) / np.sqrt(d)
    w = w.at[:, 0].set(log_freq - log_freq.mean())
    h = 8.0 * w[labels] + 0.5 * jax.random.normal(h_key, (n, d)) / np.sqrt(d)
    h = h.at[:, 0].set(1.0)
    return h.astype(dtype), w.astype(dtype), jnp.asarray(labels)


@functools.partial(jax.jit, static_argnames=("chunk", "rows", "eps"))
def skipped_fraction(h, w, labels, *, chunk, rows, eps):
    """The fraction of tiles (``chunk`` tokens x ``rows`` rows) where every
    ``|p - onehot| < eps``: those the filter skips, for unit weights. Written
    here from the softmax, apart from the sweep."""
    n, v = h.shape[0], w.shape[0]
    pad = -n % chunk, -v % rows

    def tiles(x):  # [chunk, V] -> [V / rows] True where the tile is small
        hc, yc = x
        p = jax.nn.softmax(head.unembed(hc, w), axis=-1)
        small = jnp.abs(p - jax.nn.one_hot(yc, v)) < eps
        small = jnp.pad(small, ((0, 0), (0, pad[1])), constant_values=True)
        return jnp.all(small.reshape(chunk, -1, rows), axis=(0, 2))

    hs = jnp.pad(h, ((0, pad[0]), (0, 0))).reshape(-1, chunk, h.shape[1])
    ys = jnp.pad(labels, (0, pad[0])).reshape(-1, chunk)
    return jnp.mean(jax.lax.map(tiles, (hs, ys)))


def filter_rows(n, d, v, dtype, eps_values, peaked, repeats, seconds, chunk_size):
    """Rows of the filtered fused cross-entropy's value and gradient against
    the exact fused and the materialized ones, timed in alternating rounds:
    the fraction ``f`` of tiles skipped, the bound ``1/3 + 2/3 (1 - f)`` of
    the time ratio, and the gradients' relative error."""
    key = jax.random.key(0)
    if peaked:
        h, w, labels = synthetic_peaked(key, n, d, v, dtype)
    else:
        keys = jax.random.split(key, 3)
        h = jax.random.normal(keys[0], (n, d), dtype)
        w = (0.02 * jax.random.normal(keys[1], (v, d))).astype(dtype)
        labels = jax.random.randint(keys[2], (n,), 0, v)

    def step(loss):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w).compile()

    programs = {
        "materialized": step(
            lambda h, w: losses.cross_entropy(head.unembed(h, w), labels)[0]
        )
    }
    for eps in [None] + eps_values:
        programs[eps] = step(
            lambda h, w, eps=eps: fused.fused_cross_entropy(
                h, w, labels, chunk_size=chunk_size, filter_eps=eps
            )[0]
        )
    exact = programs[None](h, w)[1]
    warmup = max(timing.call_seconds(p, (h, w)) for p in programs.values())
    runs = int(np.clip(seconds // warmup, 1, repeats))
    times = {name: [] for name in programs}
    for _ in range(runs):  # alternate, so all see the same load
        for name, program in programs.items():
            times[name].append(timing.call_seconds(program, (h, w)))
    median = {name: float(np.median(t)) for name, t in times.items()}
    chunk, rows, _ = _sweep_options.block_sizes(n, v, chunk_size, None)
    out = []
    for eps in [None] + eps_values:
        value = (
            None
            if eps is None
            else _sweep_options.SweepOptions(filter_eps=eps).gradient_options(dtype)[
                "filter_eps"
            ]
        )
        f = (
            0.0
            if eps is None
            else float(
                skipped_fraction(h, w, labels, chunk=chunk, rows=rows, eps=value)
            )
        )
        grads = programs[eps](h, w)[1]
        error = [
            float(
                jnp.linalg.norm((g - e).astype(jnp.float32))
                / jnp.linalg.norm(e.astype(jnp.float32))
            )
            for g, e in zip(grads, exact)
        ]
        out.append(
            f"| {n} | {d} | {v} | {'peaked (synthetic)' if peaked else 'random'} | "
            f"{'exact' if eps is None else f'{eps} ({value:.3g})'} | {f:.1%} | "
            f"{1 / 3 + 2 / 3 * (1 - f):.2f} | {median[eps]:.3g} | "
            f"{median[eps] / median[None]:.2f} | "
            f"{median[eps] / median['materialized']:.2f} | "
            f"{error[0]:.1e} | {error[1]:.1e} | {runs} |"
        )
    return out


FILTER_HEADER = (
    "| N | D | V | inputs | filter_eps | tiles skipped | bound | fused s | "
    "x exact | x materialized | dh rel. error | dw rel. error | runs |\n|" + "---|" * 13
)


def float64_dw(h, w, labels, chunk=256):
    """The mean cross-entropy's ``dw`` in float64 numpy, ``chunk`` tokens at
    a time: the reference of :func:`accumulation_rows`."""
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    dw = np.zeros_like(w)
    for i in range(0, len(h), chunk):
        z = h[i : i + chunk] @ w.T
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(z)), np.asarray(labels[i : i + chunk])] -= 1.0
        dw += p.T @ h[i : i + chunk]
    return dw / len(h)


def accumulation_rows(n, d, v, dtype, repeats, seconds, chunk_size):
    """Rows of ``dw``'s relative error against float64 and the time of
    value and gradient with each ``dw_accumulation``, in alternating rounds
    (random inputs, ``w`` of std 0.02 as at initialization)."""
    keys = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(keys[0], (n, d), dtype)
    w = (0.02 * jax.random.normal(keys[1], (v, d))).astype(dtype)
    labels = jax.random.randint(keys[2], (n,), 0, v)
    programs = {
        mode: jax.jit(
            jax.value_and_grad(
                lambda w, mode=mode: fused.fused_cross_entropy(
                    h, w, labels, chunk_size=chunk_size, dw_accumulation=mode
                )[0]
            )
        )
        .lower(w)
        .compile()
        for mode in _sweep_options.DW_ACCUMULATIONS
    }
    reference = float64_dw(h, w, labels)
    warmup = max(timing.call_seconds(p, (w,)) for p in programs.values())
    runs = int(np.clip(seconds // warmup, 1, repeats))
    times = {mode: [] for mode in programs}
    for _ in range(runs):  # alternate, so all see the same load
        for mode, program in programs.items():
            times[mode].append(timing.call_seconds(program, (w,)))
    base = float(np.median(times["float32"]))
    out = []
    for mode, program in programs.items():
        dw = np.asarray(program(w)[1], np.float64)
        error = np.linalg.norm(dw - reference) / np.linalg.norm(reference)
        seconds = float(np.median(times[mode]))
        out.append(
            f"| {n} | {d} | {v} | {jnp.dtype(dtype).name} | {mode} | {error:.1e} | "
            f"{seconds:.3g} | {seconds / base:.2f} | {runs} |"
        )
    return out


ACCUMULATION_HEADER = (
    "| N | D | V | dtype | dw_accumulation | dw rel. error vs float64 | s | "
    "x float32 | runs |\n|" + "---|" * 9
)
