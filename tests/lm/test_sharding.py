"""Tests for lmhead/lm/sharding.py: meshes, shardings, the vocabulary-parallel
loss, sharded checkpoints and a run over two processes.

The checks that need several devices run in a subprocess -- this file run
as a script with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set
before jax is imported, and the names of the checks to run -- which prints
its measurements as JSON; the tests below (and those of
``test_sharding_ensemble.py``, from a second subprocess) assert on them.
Every comparison there is against a reference computed on one device by
other code: the materialized loss of ``losses.cross_entropy`` (the
single-device training step) or the numpy cross-entropy of
``tests/references.py``.
The two-process test starts ``experiments/train.py`` twice on localhost with
``jax.distributed`` and compares its losses with the subprocess's own run of
the same config on one process with the same 8 devices.
"""

import functools
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests import ROOT, devices_environment, references
from tests.lm.conftest import read_metrics

# Data only, both axes, model only ((4, 2) is a mesh of both axes too; the
# checkpoint test saves from it).
MESHES = ((8, 1), (2, 4), (1, 8))
TOLERANCE = 1e-5
# The tiny run compared across one and two processes (4 steps, then an eval).
RUN_CONFIG = "tiny,steps=4"
RUN_OVERRIDES = {
    "optim.warmup_steps": 1,
    "mesh.model": 2,
    # 84 characters split in two; the end-of-text token would make 85.
    "data.end_of_text": False,
    "loss.loss_impl": "vocab_parallel",
    "sample.num_samples": 0,
}
RUN_ARGS = [f"--config=configs/default.py:{RUN_CONFIG}"] + [
    f"--config.{name}={value}" for name, value in RUN_OVERRIDES.items()
]


# ----------------------------------------------------------------------------
# The subprocess (8 simulated devices).
# ----------------------------------------------------------------------------


def _tiny_config(tied, loss_impl):
    from configs import default

    config = default.get_config("tiny")
    config.model.update(
        num_layers=1,
        num_heads=2,
        d_model=16,
        mlp_dim=32,
        tied=tied,
        head_bias=not tied,
        logits_softcap=5.0 if tied else None,
    )
    config.loss.update(loss_impl=loss_impl, label_smoothing=0.1, z_loss=1e-3)
    # No clipping: Adam's first moment after one step is (1 - b1) * gradient.
    config.optim.grad_clip = 0.0
    config.data.block_size = 8
    config.train.batch_size = 8
    return config


def _max_diff(a, b):
    import jax

    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _gradients(state, config):
    """The gradients of the step that made ``state``, from Adam's ``mu``."""
    import jax

    adam = next(
        s
        for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
        if hasattr(s, "mu")
    )
    return jax.tree.map(lambda m: np.asarray(m) / (1 - config.optim.b1), adam.mu)


def check_train_steps():
    """Loss, gradients and updated state of one training step of a program of
    one (a single run) on each mesh (vocabulary-parallel loss) vs the step
    alone on one device (materialized loss), and where the sharded step
    leaves the tables."""
    import jax

    from lmhead.lm import configuration, sharding, train
    from lmhead.lm import state as state_lib

    vocab, results = 32, {}
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (8, 9)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}
    key = jax.random.key(1)

    def one(tree):
        return jax.tree.map(lambda x: np.asarray(x)[None], tree)

    for tied in (True, False):
        config = _tiny_config(tied, "materialized")
        model = configuration.make_model(config, vocab)
        state = jax.jit(lambda k: state_lib.create_train_state(model, config, k))(
            jax.random.key(0)
        )
        host_state = jax.device_get(state)
        ref_fn = jax.jit(
            functools.partial(
                train.train_step,
                model=model,
                loss_kwargs=train.loss_keywords(config.loss),
                learning_rate_fn=state_lib.learning_rate_schedule(config),
            )
        )
        ref_state, ref_metrics = ref_fn(state, batch, key)
        ref_grads = _gradients(ref_state, config)
        sharded_config = _tiny_config(tied, "vocab_parallel")
        for shape in MESHES:
            mesh = sharding.make_mesh(*shape)
            stacked = one(host_state)
            state = jax.device_put(stacked, sharding.stacked_shardings(stacked, mesh))
            global_batch = sharding.shard_members(one(batch), mesh)
            keys = sharding.replicate(jax.numpy.stack([key]), mesh)
            train_fn, _, _ = train.compile_steps(
                model, [sharded_config], state, global_batch, keys, {}, mesh
            )
            active = sharding.replicate(np.ones(1, bool), mesh)
            new_state, metrics = train_fn(state, global_batch, keys, {}, active)
            table = new_state.params["embed" if tied else "head"][
                "embedding" if tied else "unembedding"
            ]
            moment = new_state.opt_state[0].mu["embed"]["embedding"]
            member = jax.tree.map(lambda x: x[0], jax.device_get(new_state))
            results[f"{'tied' if tied else 'untied'} {shape}"] = {
                "loss": abs(float(metrics["loss"][0]) - float(ref_metrics["loss"])),
                "metrics": max(
                    abs(float(metrics[k][0]) - float(ref_metrics[k]))
                    for k in ("nll", "accuracy", "grad_norm")
                ),
                "grads": _max_diff(_gradients(member, config), ref_grads),
                "params": _max_diff(member.params, ref_state.params),
                "table_rows_per_device": table.addressable_shards[0].data.shape[1],
                "table_spec": str(table.sharding.spec),
                "moment_spec": str(moment.sharding.spec),
                "kernel_spec": str(
                    new_state.params["blocks_0"]["mlp_in"]["kernel"].sharding.spec
                ),
                "all_gathers": train_fn.as_text().count("all-gather"),
            }
    return results


def check_loss_options():
    """The vocabulary-parallel loss vs numpy across options."""
    import jax

    from lmhead import vocab_parallel
    from lmhead.lm import sharding

    rng = np.random.default_rng(1)
    h = rng.normal(size=(4, 6, 8)).astype(np.float32)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    bias = rng.normal(size=(16,)).astype(np.float32)
    labels = rng.integers(0, 16, (4, 6))
    weights = (rng.uniform(size=(4, 6)) > 0.3).astype(np.float32)
    # Labels outside [0, V) with nonzero weight count as invalid, weight 0.
    labels[0, :2], weights[0, :2] = (-1, 16), 1.0
    valid = np.where((labels >= 0) & (labels < 16), weights, 0.0)
    cases = [
        dict(),
        dict(label_smoothing=0.2, smoothing="uniform"),
        dict(label_smoothing=0.2, smoothing="normalized", z_loss=1e-2),
        dict(softcap=2.0, scale=0.5, z_loss=1e-3, chunk_size=5),
    ]
    clipped = np.clip(labels, 0, 15)
    expected = [
        references.cross_entropy(
            references.unembed(h, w, bias, case.get("scale"), case.get("softcap")),
            clipped,
            valid,
            case.get("label_smoothing", 0.0),
            case.get("smoothing", "uniform"),
            case.get("z_loss", 0.0),
        )[1]
        for case in cases
    ]
    # Both axes (the vocabulary split 4 ways); the model-only mesh (1, 8) is
    # checked by the train steps and the gradients, with these options.
    mesh = sharding.make_mesh(2, 4)

    def all_cases(h, w, bias, labels, weights, cases=cases):
        return [
            vocab_parallel.vocab_parallel_cross_entropy(
                h, w, labels, bias=bias, weights=weights, mesh=mesh, **case
            )
            for case in cases
        ]

    outputs = jax.jit(all_cases)(h, w, bias, labels, weights)
    # And the last case without jit, where bad labels raise (op by op over 8
    # devices: seconds per case).
    outputs += all_cases(h, w, bias, clipped, valid, cases=cases[-1:])
    results = {}
    for index, ((loss, metrics), want) in enumerate(
        zip(outputs, expected + expected[-1:])
    ):
        results[f"case {index} (2, 4)"] = max(
            abs(float(loss) - want["loss"]),
            abs(float(metrics["accuracy"]) - want["accuracy"]),
        )
        results[f"invalid {index} (2, 4)"] = int(metrics["invalid_labels"])
    return results


def check_gradients():
    """Gradients of the vocabulary-parallel loss for each kind of cotangent
    (the reduced loss, the unreduced one, a metric) vs the materialized loss
    on one device, with tokens split over "data" or replicated."""
    import jax
    import jax.numpy as jnp

    from lmhead import head, losses, vocab_parallel
    from lmhead.lm import sharding

    rng = np.random.default_rng(2)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    bias = rng.normal(size=(16,)).astype(np.float32)
    options = dict(label_smoothing=0.1, z_loss=1e-2, softcap=3.0)

    def objective(loss_fn, reduction, labels, h, w, bias, weights):
        loss, metrics = loss_fn(
            h, w, labels, bias=bias, weights=weights, reduction=reduction, **options
        )
        # Not a multiple of the weights, so "none" is not "sum" in disguise.
        position = jnp.arange(loss.size).reshape(loss.shape)
        return jnp.sum(loss * (1.0 + position)) + metrics["nll"]

    def materialized(h, w, labels, *, bias, softcap, **kwargs):
        return losses.cross_entropy(
            head.unembed(h, w, bias, softcap=softcap), labels, **kwargs
        )

    results = {}
    # 24 tokens split over "data"; 15 replicated, as "data" = 2 does not divide.
    for shape, tokens in (((2, 4), (4, 6)), ((2, 4), (3, 5)), ((1, 8), (4, 6))):
        h = rng.normal(size=tokens + (8,)).astype(np.float32)
        labels = rng.integers(0, 16, tokens)
        weights = (rng.uniform(size=tokens) > 0.3).astype(np.float32)
        mesh = sharding.make_mesh(*shape)
        parallel = functools.partial(
            vocab_parallel.vocab_parallel_cross_entropy,
            mesh=mesh,
            chunk_size=4,
            vocab_chunk_size=3,
        )
        reductions = ("mean", "none")

        def both(loss_fn, *args, labels=labels):  # one program for both reductions
            return [
                jax.value_and_grad(
                    functools.partial(objective, loss_fn, reduction, labels),
                    argnums=(0, 1, 2, 3),
                )(*args)
                for reduction in reductions
            ]

        got, want = (
            jax.jit(functools.partial(both, loss_fn))(h, w, bias, weights)
            for loss_fn in (parallel, materialized)
        )
        for reduction, one_got, one_want in zip(reductions, got, want):
            scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(one_want))
            results[f"{shape} {tokens} {reduction}"] = (
                _max_diff(one_got, one_want) / scale
            )
    return results


def _buffer_sizes(compiled):
    """Element counts of every array shape in a compiled (per-device) HLO."""
    import re

    shapes = re.findall(
        r"\b(?:f32|f16|bf16|s32|u32|pred)\[([0-9,]*)\]", compiled.as_text()
    )
    return [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]


def check_memory():
    """Per-device buffers of the compiled loss and its gradient."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lmhead import head, losses, vocab_parallel
    from lmhead.lm import sharding

    n, vocab, d_model = 256, 512, 64
    h = np.ones((n, d_model), np.float32)
    w = np.ones((vocab, d_model), np.float32)
    labels = np.zeros((n,), np.int32)
    mesh = sharding.make_mesh(2, 4)

    def parallel(h, w):
        return vocab_parallel.vocab_parallel_cross_entropy(
            h, w, labels, chunk_size=32, label_smoothing=0.1, mesh=mesh
        )[0]

    def materialized(h, w):
        return losses.cross_entropy(head.unembed(h, w), labels, label_smoothing=0.1)[0]

    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1))
    compiled = (
        jax.jit(
            grad(parallel),
            in_shardings=(
                NamedSharding(mesh, P("data")),
                NamedSharding(mesh, P("model")),
            ),
        )
        .lower(h, w)
        .compile()
    )
    single = jax.jit(grad(materialized)).lower(h, w).compile()
    return {
        "logits": n * vocab,
        "table": vocab * d_model,
        "parallel_largest": max(_buffer_sizes(compiled)),
        "single_largest": max(_buffer_sizes(single)),
        "parallel_temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "single_temp_bytes": single.memory_analysis().temp_size_in_bytes,
    }


def check_checkpoint(workdir):
    """A state saved from mesh (4, 2) restored onto (2, 4), (8, 1), one device."""
    import jax

    from lmhead.lm import checkpoints, configuration, sharding
    from lmhead.lm import state as state_lib

    config = _tiny_config(False, "vocab_parallel")
    model = configuration.make_model(config, 32)
    mesh = sharding.make_mesh(4, 2)
    manager = checkpoints.checkpoint_manager(workdir)
    state = state_lib.restore_or_init(manager, model, config, jax.random.key(3), mesh)
    checkpoints.save(manager, 7, state)
    expected = jax.device_get(state)
    results = {}
    for shape in ((2, 4), (8, 1), None):
        target = None if shape is None else sharding.make_mesh(*shape)
        restored = state_lib.restore_or_init(
            manager, model, config, jax.random.key(4), target
        )
        table = restored.params["head"]["unembedding"]
        results[str(shape)] = {
            "difference": _max_diff(jax.device_get(restored), expected),
            "step": int(restored.step),
            "devices": len(table.sharding.device_set),
            "rows_per_device": table.addressable_shards[0].data.shape[0],
        }
    manager.close()
    return results


def check_errors():
    """Messages of the errors that need several devices."""
    import jax.numpy as jnp

    from lmhead import vocab_parallel
    from lmhead.lm import sharding

    attempts = {
        "product": lambda: sharding.make_mesh(3, 2),
        "split": lambda: sharding.make_mesh(-1, 3),
        "vocabulary": lambda: sharding.tree_shardings(
            {"embed": {"embedding": np.zeros((84, 4))}}, sharding.make_mesh(1, 8)
        ),
        "batch": lambda: sharding.process_rows(12, sharding.make_mesh(8, 1)),
        "loss rows": lambda: vocab_parallel.vocab_parallel_cross_entropy(
            jnp.ones((2, 4)),
            jnp.ones((12, 4)),
            jnp.zeros(2, jnp.int32),
            mesh=sharding.make_mesh(1, 8),
        ),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


def reference_run(workdir):
    """The run that the two-process test repeats, on one process."""
    from configs import default
    from lmhead.lm import train

    config = default.get_config(RUN_CONFIG)
    config.update_from_flattened_dict(RUN_OVERRIDES)
    with open(os.devnull, "w") as quiet:
        sys.stdout, stdout = quiet, sys.stdout
        try:
            train.train_and_evaluate(config, workdir)
        finally:
            sys.stdout = stdout
    return read_metrics(workdir)


def check_ensemble(workdir):
    """An 8-member program with its members split over the 8 devices
    (``mesh.members`` 8) and with each member's batch split over them instead
    (``mesh.members`` 1): each member's losses; and the meshes that the
    default, None, gives (on a CPU, the members split over as many devices as
    divide them)."""
    from configs import default
    from lmhead.lm import members as members_lib
    from lmhead.lm import sharding, train

    specs = [{"train.seed": i, "optim.lr": 1e-3 * (1 + i)} for i in range(8)]
    results = {}
    variants = (
        ("members", {"mesh.members": 8, "mesh.data": 1}),
        ("data", {"mesh.members": 1}),
    )

    def config_of(mesh):
        config = default.get_config(RUN_CONFIG)
        config.update_from_flattened_dict(
            {"optim.warmup_steps": 1, "sample.num_samples": 0, **mesh}
        )
        return config

    for name, mesh in variants:
        config = config_of(mesh)
        run = os.path.join(workdir, name)
        with open(os.devnull, "w") as quiet:
            sys.stdout, stdout = quiet, sys.stdout
            try:
                members = members_lib.make_members(specs, run)
                train.train_program(config, members, run)
            finally:
                sys.stdout = stdout
        results[name] = [
            [r["train/loss"] for r in read_metrics(m.workdir) if "train/loss" in r]
            + [read_metrics(m.workdir)[-1]["eval/loss"]]
            for m in members
        ]
    # The default's mesh: for 8 members, the mesh of mesh.members=8 (so the
    # same program as "members"); for counts that 8 does not divide, 6
    # members on 6 of the devices, 11 (no divisor up to 8) on one, unsplit.
    results["meshes"] = {
        count: [dict(mesh.shape), int(mesh.devices.size)]
        for count in (6, 8, 11)
        for mesh in [sharding.program_mesh(config_of({}).mesh, count)]
    }
    results["default is members"] = sharding.program_mesh(
        config_of({}).mesh, 8
    ) == sharding.program_mesh(config_of(variants[0][1]).mesh, 8)
    return results


def _ban_token_3(logits, context):
    """A processor hook for check_split_decoding."""
    return logits.at[:, 3].set(-1e30)


def check_split_decoding(streams=False):
    """Greedy, sampled and beam decoding with the rows split over two devices
    (``inference.make_step_fn(model, mesh)``, a prefill on the same mesh) against
    the same calls on one device; the errors of a batch the mesh does not
    divide; the sizes of ``rows_mesh``. With ``streams``, instead: one
    sampling key for the batch, and streamed chunks against one call."""
    import jax
    import jax.numpy as jnp

    from lmhead import decoding
    from lmhead.lm import inference
    from lmhead.lm import model as model_lib

    model = model_lib.DecoderLM(
        vocab_size=17, num_layers=2, num_heads=2, d_model=16, mlp_dim=32, max_len=96
    )
    prompt = jax.random.randint(jax.random.key(1), (8, 5), 0, 17)
    lengths = jnp.array([5, 3, 4, 5, 1, 2, 5, 4])
    params = jax.jit(model.init)(jax.random.key(0), prompt)["params"]
    results = {}

    def decode(mesh):
        step = inference.make_step_fn(model, mesh)
        start = lambda: inference.prefill(model, params, prompt, lengths, mesh=mesh)
        if streams:
            return decode_streams(step, start)
        runs = {
            "greedy": decoding.generate(
                step, params, *start(), key=jax.random.key(2), max_new_tokens=70,
                temperature=0.0,
            ),
            # Per-row knobs, stops and limits, split with the rows
            # (repeated per sample first).
            "row keys": decoding.generate(
                step, params, *start(), key=jax.random.split(jax.random.key(3), 8),
                max_new_tokens=70, temperature=jnp.linspace(0.6, 1.2, 8),
                presence_penalty=0.5, stop_sequences=[[5, 5]], num_samples=2,
                row_max_new_tokens=jnp.arange(63, 71, dtype=jnp.int32),
            ),
            # A hook sees every row: the loop over the whole batch.
            "hook": decoding.generate(
                step, params, *start(), key=jax.random.key(2), max_new_tokens=20,
                temperature=0.0, processor=_ban_token_3,
            ),
        }  # fmt: skip
        beams = decoding.beam_search(
            step, params, *start(), num_beams=4, max_new_tokens=12, eos_id=None
        )
        out = {
            k: (np.asarray(g.tokens), np.asarray(g.log_probs)) for k, g in runs.items()
        }
        out["beam"] = (np.asarray(beams[0]), np.asarray(beams[1]))
        return out

    def decode_streams(step, start):
        one_key = decoding.generate(
            step, params, *start(), key=jax.random.key(2), max_new_tokens=70,
            temperature=0.9, top_p=0.9, top_logprobs=3,
        )  # fmt: skip
        streamed = dict(
            max_new_tokens=70, key=jax.random.split(jax.random.key(3), 8),
            temperature=0.9, presence_penalty=0.5, top_logprobs=2,
        )  # fmt: skip
        # One key, greedy rows on one device and sampled ones on the other:
        # each device carries its own copy between the chunks; the sampling
        # device's is split as the one-device run's, the greedy device's is
        # never split and never drawn from.
        mixed = decoding.generate_stream(
            step, params, *start(), chunk_steps=16, key=jax.random.key(4),
            max_new_tokens=40, temperature=jnp.where(jnp.arange(8) < 4, 0.0, 0.9),
        )  # fmt: skip
        mixed = [(np.asarray(c.tokens), np.asarray(c.log_probs)) for c in mixed]
        chunks = list(
            decoding.generate_stream(step, params, *start(), chunk_steps=16, **streamed)
        )
        whole = decoding.generate(step, params, *start(), **streamed)
        joined = {
            name: np.concatenate([np.asarray(getattr(c, name)) for c in chunks], axis=1)
            for name in ("tokens", "log_probs", "top_tokens", "top_log_probs")
        }
        return {
            "one key": (np.asarray(one_key.tokens), np.asarray(one_key.log_probs)),
            "one key, mixed stream": tuple(
                np.concatenate(c, axis=1) for c in zip(*mixed)
            ),
            "stream": (joined["tokens"], joined["log_probs"]),
            "stream top": (joined["top_tokens"], joined["top_log_probs"]),
            # The chunks are one call's columns, bit for bit, on each placement.
            "stream is one call": all(
                np.array_equal(value, np.asarray(getattr(whole, name)))
                for name, value in joined.items()
            ),
        }

    # Two of the devices, as on a 2-core machine: the hook's whole-batch
    # loop then waits on two threads, not eight, on a loaded machine.
    two = inference.rows_mesh(8, jax.devices()[:2])
    # Which loop each generate and stream ran on the mesh: every device its
    # own, or the whole batch's (a processor hook, which sees every row).
    loops, split_loops = [], decoding.sampling.split_loops

    def recording(*args):
        split = split_loops(*args)
        loops.append(split is not None)
        return split

    one = decode(None)
    decoding.sampling.split_loops = recording
    try:
        split = decode(two)
    finally:
        decoding.sampling.split_loops = split_loops
    names = (
        ("one key", "one key, mixed stream", "stream", "whole")
        if streams
        else ("greedy", "row keys", "hook")
    )
    results["own loops"] = dict(zip(names, loops, strict=True))
    if streams:
        results["stream is one call"] = [
            out.pop("stream is one call") for out in (one, split)
        ]
    for name in one:
        results[name] = {
            "same tokens": bool(np.array_equal(one[name][0], split[name][0])),
            "log-prob difference": float(np.max(np.abs(one[name][1] - split[name][1]))),
        }
    if streams:
        return results
    mesh = inference.rows_mesh(8)
    errors = {}
    for name, call in (
        ("prefill", lambda: inference.prefill(model, params, prompt[:6], mesh=mesh)),
        (
            "step",
            lambda: inference.make_step_fn(model, mesh)(
                params, prompt[:6, 0], inference.prefill(model, params, prompt[:6])[1]
            ),
        ),
        (
            "two axes",
            lambda: inference.make_step_fn(
                model, jax.make_mesh((4, 2), ("data", "model"))
            ),
        ),
        (
            "generate",
            lambda: decoding.generate(
                inference.make_step_fn(model, mesh),
                params,
                *inference.prefill(model, params, prompt[:6]),
                key=jax.random.key(0),
                max_new_tokens=3,
                temperature=0.0,
            ),
        ),  # fmt: skip
    ):
        try:
            call()
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    results["errors"] = errors
    results["mesh sizes"] = {
        str(batch): None if mesh is None else int(mesh.size)
        for batch in (1, 6, 7, 32)
        for mesh in [inference.rows_mesh(batch)]
    }
    return results


def main(workdir, names):
    import jax

    jax.config.update("jax_platforms", "cpu")
    assert jax.device_count() == 8, jax.devices()
    import time

    checks = {
        "train_steps": check_train_steps,
        "loss_options": check_loss_options,
        "gradients": check_gradients,
        "memory": check_memory,
        "checkpoint": lambda: check_checkpoint(os.path.join(workdir, "ckpt")),
        "errors": check_errors,
        "reference_run": lambda: reference_run(os.path.join(workdir, "run")),
        "ensemble": lambda: check_ensemble(os.path.join(workdir, "ensemble")),
        "split_decoding": check_split_decoding,
        "split_streams": lambda: check_split_decoding(streams=True),
    }
    results = {}
    for name in names:
        start, cpu = time.perf_counter(), time.process_time()
        results[name] = checks[name]()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"{name}: {wall:.1f} s, CPU {cpu:.1f} s", file=sys.stderr)
    print("RESULTS " + json.dumps(results))


# ----------------------------------------------------------------------------
# The tests.
# ----------------------------------------------------------------------------


def run_checks(workdir, names):
    """The checks ``names`` of :func:`main`, run in one 8-device subprocess.

    The checks are split over two test files (this one and
    ``test_sharding_ensemble.py``), one subprocess each, so that the suite's
    workers run them side by side.
    """
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(workdir), ",".join(names)],
        cwd=ROOT,
        env=devices_environment(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-5000:]
    return {**json.loads(lines[-1][len("RESULTS ") :]), "workdir": str(workdir)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_checks(
        tmp_path_factory.mktemp("sharding"),
        ["train_steps", "gradients", "memory", "checkpoint", "errors"],
    )


@pytest.mark.parametrize("tied", ["tied", "untied"])
@pytest.mark.parametrize("shape", MESHES)
def test_train_step_matches_one_device(results, tied, shape):
    check = results["train_steps"][f"{tied} ({shape[0]}, {shape[1]})"]
    for name in ("loss", "metrics", "grads", "params"):
        assert check[name] < TOLERANCE, name
    # The [V, D] tables (and Adam's moments of the embedding) are split over
    # the vocabulary on "model", behind the unsplit members axis; other
    # parameters are replicated.
    assert check["table_rows_per_device"] == 32 // shape[1]
    assert check["table_spec"] == check["moment_spec"] == "P(None, 'model', None)"
    assert check["kernel_spec"] == "P(None,)"
    # Nothing in the step, the embedding lookup included, gathers a table.
    assert check["all_gathers"] == 0


def test_gradients_match_one_device(results):
    differences = results["gradients"]
    assert len(differences) == 6
    # Relative to the largest value or gradient entry (the weighted sums of
    # "none" reach hundreds).
    assert max(differences.values()) < TOLERANCE, differences


def test_no_device_holds_the_logits_or_the_table(results):
    memory = results["memory"]
    # The check can fail: on one device the [N, V] logits are there.
    assert memory["single_largest"] >= memory["logits"]
    assert memory["parallel_largest"] < memory["table"] < memory["logits"]
    # Each of the 8 devices needs less scratch memory than its share of the
    # single device's.
    assert memory["parallel_temp_bytes"] < memory["single_temp_bytes"] / 8


@pytest.mark.parametrize("target", ["(2, 4)", "(8, 1)", "None"])
def test_checkpoint_restores_on_another_mesh(results, target):
    restored = results["checkpoint"][target]
    assert restored["difference"] == 0.0 and restored["step"] == 0
    model_ways = {"(2, 4)": 4, "(8, 1)": 1, "None": 1}[target]
    assert restored["rows_per_device"] == 32 // model_ways
    assert restored["devices"] == (1 if target == "None" else 8)


@pytest.mark.parametrize(
    "name,match",
    [
        ("product", "must equal the number of devices, 8; got 3 x 2"),
        ("split", "mesh.model = 3 does not divide the 8 devices"),
        (
            "vocabulary",
            r"embed/embedding has shape \(84, 4\).*divisible by mesh "
            r"axes \('model',\) of size 8",
        ),
        ("batch", r"batch size \(12\) must be divisible by the mesh's data axis"),
        ("loss rows", r"w has 12 rows, which the mesh's 'model' axis \(8\)"),
    ],
)
def test_errors_on_many_devices(results, name, match):
    import re

    assert results["errors"][name] is not None
    assert re.search(match, results["errors"][name]), results["errors"][name]


def test_errors_on_one_device():
    """The vocabulary-parallel loss's own: test_vocab_parallel.py."""
    from lmhead.lm import sharding

    with pytest.raises(ValueError, match="must equal the number of devices"):
        sharding.make_mesh(2, 1)
    with pytest.raises(ValueError, match="cannot both be -1"):
        sharding.make_mesh(-1, -1)
    with pytest.raises(ValueError, match="mesh.model must be a positive"):
        sharding.make_mesh(1, 0)
    with pytest.raises(ValueError, match="go together"):
        sharding.initialize_distributed("127.0.0.1:1234")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two more processes, each compiling the tiny run (~30 s)
def test_two_processes_match_one(tmp_path):
    """Two processes of 4 devices each (the same 8-device mesh) train the
    reference run's config; only process 0 writes; the losses match."""
    workdir = str(tmp_path / "run")
    address = f"127.0.0.1:{_free_port()}"
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "experiments/train.py",
                *RUN_ARGS,
                f"--workdir={workdir}",
                f"--coordinator_address={address}",
                "--num_processes=2",
                f"--process_id={index}",
            ],
            cwd=ROOT,
            env=devices_environment(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in processes]
    for p, (_, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-5000:]
    assert "step 4/4" in outputs[0][0] and "step" not in outputs[1][0]
    # The same config on one process with the same 8 devices.
    reference = run_checks(tmp_path / "reference", ["reference_run"])["reference_run"]
    records = read_metrics(workdir)
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for record, expected in zip(records, reference):
        assert record.keys() == expected.keys()
        for name, value in expected.items():
            assert abs(record[name] - value) <= TOLERANCE * max(1, abs(value)), name
    assert os.path.exists(os.path.join(workdir, "summary.json"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
