r"""Training speed, side by side with nanoGPT: tokens/s, FLOP rates, ratio.

    python experiments/bench/bench_train.py                      # nanogpt,tied
    python experiments/bench/bench_train.py --nanogpt=/tmp/nanoGPT
    python experiments/bench/bench_train.py --quick --nanogpt=/tmp/nanoGPT  # 3 rounds of 3 steps, a 256 matmul
    python experiments/bench/bench_train.py --config=nanogpt,tied,bpe=2048 \
        --loss_impl=materialized --loss_impl=fused
    python experiments/bench/bench_train.py --profile     # where a step's time goes
    python experiments/bench/bench_train.py --ensemble ...   # = bench_ensemble.py ...

lmhead's train step on one device and on one per CPU, and nanoGPT's
(``--nanogpt``, a checkout of karpathy/nanoGPT, imported from there, never
copied here), timed in alternating rounds on the same batches with the
machine's matmul rate; ``--profile`` times the step's stages and each of its
matmuls alone. ``docs/benchmarks.md`` says how; ``docs/nanogpt_parity.md``
has the results.
"""

import collections
import contextlib
import functools
import importlib.util
import io
import math
import os
import re
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags

from lmhead.lm import configuration, data, sharding, train
from lmhead.lm import state as state_lib

flags.DEFINE_multi_string(
    "config", ["nanogpt,tied"], "configs/default.py arguments; one benchmark each."
)
flags.DEFINE_multi_string(
    "loss_impl", [], "config.loss.loss_impl values to compare; none: the config's own."
)
flags.DEFINE_string("nanogpt", None, "A karpathy/nanoGPT checkout (needs torch).")
flags.DEFINE_multi_integer(
    "devices",
    None,
    "Devices of each timed mesh, the batch split over them; default: 1 and, "
    "on a CPU, one per CPU (JAX then makes one device per CPU).",
)
flags.DEFINE_integer("steps", 20, "Timed steps per program per round.", lower_bound=1)
flags.DEFINE_integer("rounds", 10, "Rounds of alternation (medians).", lower_bound=1)
timing.cli.matmul_size_flag(1024)
timing.cli.quick_flag()
flags.DEFINE_bool(
    "profile", False, "Also the one-device step's stages and each of its matmuls."
)
flags.DEFINE_bool(
    "ensemble",
    False,
    "Run experiments/bench/bench_ensemble.py instead, the other arguments "
    "being its flags (e.g. --ensemble --runs_per_hour).",
)
FLAGS = flags.FLAGS

WARMUP_STEPS = 5
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def model_flops_per_token(config, vocab_size: int) -> float:
    """``6 N + 6 L T D`` with N the matmul parameters (see the module doc)."""
    m, T = config.model, config.data.block_size
    per_block = 4 * m.d_model**2 + 2 * m.d_model * m.mlp_dim
    matmul_params = m.num_layers * per_block + vocab_size * m.d_model
    return 6 * matmul_params + 6 * m.num_layers * T * m.d_model


def lmhead_setup(config, dataset, batches, num_devices: int):
    """``(model, mesh, state, sharded, dropout_key)``: lmhead's model, a mesh
    of the first ``num_devices`` devices, a fresh train state and the
    ``batches`` (by ``id``) sharded over it, and a dropout key."""
    model = configuration.make_model(config, dataset.vocab_size)
    mesh = sharding.make_mesh(num_devices, 1, devices=jax.devices()[:num_devices])
    init_key, dropout_key = sharding.replicate(
        tuple(jax.random.split(jax.random.key(0))), mesh
    )
    init = functools.partial(state_lib.create_train_state, model, config)
    shardings = sharding.tree_shardings(jax.eval_shape(init, init_key), mesh)
    state = jax.jit(init, out_shardings=shardings)(init_key)
    sharded = {id(b): sharding.shard_batch(b, mesh) for b in batches}
    return model, mesh, state, sharded, dropout_key


def lmhead_program(config, dataset, batches, num_devices: int):
    """``(run(batches), train_fn)``: lmhead's compiled train step of a single
    run (a program of one, ``train.compile_steps``) on the first
    ``num_devices`` devices; ``run`` dispatches every step and waits once, at
    the end, as the training loop does."""
    model, mesh, state, _, _ = lmhead_setup(config, dataset, batches, num_devices)

    def one(tree):
        return jax.tree.map(lambda x: x[None], tree)

    shardings = sharding.stacked_shardings(jax.eval_shape(one, state), mesh)
    state = jax.jit(one, out_shardings=shardings)(state)
    sharded = {id(b): sharding.shard_members(one(b), mesh) for b in batches}
    keys = sharding.replicate(jax.random.split(jax.random.key(0))[1:], mesh)
    active = sharding.replicate(np.ones(1, bool), mesh)
    train_fn, _, _ = train.compile_steps(
        model, [config], state, sharded[id(batches[0])], keys, {}, mesh
    )
    holder = [state]

    def run(round_batches):
        for batch in round_batches:
            holder[0], metrics = train_fn(
                holder[0], sharded[id(batch)], keys, {}, active
            )
        jax.block_until_ready(metrics)

    return run, train_fn


def stage_programs(config, dataset, batches) -> dict:
    """``{stage: run(batches)}`` of the one-device step's "forward" (its
    loss, ``train.accumulate`` over its microbatches) and "forward +
    backward" (its ``jax.value_and_grad``), each jitted on its own."""
    model, mesh, state, sharded, dropout_key = lmhead_setup(config, dataset, batches, 1)
    loss_fn = functools.partial(
        train.train_loss, model=model, loss_kwargs=train.loss_keywords(config.loss)
    )

    def program(fn):
        part = functools.partial(
            train.accumulate, fn, microbatches=config.train.microbatches
        )
        with jax.set_mesh(mesh):
            compiled = (
                jax.jit(part)
                .lower(state.params, sharded[id(batches[0])], dropout_key)
                .compile()
            )

        def run(round_batches):
            for batch in round_batches:
                result = compiled(state.params, sharded[id(batch)], dropout_key)
            jax.block_until_ready(result)

        return run

    return {
        "forward": program(loss_fn),
        "forward + backward": program(jax.value_and_grad(loss_fn, has_aux=True)),
    }


def shape_of(text: str) -> tuple[str, tuple[int, ...]]:
    """``("f32", (384, 128))`` of an HLO array shape ``"f32[384,128]"``."""
    element_type, dims = re.fullmatch(r"(\w+)\[([\d,]*)\]", text).groups()
    return element_type, tuple(int(d) for d in dims.split(",") if d)


class Dot(NamedTuple):
    """An HLO ``dot``: its operand and result shapes (``"f32[384,128]"``) and
    its dimension numbers, as ``lax.dot_general`` takes them:
    ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``."""

    lhs: str
    rhs: str
    out: str
    dimension_numbers: tuple

    def __str__(self):
        (lhs_c, rhs_c), (lhs_b, rhs_b) = [
            ["{" + ",".join(map(str, d)) + "}" for d in pair]
            for pair in self.dimension_numbers
        ]
        batch = f"batch {lhs_b} x {rhs_b}, " if self.dimension_numbers[1][0] else ""
        return (
            f"{self.lhs} x {self.rhs} -> {self.out} ({batch}contracting "
            f"{lhs_c} x {rhs_c})"
        )

    @property
    def flops(self) -> int:
        """2 multiply-adds per output element and contracted index."""
        lhs, out = shape_of(self.lhs)[1], shape_of(self.out)[1]
        contracting = self.dimension_numbers[0][0]
        return 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)


_COMPUTATION = re.compile(r"(?:ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"\s+(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*)$")


def parse_dot(operands: str, shapes: dict[str, str], name: str) -> Dot:
    """The :class:`Dot` of the HLO instruction ``name``, from the text after
    its ``dot(`` (``operands``) and the shapes of its computation's
    instructions so far (``shapes``, by name, its own included)."""
    lhs, rhs = re.match(r"%([\w.-]+), %([\w.-]+)\)", operands).groups()
    dims = {
        key: tuple(int(d) for d in found[1].split(",") if d)
        if (found := re.search(key + r"=\{([\d,]*)\}", operands))
        else ()
        for key in (
            "lhs_batch_dims",
            "rhs_batch_dims",
            "lhs_contracting_dims",
            "rhs_contracting_dims",
        )
    }
    return Dot(
        shapes[lhs],
        shapes[rhs],
        shapes[name],
        (
            (dims["lhs_contracting_dims"], dims["rhs_contracting_dims"]),
            (dims["lhs_batch_dims"], dims["rhs_batch_dims"]),
        ),
    )


def step_dots(hlo: str) -> collections.Counter:
    """How many times one run of the compiled HLO module ``hlo`` (its
    ``as_text()``) runs each distinct :class:`Dot`.

    A computation's dots count once per call of it from the entry
    computation down: fusions (``calls=``), ``to_apply=``, and a while
    loop's ``body=`` once per trip (XLA's ``known_trip_count``).

    Raises:
        ValueError: a loop without a known trip count, or dots in a
            computation reached in another way (e.g. a conditional's branch).
    """
    shapes, dots, calls, entry = {}, {}, {}, None
    for line in hlo.splitlines():
        if match := _COMPUTATION.match(line):
            computation = match[1]
            if line.startswith("ENTRY"):
                entry = computation
            shapes[computation], dots[computation], calls[computation] = ({}, [], [])
            continue
        if not (match := _INSTRUCTION.match(line)):
            continue
        name, shape, op, rest = match.groups()
        shapes[computation][name] = re.sub(r"\{.*\}$", "", shape)
        if op == "dot":
            dots[computation].append(parse_dot(rest, shapes[computation], name))
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
        for kind, callee in re.findall(r"\b(calls|to_apply|body)=%([\w.-]+)", rest):
            if kind == "body" and not trips:
                raise ValueError(f"The loop {name} has no known trip count.")
            calls[computation].append((callee, int(trips[1]) if kind == "body" else 1))
    counts, reached = collections.Counter(), set()

    def visit(computation, times):
        reached.add(computation)
        for dot in dots[computation]:
            counts[dot] += times
        for callee, trips in calls[computation]:
            visit(callee, times * trips)

    visit(entry, 1)
    missed = [c for c, found in dots.items() if found and c not in reached]
    if missed:
        raise ValueError(f"Dots in computations not counted: {missed}.")
    return counts


def dot_program(dot: Dot, count: int):
    """``run(batches)`` of ``dot`` alone: a jitted ``lax.dot_general`` on
    random operands of its shapes, ``count`` times per batch in a
    ``lax.fori_loop`` (``docs/benchmarks.md``).

    Raises:
        ValueError: the compiled program does not run exactly ``count``
            such dots.
    """
    (lhs_type, lhs_shape), (rhs_type, rhs_shape), (out_type, out_shape) = map(
        shape_of, dot[:3]
    )
    lhs_key, rhs_key = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(lhs_key, lhs_shape, DTYPES[lhs_type])
    rhs = jax.random.normal(rhs_key, rhs_shape, DTYPES[rhs_type])
    dot_general = functools.partial(
        jax.lax.dot_general,
        dimension_numbers=dot.dimension_numbers,
        preferred_element_type=DTYPES[out_type],
    )

    def repeated(lhs, rhs):
        def again(_, operands_and_result):
            lhs, rhs, _ = jax.lax.optimization_barrier(operands_and_result)
            return lhs, rhs, dot_general(lhs, rhs)

        return jax.lax.fori_loop(
            0, count, again, (lhs, rhs, jnp.zeros(out_shape, DTYPES[out_type]))
        )[2]

    compiled = jax.jit(repeated).lower(lhs, rhs).compile()
    if (runs := step_dots(compiled.as_text())) != {dot: count}:
        raise ValueError(f"The program timing {count} of {dot} runs {dict(runs)}.")

    def run(round_batches):
        for _ in round_batches:
            result = compiled(lhs, rhs)
        jax.block_until_ready(result)

    return run


def nanogpt_incompatibility(config) -> str | None:
    """Why nanoGPT cannot train ``config``'s model, or None if it can."""
    m = config.model
    reasons = {
        "an untied head": not m.tied,
        "rotary positions": m.positions != "learned",
        "a head bias, scale or softcap": m.head_bias
        or m.head_scale is not None
        or m.logits_softcap is not None,
        f"dtype {m.dtype}": m.dtype != "float32",
    }
    found = [reason for reason, present in reasons.items() if present]
    return f"nanoGPT cannot train {', '.join(found)}" if found else None


def nanogpt_program(path: str, config, vocab_size: int, batches):
    """``run(batches)`` of nanoGPT's training step (model.py from ``path``)."""
    import torch  # only here: torch is a peer, not a dependency

    module = configuration.load_module(os.path.join(path, "model.py"))
    torch.set_num_threads(sharding.available_cpus())
    torch.manual_seed(0)
    m, o = config.model, config.optim
    gpt_config = module.GPTConfig(
        block_size=config.data.block_size,
        vocab_size=vocab_size,
        n_layer=m.num_layers,
        n_head=m.num_heads,
        n_embd=m.d_model,
        dropout=m.dropout_rate,
        bias=m.use_bias,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # its parameter counts
        gpt = module.GPT(gpt_config)
        optimizer = gpt.configure_optimizers(o.weight_decay, o.lr, (o.b1, o.b2), "cpu")
    gpt.train()
    tensors = {
        id(b): tuple(
            torch.from_numpy(b[k].astype(np.int64)) for k in ("inputs", "labels")
        )
        for b in batches
    }

    def run(round_batches):
        for batch in round_batches:
            inputs, labels = tensors[id(batch)]
            _, loss = gpt(inputs, labels)
            loss.backward()
            if o.grad_clip:
                torch.nn.utils.clip_grad_norm_(gpt.parameters(), o.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def alternate(programs: dict, batches, matmul: timing.Matmul, rounds: int) -> dict:
    """Median wall and CPU seconds per step of each program, and the median
    of the matmul's fastest time per round (``timing.alternate``)."""
    for run in programs.values():
        run(batches[:WARMUP_STEPS])
    timed = batches[WARMUP_STEPS:]
    times = timing.alternate(
        {name: functools.partial(run, timed) for name, run in programs.items()},
        matmul,
        rounds,
    )
    return {
        name: t if name == "matmul" else t / len(timed) for name, t in times.items()
    }


def lmhead_programs(
    arg: str, config, dataset, batches, loss_impls, device_counts, profile: bool
) -> tuple[dict, dict, dict, dict]:
    """``(programs, XLA's FLOPs of each, the profiled parts, the dots of each
    profiled step)`` by name, for each loss implementation and device count."""
    programs, xla_flops, profiled, step_dot_counts = {}, {}, {}, {}
    for loss_impl in loss_impls or [config.loss.loss_impl]:
        variant = config.copy_and_resolve_references()
        variant.loss.loss_impl = loss_impl
        configuration.validate_config(variant)
        for count in device_counts:
            if config.train.batch_size % count:
                print(
                    f"{arg}: {count} devices skipped: they do not divide "
                    f"the batch of {config.train.batch_size}."
                )
                continue
            name = f"lmhead {loss_impl}, {count} device{'s' * (count > 1)}"
            programs[name], train_fn = lmhead_program(variant, dataset, batches, count)
            xla_flops[name] = count * (train_fn.cost_analysis() or {}).get(
                "flops", float("nan")
            )
            if profile and count == 1:
                step_dot_counts[name] = step_dots(train_fn.as_text())
                parts = {
                    **stage_programs(variant, dataset, batches),
                    **{
                        str(dot): dot_program(dot, n)
                        for dot, n in step_dot_counts[name].items()
                    },
                }
                profiled.update({f"{name}: {part}": run for part, run in parts.items()})
    return programs, xla_flops, profiled, step_dot_counts


def nanogpt_skip_reason(nanogpt: str | None, config) -> str | None:
    """Why nanoGPT's column is skipped, or None when it runs."""
    if not nanogpt:
        return "no --nanogpt checkout"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if not os.path.isfile(os.path.join(nanogpt, "model.py")):
        return f"no {nanogpt}/model.py"
    return nanogpt_incompatibility(config)


def bench(
    arg: str,
    loss_impls: list[str],
    device_counts: list[int],
    nanogpt: str | None,
    steps: int,
    rounds: int,
    matmul: timing.Matmul,
    profile: bool,
) -> None:
    """Times lmhead's programs (and nanoGPT's) for the config ``arg`` in
    alternation with ``matmul`` and prints their lines and profiles."""
    config = configuration.load_config(arg)
    configuration.validate_config(config)
    dataset = data.load_dataset(config.data)
    batches = [
        data.train_batch(
            dataset.train_tokens,
            seed=0,
            step=s,
            batch_size=config.train.batch_size,
            block_size=config.data.block_size,
        )
        for s in range(WARMUP_STEPS + steps)
    ]
    programs, xla_flops, profiled, step_dot_counts = lmhead_programs(
        arg, config, dataset, batches, loss_impls, device_counts, profile
    )
    skip = nanogpt_skip_reason(nanogpt, config)
    if skip is None:
        programs["nanoGPT"] = nanogpt_program(
            nanogpt, config, dataset.vocab_size, batches
        )
    times = alternate({**programs, **profiled}, batches, matmul, rounds)
    tokens = config.train.batch_size * config.data.block_size
    flops = model_flops_per_token(config, dataset.vocab_size) * tokens
    print(
        f"\n{arg}: V={dataset.vocab_size}, {tokens} tokens and "
        f"{flops / 1e9:.2f} model GFLOP per step"
        + (f"; nanoGPT skipped: {skip}" if skip else "")
    )
    rate = matmul.flops / times["matmul"][0]
    print_times(
        {name: times[name] for name in programs}, tokens, flops, rate, xla_flops
    )
    for name, dots in step_dot_counts.items():
        print_profile(name, times, dots, rate)


def print_times(
    times: dict, tokens: int, flops: float, rate: float, xla_flops: dict
) -> None:
    """One line per program: time, tokens/s, FLOP rate, ratio to nanoGPT."""
    print(
        f"  float32 matmul {rate / 1e9:.1f} GFLOP/s: every model FLOP at "
        f"that rate would take {1e3 * flops / rate:.1f} ms/step"
    )
    for name, (wall, cpu) in times.items():
        if name == "matmul":
            continue
        line = (
            f"  {name:24s} {1e3 * wall:7.2f} ms/step (CPU time "
            f"{1e3 * cpu:7.2f} ms)  {tokens / wall:9,.0f} tokens/s  "
            f"{flops / wall / 1e9:6.1f} GFLOP/s = {flops / wall / rate:4.0%}"
            " of matmul"
        )
        if name in xla_flops:
            line += f"  (XLA count {xla_flops[name] / 1e9:.2f} GFLOP/step)"
        if "nanoGPT" in times and name != "nanoGPT":
            ratio = times["nanoGPT"] / times[name]
            line += (
                f"  {ratio[0]:.2f}x nanoGPT's tokens/s ({ratio[1]:.2f}x per CPU second)"
            )
        print(line, flush=True)


def print_profile(
    name: str, times: dict, dots: collections.Counter, rate: float
) -> None:
    """``--profile``'s tables of the one-device step ``name``: its stages,
    then its matmuls, each alone at its own shapes, against the step."""
    step = times[name]
    forward = times[f"{name}: forward"]
    gradient = times[f"{name}: forward + backward"]
    stages = {
        "forward (the loss)": forward,
        "forward + backward (value_and_grad)": gradient,
        "train step (+ optimizer)": step,
        "backward = forward + backward - forward": gradient - forward,
        "optimizer = train step - (forward + backward)": step - gradient,
    }
    rows = [
        (stage, f"{1e3 * wall:.2f}", f"{1e3 * cpu:.2f}", f"{wall / step[0]:.0%}")
        for stage, (wall, cpu) in stages.items()
    ]
    header = [f"{name}: stage", "ms/step (wall)", "CPU ms/step", "of the step"]
    print("\n" + timing.table(header, rows))
    total, rows = np.zeros(2), []
    for dot, count in sorted(
        dots.items(), key=lambda item: -times[f"{name}: {item[0]}"][0]
    ):
        wall, cpu = times[f"{name}: {dot}"]
        total += (wall, cpu)
        rows.append((
            dot, count, f"{dot.flops / 1e6:.2f}", f"{1e3 * wall / count:.3f}",
            f"{1e3 * wall:.2f}", f"{count * dot.flops / wall / 1e9:.1f}",
        ))  # fmt: skip
    header = [f"{name}: dot", "per step", "MFLOP", "ms each", "ms/step", "GFLOP/s"]
    print("\n" + timing.table(header, rows))
    dot_flops = sum(count * dot.flops for dot, count in dots.items())
    print(
        f"\n  {sum(dots.values())} dots per step, {dot_flops / 1e9:.2f} "
        f"GFLOP: {1e3 * total[0]:.2f} ms at their own shapes "
        f"({dot_flops / total[0] / 1e9:.1f} GFLOP/s), "
        f"{1e3 * dot_flops / rate:.2f} ms at the square matmul's "
        f"{rate / 1e9:.1f} GFLOP/s"
    )
    print(
        f"  matmuls at this step's own shapes: {1e3 * total[0]:.2f} ms of "
        f"the step's {1e3 * step[0]:.2f} ms ({total[0] / step[0]:.0%}); CPU "
        f"time {1e3 * total[1]:.2f} ms of {1e3 * step[1]:.2f} ms "
        f"({total[1] / step[1]:.0%})",
        flush=True,
    )


def device_counts() -> list[int]:
    """``--devices``, or 1 and (on a CPU) the number of CPUs; on a CPU, makes
    JAX give the process one device per CPU (before its backends start)."""
    counts = FLAGS.devices or [1, sharding.available_cpus()]
    jax.config.update("jax_num_cpu_devices", max(counts))  # CPU backend only
    if jax.default_backend() != "cpu" and not FLAGS.devices:
        counts = [1]
    return sorted(set(counts))


def main(argv):
    del argv
    counts = device_counts()
    if FLAGS.profile and 1 not in counts:
        raise app.UsageError(
            "--profile profiles the one-device step: --devices must include 1."
        )
    steps, rounds, size = (
        (3, 3, 256) if FLAGS.quick else (FLAGS.steps, FLAGS.rounds, FLAGS.matmul_size)
    )
    print(f"{timing.machine()}; {rounds} rounds of {steps} steps, medians", flush=True)
    matmul = timing.Matmul(size)
    for arg in FLAGS.config:
        bench(
            arg,
            FLAGS.loss_impl,
            counts,
            FLAGS.nanogpt,
            steps,
            rounds,
            matmul,
            FLAGS.profile,
        )


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing of ``argv``; with ``--ensemble``, this process becomes
    ``python bench_ensemble.py`` with the other arguments (``os.execv``)."""
    switches = {"--ensemble", "--ensemble=true", "--ensemble=1"}
    if switches & {arg.lower() for arg in argv[1:]}:
        here = os.path.dirname(os.path.abspath(__file__))
        script = os.path.join(here, "bench_ensemble.py")
        rest = [arg for arg in argv[1:] if arg.lower() not in switches]
        os.execv(sys.executable, [sys.executable, script, *rest])
    return app.parse_flags_with_usage(argv)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
