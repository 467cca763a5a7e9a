r"""Ensembles against separate runs: member-steps per second of one program,
runs finished per hour for a slice of the tying study, and a GPU preset.

    python experiments/bench/bench_ensemble.py                 # member-steps/s
    python experiments/bench/bench_ensemble.py --members=8 --shapes=nanogpt,tied
    python experiments/bench/bench_ensemble.py --runs_per_hour # 16 study runs
    python experiments/bench/bench_ensemble.py --runs_per_hour --slice_steps=200
    python experiments/bench/bench_ensemble.py --gpu           # a few minutes
    python experiments/bench/bench_ensemble.py --quick         # tiny sizes in every mode, for tests

``experiments/bench/bench_train.py --ensemble [FLAGS]`` is the same command;
the programs are ``lmhead/lm/train.py``'s. ``docs/benchmarks.md`` says
what each mode times, docs/training.md ("Speed of an ensemble") how, and
what it measured.
"""

import dataclasses
import functools
import os
from typing import Any, NamedTuple

import ensemble_runs  # experiments/bench/ensemble_runs.py, beside this file
import jax
import jax.numpy as jnp
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lmhead.lm import configuration, data, sharding, train
from lmhead.lm import program as program_lib
from lmhead.lm import state as state_lib

SEPARATE = "separate steps"
# The members' values that enter the step as arrays (members.TRACED_KEYS).
VALUE_KEYS = ("optim.lr", "optim.min_lr")
# Issue 22's target: member-steps/s at M = 8 on the nanogpt shape against
# separate steps (ensemble_runs.py has the runs-per-hour one).
TARGET_SHAPE, TARGET_MEMBERS, TARGET_STEPS_RATIO = "nanogpt,tied", 8, 1.1


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the modes measure: the flags' values, or :data:`QUICK`'s."""

    shapes: tuple[str, ...] = ("nanogpt,tied", "nanogpt,tied,bpe=2048")
    members: tuple[int, ...] = (1, 4, 8, 16)
    vmap_sizes: tuple[int, ...] = (1, 2, 4)
    train_fraction: float = 0.03
    steps: int = 10
    rounds: int = 7
    matmul_size: int = 1024
    slice: str = "bpe=2048,char=false,amounts=1.0,arms=a,tune=false,seeds=16"
    slice_steps: int | None = None
    slice_members: tuple[int, ...] = (8, 16)
    gpu_shape: str = "nanogpt,tied"
    gpu_members: tuple[int, ...] = (1, 16, 64, 256)
    max_members: int = 2**16


QUICK = Settings(
    shapes=("tiny",),
    members=(2,),
    vmap_sizes=(1,),
    steps=2,
    rounds=2,
    matmul_size=128,
    slice="tiny,char=false,amounts=0.05,arms=a,tune=false,seeds=4",
    slice_steps=10,
    slice_members=(2,),
    gpu_shape="tiny",
    gpu_members=(2,),
    max_members=4,
)
DEFAULTS = Settings()

flags.DEFINE_multi_string(
    "shapes", list(DEFAULTS.shapes), "configs/default.py arguments; a table each."
)
flags.DEFINE_multi_integer("members", list(DEFAULTS.members), "Member counts M.")
flags.DEFINE_multi_integer(
    "vmap_sizes",
    list(DEFAULTS.vmap_sizes),
    "Members per vmap timed below M (1: a lax.map); M itself (one vmap) always.",
)
flags.DEFINE_float(
    "train_fraction",
    DEFAULTS.train_fraction,
    "data.train_fraction of the shapes (what BPE trains on).",
)
flags.DEFINE_integer(
    "steps", DEFAULTS.steps, "Ensemble steps per program per round.", lower_bound=1
)
flags.DEFINE_integer(
    "rounds", DEFAULTS.rounds, "Rounds of alternation (medians).", lower_bound=1
)
timing.cli.matmul_size_flag(DEFAULTS.matmul_size)
timing.cli.quick_flag()
flags.DEFINE_bool(
    "runs_per_hour", False, "Time a slice of the tying study as processes instead."
)
flags.DEFINE_string(
    "slice", DEFAULTS.slice, "configs/sweeps/tying_study.py arguments of one cell."
)
flags.DEFINE_integer(
    "slice_steps", None, "train.steps of the slice's runs; default the study's."
)
flags.DEFINE_multi_integer(
    "slice_members", list(DEFAULTS.slice_members), "Members per ensemble program."
)
flags.DEFINE_integer(
    "cpu_devices",
    None,
    "Devices of the CPU backend; default: one per CPU this process may use, "
    "as experiments/train.py gives an ensemble. Separate steps run on the "
    "first; the members are split over as many as divide them.",
    lower_bound=1,
)
flags.DEFINE_bool("gpu", False, "The GPU preset instead (see the module docstring).")
flags.DEFINE_string("gpu_shape", DEFAULTS.gpu_shape, "The GPU preset's shape.")
flags.DEFINE_multi_integer(
    "gpu_members", list(DEFAULTS.gpu_members), "The GPU preset's member counts."
)
flags.DEFINE_integer(
    "max_members", DEFAULTS.max_members, "The GPU preset's cap on M.", lower_bound=1
)
FLAGS = flags.FLAGS


# --- The programs ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """A benchmarked shape: ``configs/default.py:name`` with overrides, its
    model, training tokens and vocabulary size."""

    name: str
    config: Any
    model: Any
    tokens: np.ndarray
    vocab_size: int
    init: Any  # [M] keys -> the stacked initial states, jitted once


def load_shape(name: str, overrides: dict[str, Any]) -> Shape:
    """The shape of the config argument ``name`` with ``overrides`` (dotted keys)."""
    config = configuration.load_config(name)
    config.update_from_flattened_dict(overrides)
    configuration.validate_config(config)
    dataset = data.load_dataset(config.data)
    model = configuration.make_model(config, dataset.vocab_size)
    init = functools.partial(state_lib.create_train_state, model, config)
    return Shape(
        name,
        config,
        model,
        dataset.train_tokens,
        dataset.vocab_size,
        jax.jit(jax.vmap(init)),
    )


@dataclasses.dataclass(frozen=True)
class Members:
    """``M`` members of a shape, as their ensemble starts (:func:`make_members`).

    Attributes:
        state: the stacked initial train states (leaves ``[M, ...]``).
        dropout_keys: ``[M]`` keys, each its single run's.
        values: ``{"optim.lr": [M], "optim.min_lr": [M]}`` float32.
        active: ``[M]`` True.
        batches: per step, the stacked batches ``{"inputs", "labels"}: [M, B, T]``.
    """

    state: Any
    dropout_keys: jax.Array
    values: dict[str, jax.Array]
    active: jax.Array
    batches: list[dict[str, jax.Array]]

    @property
    def count(self) -> int:
        return self.active.shape[0]


def make_members(shape: Shape, count: int, steps: int) -> Members:
    """``count`` members of ``shape`` with ``steps`` batches each: member k
    has seed k, ``optim.lr = lr (1 + k / count)`` and ``optim.min_lr`` in the
    same proportion to it as the config's; its initial state, dropout key and
    batches are a single run's with seed k (``train.train_and_evaluate``)."""
    config = shape.config
    seeds = np.arange(count)
    lrs = config.optim.lr * (1 + seeds / count)
    values = {
        "optim.lr": jnp.asarray(lrs, jnp.float32),
        "optim.min_lr": jnp.asarray(
            lrs * config.optim.min_lr / config.optim.lr, jnp.float32
        ),
    }
    keys = jax.vmap(lambda seed: jax.random.split(jax.random.key(seed), 3))(seeds)
    state = shape.init(keys[:, 0])
    batches = []
    for step in range(steps):
        own = [
            data.train_batch(
                shape.tokens,
                seed=int(seed),
                step=step,
                batch_size=config.train.batch_size,
                block_size=config.data.block_size,
            )
            for seed in seeds
        ]
        batches.append(jax.device_put(jax.tree.map(lambda *xs: np.stack(xs), *own)))
    return Members(state, keys[:, 1], values, jnp.ones(count, bool), batches)


def single_run_step(state, batch, key, values, *, model, config):
    """``train.train_step`` of one run, its ``values`` (``{"optim.lr":
    scalar, "optim.min_lr": scalar}``) arguments instead of constants, so
    that one compile serves every member. Returns the new state and metrics."""
    optim = {name.split(".")[1]: value for name, value in values.items()}
    new_state, metrics = train.train_step(
        state.replace(tx=state_lib.make_optimizer(config, optim)),
        batch,
        key,
        model=model,
        loss_kwargs=train.loss_keywords(config.loss),
        learning_rate_fn=state_lib.learning_rate_schedule(config, optim),
        microbatches=config.train.microbatches,
    )
    return new_state.replace(tx=state.tx), metrics


class SingleRunStep(NamedTuple):
    """:func:`single_run_step` compiled, and the optimizer its states carry
    (static in a ``TrainState``, so part of the compiled step's input type)."""

    step: Any
    tx: Any


def compile_single_run_step(shape: Shape) -> SingleRunStep:
    """:func:`single_run_step` jitted (state donated) and compiled for ``shape``."""
    config = shape.config
    key = jax.random.key(0)
    init = functools.partial(state_lib.create_train_state, shape.model, config)
    state = jax.eval_shape(init, key)
    batch = data.train_batch(
        shape.tokens,
        seed=0,
        step=0,
        batch_size=config.train.batch_size,
        block_size=config.data.block_size,
    )
    values = {name: jax.ShapeDtypeStruct((), jnp.float32) for name in VALUE_KEYS}
    step = functools.partial(single_run_step, model=shape.model, config=config)
    compiled = (
        jax.jit(step, donate_argnums=0).lower(state, batch, key, values).compile()
    )
    return SingleRunStep(compiled, state.tx)


# Jitted, as the small operations on whole trees below are: one compile per
# tree structure instead of one per leaf shape and operation.
@jax.jit
def member_of(tree: Any, index: int) -> Any:
    """Member ``index``'s slice of every leaf of a stacked ``tree``."""
    return jax.tree.map(lambda x: x[index], tree)


@jax.jit
def stack_members(trees: list) -> Any:
    """The members' ``trees`` stacked on a new leading axis, leaf by leaf."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@jax.jit
def copy_tree(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


@dataclasses.dataclass
class SeparateSteps:
    """The members as separate runs: ``self()`` runs the compiled single-run
    ``step`` on each member's state for each step's batch; ``states`` are
    the members' states now."""

    step: Any
    states: list
    batches: list[list[dict]]  # [step][member]
    keys: list
    values: list[dict]

    def __call__(self) -> list:
        for batch in self.batches:
            for index, own in enumerate(batch):
                self.states[index], _ = self.step(
                    self.states[index], own, self.keys[index], self.values[index]
                )
        return self.states


def separate_program(members: Members, single: SingleRunStep) -> SeparateSteps:
    """:class:`SeparateSteps` of ``members`` with the compiled single-run step."""
    indices = range(members.count)
    return SeparateSteps(
        single.step,
        [member_of(members.state, k).replace(tx=single.tx) for k in indices],
        [[member_of(b, k) for k in indices] for b in members.batches],
        [members.dropout_keys[k] for k in indices],
        [member_of(members.values, k) for k in indices],
    )


@dataclasses.dataclass
class EnsembleSteps:
    """The members as one program: ``self()`` runs the compiled ensemble
    ``step`` once per step's stacked batch; ``state`` is the stacked state now."""

    step: Any
    state: Any
    members: Members

    def __call__(self) -> Any:
        m = self.members
        for batch in m.batches:
            self.state, _ = self.step(
                self.state, batch, m.dropout_keys, m.values, m.active
            )
        return self.state


def ensemble_program(
    shape: Shape, members: Members, vmap_size: int, devices: int = 1, copy: bool = True
) -> EnsembleSteps:
    """:class:`EnsembleSteps` of ``train.program_train_step`` with
    ``vmap_size``, jitted with the state donated, on a copy of the members'
    initial state (``copy=False``: on it). With ``devices`` > 1, the members
    split over the first ``devices`` devices (``train.split_over_devices``,
    every array placed on that mesh), as ``train.train_program`` runs them
    with ``mesh.members``."""
    members = dataclasses.replace(
        members, state=copy_tree(members.state) if copy else members.state
    )
    step = functools.partial(
        train.program_train_step,
        vmap_size=vmap_size,
        model=shape.model,
        config=shape.config,
    )
    if devices > 1:
        mesh = sharding.members_mesh(jax.devices()[:devices])
        split = NamedSharding(mesh, P(sharding.MEMBERS_AXIS))
        fields = ("state", "dropout_keys", "values", "active", "batches")
        placed = {k: jax.device_put(getattr(members, k), split) for k in fields}
        members = dataclasses.replace(members, **placed)
        step = train.split_over_devices(step, mesh)
    m = members
    args = (m.state, m.batches[0], m.dropout_keys, m.values, m.active)
    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
    return EnsembleSteps(compiled, m.state, m)


def split_devices(count: int) -> int:
    """The devices ``train.train_program`` splits ``count`` members over by
    default here (``sharding.member_devices``; 1: no split)."""
    mesh = configuration.load_config().mesh
    return sharding.member_devices(
        mesh, count, jax.device_count(), jax.default_backend()
    )


# --- Member-steps per second ------------------------------------------------------


class Row(NamedTuple):
    """One program of a table: seconds per ensemble step, wall and CPU, and
    its largest parameter's difference from the separate steps'."""

    shape: str
    members: int
    form: str
    wall: float
    cpu: float
    gap: float


def form_name(vmap_size: int, count: int) -> str:
    """How :func:`train.over_members` maps ``count`` members in groups of ``vmap_size``.

    Examples:
        >>> [form_name(v, 8) for v in (1, 2, 8)]
        ['lax.map', 'vmap 2 in lax.map', 'vmap']
    """
    if vmap_size >= count:
        return "vmap"
    return "lax.map" if vmap_size == 1 else f"vmap {vmap_size} in lax.map"


def forms(count: int, vmap_sizes) -> list[int]:
    """The vmap sizes timed at ``count`` members: those below it, and itself.

    Examples:
        >>> forms(8, (1, 2, 4)), forms(1, (1, 2, 4)), forms(2, (4,))
        ([1, 2, 4, 8], [1], [2])
    """
    return sorted({v for v in vmap_sizes if v < count} | {count})


def time_members(
    shape: Shape, count: int, vmap_sizes, settings: Settings, matmul, single_step
) -> tuple[list[Row], float]:
    """Separate steps and the ensemble's forms at ``count`` members, timed in
    alternation with ``matmul``: the rows, and the matmul's median seconds."""
    members = make_members(shape, count, settings.steps)
    programs = {SEPARATE: separate_program(members, single_step)}
    for vmap_size in vmap_sizes:
        programs[form_name(vmap_size, count)] = ensemble_program(
            shape, members, vmap_size
        )
    devices = split_devices(count)
    if devices > 1:
        programs[f"{form_name(1, count)} on {devices} devices"] = ensemble_program(
            shape, members, 1, devices
        )
    for run in programs.values():
        jax.block_until_ready(run())  # the first calls after compiling are slower
    times = timing.alternate(programs, matmul, settings.rounds)
    # Every program ran the same steps on the same batches: 1 + rounds calls.
    separate = stack_members([s.params for s in programs[SEPARATE].states])
    rows = []
    for name, program in programs.items():
        params = separate if name == SEPARATE else program.state.params
        rows.append(
            Row(
                shape.name,
                count,
                name,
                *(times[name] / settings.steps),
                largest_difference(params, separate),
            )
        )
    print(f"  {shape.name}: M={count} timed", flush=True)
    return rows, times["matmul"][0]


def largest_difference(tree: Any, other: Any) -> float:
    """``max |a - b|`` over the leaves of two trees of one structure.

    Examples:
        >>> largest_difference({"a": jnp.ones(2)}, {"a": jnp.array([1.0, 1.5])})
        0.5
    """
    return float(_largest_difference(tree, other))


@jax.jit
def _largest_difference(tree, other):
    gaps = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), tree, other)
    return jnp.max(jnp.stack(jax.tree.leaves(gaps)))


def print_table(shape: Shape, rows: list[Row], rate: float) -> None:
    """The table of ``rows``, each against separate steps at its M."""
    tokens = shape.config.train.batch_size * shape.config.data.block_size
    print(
        f"\n{shape.name}: V={shape.vocab_size}, {tokens} tokens per member-step; "
        f"float32 matmul {rate / 1e9:.1f} GFLOP/s"
    )
    header = ["shape", "M", "form", "ms per ensemble step", "CPU ms"]
    header += ["member-steps/s", "x separate steps", "max param difference"]
    lines = [
        (r.shape, r.members, r.form, f"{1e3 * r.wall:.2f}", f"{1e3 * r.cpu:.2f}",
         f"{r.members / r.wall:.1f}",
         f"{separate_row(rows, r.members).wall / r.wall:.2f}", f"{r.gap:.1e}")
        for r in rows
    ]  # fmt: skip
    print(timing.table(header, lines))


def separate_row(rows: list[Row], count: int) -> Row:
    return next(r for r in rows if r.members == count and r.form == SEPARATE)


def print_verdicts(shape: Shape, rows: list[Row]) -> None:
    """Per M > 1: the fastest form against the library's default here, and
    issue 22's target where it applies."""
    backend = jax.default_backend()
    for count in sorted({r.members for r in rows if r.members > 1}):
        separate = separate_row(rows, count)
        timed = [r for r in rows if r.members == count and r.form != SEPARATE]
        best = min(timed, key=lambda r: r.wall)
        default = program_lib.default_vmap_members(shape.config, count)
        default_form = form_name(default, count)
        devices = split_devices(count)
        if devices > 1:
            default_form += f" on {devices} devices"
        default_row = next((r for r in timed if r.form == default_form), None)
        line = (
            f"  {shape.name} M={count}: fastest {best.form}, "
            f"{separate.wall / best.wall:.2f}x separate steps; the default on "
            f"{backend}: vmap_size={default} ({default_form})"
        )
        if default_row is None:
            line += ", not timed"
        elif default_row is best:
            line += ": the measurement agrees"
        else:
            line += (
                f", {separate.wall / default_row.wall:.2f}x: the measurement disagrees"
            )
        print(line)
        if shape.name == TARGET_SHAPE and count == TARGET_MEMBERS:
            met = separate.wall / best.wall >= TARGET_STEPS_RATIO
            print(
                f"  target: >= {TARGET_STEPS_RATIO}x separate steps at "
                f"M={count}: {'met' if met else 'not met'}"
            )


def member_steps_table(
    shape: Shape, counts, vmap_sizes, settings: Settings
) -> list[Row]:
    """Times separate steps and the forms ``vmap_sizes(M)`` at each M of
    ``counts`` (:func:`time_members`) and prints the table; its rows."""
    matmul = timing.Matmul(settings.matmul_size)
    single_step = compile_single_run_step(shape)
    rows, matmul_seconds = [], []
    for count in counts:
        group, seconds = time_members(
            shape, count, vmap_sizes(count), settings, matmul, single_step
        )
        rows += group
        matmul_seconds.append(seconds)
    print_table(shape, rows, matmul.flops / np.median(matmul_seconds))
    return rows


def member_steps(settings: Settings) -> None:
    """The member-steps tables of ``settings.shapes`` x ``settings.members``."""
    for name in settings.shapes:
        shape = load_shape(name, {"data.train_fraction": settings.train_fraction})
        vmap_sizes = lambda count: forms(count, settings.vmap_sizes)
        rows = member_steps_table(shape, settings.members, vmap_sizes, settings)
        print_verdicts(shape, rows)


# --- The GPU preset --------------------------------------------------------------


def is_out_of_memory(error: Exception) -> bool:
    """Whether ``error`` is XLA's out-of-memory error."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def largest_members(shape: Shape, start: int, cap: int) -> tuple[int | None, str]:
    """The largest M (``start``, doubling, at most ``cap``) whose one-vmap
    step runs (None: not even ``start``), and what stopped the doubling;
    prints each M's member-steps/s (one timed call after one untimed)."""
    fits, count = None, start
    while count <= cap:
        try:
            members = make_members(shape, count, 1)
            program = ensemble_program(shape, members, count, copy=False)
            jax.block_until_ready(program())
            seconds = timing.call_seconds(program)
        except Exception as error:  # XLA raises its out-of-memory as a runtime error
            if not is_out_of_memory(error):
                raise
            return fits, f"M={count} ran out of memory: {str(error).splitlines()[0]}"
        finally:
            members = program = None
        print(f"  M={count}: {count / seconds:,.0f} member-steps/s", flush=True)
        fits, count = count, 2 * count
    return fits, f"the cap, --max_members={cap}"


def gpu_preset(settings: Settings) -> None:
    """One vmap at ``settings.gpu_members`` against separate steps, then
    the largest M that fits (:func:`largest_members`)."""
    shape = load_shape(
        settings.gpu_shape,
        {"data.train_fraction": settings.train_fraction, "train.microbatches": 1},
    )
    member_steps_table(shape, settings.gpu_members, lambda count: [count], settings)
    print(f"\nThe largest M that fits, one vmap ({shape.name}, microbatches 1):")
    measured = max(settings.gpu_members)
    fits, reason = largest_members(shape, 2 * measured, settings.max_members)
    print(f"  largest M that fits: {fits or measured} (stopped by {reason})")


# --- The command ------------------------------------------------------------------


def settings_from_flags() -> Settings:
    """:data:`QUICK` with ``--quick``, else the flags' values (named as the fields)."""
    if FLAGS.quick:
        return QUICK
    values = {f.name: FLAGS[f.name].value for f in dataclasses.fields(Settings)}
    return Settings(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    )


def main(argv):
    del argv
    if FLAGS.gpu and FLAGS.runs_per_hour:
        raise app.UsageError("--gpu and --runs_per_hour are two modes: pick one.")
    if FLAGS.gpu:
        # Before the first array: the client reads it when it starts.
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    # Before the first array, as experiments/train.py does for an ensemble.
    cpus = sharding.available_cpus()
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices or cpus)
    settings = settings_from_flags()
    rounds = f"; {settings.rounds} rounds of {settings.steps} steps, medians"
    print(f"{timing.machine()}{'' if FLAGS.runs_per_hour else rounds}", flush=True)
    if FLAGS.runs_per_hour:
        ensemble_runs.runs_per_hour(
            settings.slice, settings.slice_steps, settings.slice_members
        )
    elif FLAGS.gpu:
        gpu_preset(settings)
    else:
        member_steps(settings)


if __name__ == "__main__":
    app.run(main)
