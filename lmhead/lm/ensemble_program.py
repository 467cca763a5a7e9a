"""What an ensemble program is made of (:mod:`lmhead.lm.ensemble` runs it):
the members' data with one tokenizer, their evaluation sets, the mesh, the
stacked state's shardings, and :class:`Program`, the record the loop reads.

The tokenizer is trained once, in the program's workdir, and every member's
workdir gets the ``tokenizer.json`` and ``tokens.npz`` a single run would
write. The validation windows are shared; the training and held-out windows
are stacked, one set per member, when the members train on different text.
"""

import contextlib
import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lmhead.lm import (
    checkpoints,
    configuration,
    data,
    evaluation,
    generation,
    loop,
    monitoring,
    sharding,
    train,
)
from lmhead.lm import members as members_lib
from lmhead.lm import model as model_lib
from lmhead.vocab_parallel import DATA_AXIS

# The mesh axis that the members are split over (mesh.members > 1, or None
# on several CPU devices: member_devices).
MEMBERS_AXIS = "members"
# In a member's workdir: the step at which a non-finite loss, gradient norm
# or state stopped it (``train.stop_on_nonfinite``).
FAILED_FILE = "failed.json"


@dataclasses.dataclass(frozen=True)
class MemberEvalSet:
    """An evaluation set of every member: ``batches`` shared (``[B, T]``) or
    stacked (``[M, B, T]``), and each member's :class:`evaluation.EvalSet`
    for its token and character counts."""

    batches: list
    stacked: bool
    sets: list[evaluation.EvalSet]


@dataclasses.dataclass
class Program(loop.Run):
    """An ensemble program as the loop of every run
    (:func:`lmhead.lm.loop.train_loop`) reads it, made once by
    :func:`make_program`: a stacked state (a leading members axis), and in
    memory and in the program's checkpoints the stacked best states."""

    config: ml_collections.ConfigDict
    members: list[members_lib.Member]
    configs: list[ml_collections.ConfigDict]
    model: model_lib.DecoderLM
    dataset: data.Dataset
    train_tokens: list[np.ndarray]
    mesh: jax.sharding.Mesh
    manager: Any
    writers: list[monitoring.MetricWriter]
    stoppings: list[evaluation.EarlyStopping]
    keys: dict[str, jax.Array]
    values: dict[str, jax.Array]
    eval_sets: list[MemberEvalSet]
    vmap_size: int
    train_fn: Any = None
    eval_fns: dict = dataclasses.field(default_factory=dict)
    compile_seconds: float = 0.0
    failed: set = dataclasses.field(default_factory=set)
    # Members with a summary before this process started (a resumed program).
    finished: set = dataclasses.field(default_factory=set)
    stacked = True
    _active: tuple = (None, None)

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def workdirs(self) -> list[str]:
        return [m.workdir for m in self.members]

    def train_step(self, state, step: int, active: np.ndarray):
        if self._active[0] is None or not np.array_equal(self._active[0], active):
            self._active = (active.copy(), jnp.asarray(active))
        return self.train_fn(
            state,
            self.batch(step, active),
            self.keys["dropout"],
            self.values,
            self._active[1],
        )

    def batch(self, step: int, active: np.ndarray) -> dict[str, jax.Array]:
        """The stacked training batches of ``step``: each member's
        ``data.train_batch`` with its seed (zeros for a stopped member)."""
        shape = (self.config.train.batch_size, self.config.data.block_size)
        stopped = {key: np.zeros(shape, np.int32) for key in ("inputs", "labels")}
        batches = [
            data.train_batch(
                tokens,
                seed=member_config.train.seed,
                step=step,
                batch_size=shape[0],
                block_size=shape[1],
            )
            if is_active
            else stopped
            for member_config, tokens, is_active in zip(
                self.configs, self.train_tokens, active
            )
        ]
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches)
        return jax.device_put(stacked, self.stacked_sharding(rank=3))

    def stacked_sharding(self, rank: int) -> NamedSharding:
        """Of an array with a leading members axis (batches over ``data``)."""
        if MEMBERS_AXIS in self.mesh.axis_names:
            return NamedSharding(self.mesh, P(MEMBERS_AXIS))
        return NamedSharding(self.mesh, P(None, DATA_AXIS) if rank > 1 else P())

    def evaluate(self, params) -> list[dict[str, float]]:
        """Each member's metrics over the periodic evaluation sets."""
        results = [{} for _ in self.members]
        for eval_set in self.eval_sets:
            for index, metrics in enumerate(self.evaluate_set(params, eval_set)):
                results[index].update(metrics)
        return results

    def evaluate_set(self, params, eval_set: MemberEvalSet) -> list[dict]:
        eval_fn = self.eval_fns[eval_set.stacked]
        sums = jax.device_get([eval_fn(params, batch) for batch in eval_set.batches])
        return [
            evaluation.metrics_from_sums(
                [jax.tree.map(lambda x, k=index: x[k], s) for s in sums],
                eval_set.sets[index],
            )
            for index in range(self.count)
        ]

    def evaluate_test(self, params, test_set: evaluation.EvalSet) -> list[dict]:
        return self.evaluate_set(
            params, shared_eval_set(test_set, self.mesh, self.count)
        )

    def save(self, step: int, state, best) -> None:
        checkpoints.save(self.manager, step, {"state": state, "best": best})

    def keep_best(self, improved: np.ndarray, state, best):
        return select(jnp.asarray(improved), state, best)

    def best_params(self, state, best):
        with_patience = np.array([c.train.patience > 0 for c in self.configs])
        params = select(jnp.asarray(with_patience), best.params, state.params)
        best_steps, steps = jax.device_get((best.step, state.step))
        return params, [
            int(b if p else s) for b, s, p in zip(best_steps, steps, with_patience)
        ]

    def fail(self, index: int, done: int, pending: list[dict], state) -> None:
        """The member is frozen, without a summary; its ``failed.json`` names
        the step, so that a rerun of the program does not train it again."""
        self.failed.add(index)
        with open(os.path.join(self.workdirs[index], FAILED_FILE), "w") as f:
            json.dump(dict(step=done), f)
        monitoring.log(
            f"{self.member_name(index)}: a non-finite loss, gradient norm or "
            f"state by step {done}; it is stopped without a summary."
        )

    def end_members(self, state, best) -> list:
        """Each trained member's checkpoints (:func:`save_member`) and samples."""
        # One transfer of the stacked states; each member's is a view of it.
        state, best = jax.device_get((state, best))
        params = []
        for index, member_config in enumerate(self.configs):
            if index in self.failed or index in self.finished:
                params.append(None)
                continue
            own, own_best = (jax.tree.map(lambda x: x[index], t) for t in (state, best))
            save_member(self.workdirs[index], member_config, own, own_best)
            if member_config.sample.num_samples:
                generation.write_samples(
                    member_config,
                    self.model,
                    sharding.to_host(own.params),
                    self.dataset.tokenizer,
                    self.keys["sample"][index],
                    self.workdirs[index],
                )
            params.append(own.params)
        return params

    def summary_extra(self, index: int) -> dict:
        return {
            "ensemble": dict(
                program=str(self.manager.directory.parent),
                members=self.count,
                index=index,
            )
        }

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.manager.close()


@jax.jit
def select(mask: jax.Array, new: Any, old: Any) -> Any:
    """``new`` for the members where ``mask`` (``[M]``), else ``old``.

    Examples:
        >>> select(jnp.array([True, False]), jnp.ones(2), jnp.zeros(2)).tolist()
        [1.0, 0.0]
    """
    return jax.tree.map(
        lambda n, o: jnp.where(mask.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
        new,
        old,
    )


def save_member(workdir: str, member_config, state, best) -> None:
    """The member's own checkpoint (and best checkpoint with patience), as a
    single run leaves them: ``experiments/generate.py`` and a resumed single
    run read them."""
    with contextlib.ExitStack() as stack:
        manager = stack.enter_context(
            contextlib.closing(checkpoints.checkpoint_manager(workdir))
        )
        checkpoints.save(manager, int(state.step), state)
        if member_config.train.patience:
            best_manager = stack.enter_context(
                contextlib.closing(checkpoints.best_checkpoint_manager(workdir))
            )
            checkpoints.save(best_manager, int(best.step), best)


def make_program(
    config: ml_collections.ConfigDict,
    members: list[members_lib.Member],
    configs: list[ml_collections.ConfigDict],
    workdir: str,
    manager: Any,
    vmap_size: int,
) -> Program:
    """The program of ``members`` (their ``configs``) in ``workdir``: the data
    and the model, the mesh, the traced values and keys, the evaluation sets,
    the metric writers and each member's early-stopping count; its steps are
    compiled later (``ensemble``)."""
    datasets, train_tokens = _load_datasets(configs, members, workdir)
    dataset = datasets[0]
    model = configuration.make_model(config, dataset.vocab_size)
    mesh = _make_mesh(config, len(members))
    varying = {
        key: [_get(c, key) for c in configs]
        for key in members_lib.TRACED_KEYS
        if len({_get(c, key) for c in configs}) > 1
    }
    replicated = NamedSharding(mesh, P())
    values = {
        key: jax.device_put(np.asarray(v, np.float32), replicated)
        for key, v in varying.items()
    }
    split_keys = [jax.random.split(jax.random.key(c.train.seed), 3) for c in configs]
    keys = {
        name: jax.device_put(jnp.stack([k[i] for k in split_keys]), replicated)
        for i, name in enumerate(("init", "dropout", "sample"))
    }
    for member_config, member in zip(configs, members):
        if not os.path.exists(os.path.join(member.workdir, train.SUMMARY_FILE)):
            train.start_workdir(member_config, member.workdir)
    start = manager.latest_step() or 0
    writers = [monitoring.MetricWriter(m.workdir, start) for m in members]
    return Program(
        config=config,
        members=members,
        configs=configs,
        model=model,
        dataset=dataset,
        train_tokens=train_tokens,
        mesh=mesh,
        manager=manager,
        writers=writers,
        stoppings=[
            evaluation.EarlyStopping.from_records(c.train.patience, w.records)
            for c, w in zip(configs, writers)
        ],
        keys=keys,
        values=values,
        eval_sets=_eval_sets(config, datasets, mesh),
        vmap_size=vmap_size,
    )


def _get(config, key: str):
    section, name = key.split(".")
    return config[section][name]


def member_devices(
    mesh: ml_collections.ConfigDict, count: int, devices: int, platform: str
) -> int:
    """How many devices a program of ``count`` members splits them over:
    ``mesh.members``, or when it is None, on a CPU the most of the
    ``devices`` that divide ``count`` (while ``mesh.data`` and ``mesh.model``
    leave the devices free: 1 or -1), else 1.

    Examples:
        >>> mesh = ml_collections.ConfigDict(dict(data=-1, model=1, members=None))
        >>> [member_devices(mesh, m, 2, "cpu") for m in (8, 7, 1)]
        [2, 1, 1]
        >>> member_devices(mesh, 6, 4, "cpu"), member_devices(mesh, 8, 8, "gpu")
        (3, 1)
    """
    if mesh.members is not None:
        return mesh.members
    if platform != "cpu" or mesh.data not in (1, -1) or mesh.model != 1:
        return 1
    return sharding.dividing_devices(count, devices)


def _make_mesh(config, count: int) -> jax.sharding.Mesh:
    devices = jax.devices()
    split = member_devices(config.mesh, count, len(devices), jax.default_backend())
    if split == 1 and config.mesh.members is None:
        # Members that no count of the devices divides train on one device,
        # as on a machine of one: the CPU devices given to split members are
        # not asked to split each member's batch instead.
        return sharding.make_mesh(devices=devices[:1])
    if split == 1:
        return sharding.make_mesh(config.mesh.data, config.mesh.model)
    if config.mesh.members is not None and (split != len(devices) or count % split):
        raise ValueError(
            f"config.mesh.members={config.mesh.members} must equal the number "
            f"of devices, {len(devices)}, and divide the {count} members."
        )
    return members_mesh(devices[:split])


def members_mesh(devices) -> jax.sharding.Mesh:
    """A one-axis mesh (:data:`MEMBERS_AXIS`) over ``devices``, which a
    program's members are split over.

    Examples:
        >>> dict(members_mesh(jax.devices()[:1]).shape)
        {'members': 1}
    """
    return jax.make_mesh(
        (len(devices),),
        (MEMBERS_AXIS,),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=list(devices),
    )


def _load_datasets(configs, members, workdir):
    """Each member's dataset, with one tokenizer: trained once in the
    program's workdir, on the text that covers every member's
    (``members`` module docstring), and each distinct data config encoded
    once; every member's workdir gets ``tokenizer.json`` and ``tokens.npz``."""
    largest = max(range(len(configs)), key=lambda i: configs[i].data.train_fraction)
    shared = sharding.main_process_first(
        lambda: data.load_dataset(configs[largest].data, workdir)
    )
    encoded = {configs[largest].data.to_json(): (shared, workdir)}
    datasets = []
    for member_config, member in zip(configs, members):
        settings = member_config.data.to_json()
        if settings not in encoded:
            encoded[settings] = (
                data.load_dataset(member_config.data, member.workdir, shared.tokenizer),
                member.workdir,
            )
        else:
            os.makedirs(member.workdir, exist_ok=True)
            for name in (data.TOKENIZER_FILE, data.TOKENS_FILE):
                shutil.copyfile(
                    os.path.join(encoded[settings][1], name),
                    os.path.join(member.workdir, name),
                )
        datasets.append(encoded[settings][0])
    try:
        shared.tokenizer.encode(configs[0].sample.prompt)
    except ValueError as e:
        raise ValueError(
            f"config.sample.prompt={configs[0].sample.prompt!r}: {e}"
        ) from e
    return datasets, [d.train_tokens for d in datasets]


def _eval_sets(config, datasets, mesh) -> list[MemberEvalSet]:
    """The validation windows, made once and shared (the validation split
    is every member's); with ``train.eval_train_batches`` each member's
    training windows, and with ``data.holdout_fraction`` each member's
    held-out windows (:func:`evaluation.heldout_eval_set`), as a single run
    has them (:func:`member_eval_set`)."""
    tokenizer = datasets[0].tokenizer
    validation = evaluation.make_eval_set(
        "eval", datasets[0].val_tokens, config.train.eval_batches, config, tokenizer
    )
    result = [shared_eval_set(validation, mesh, len(datasets))]
    if config.train.eval_train_batches:
        result.append(
            member_eval_set(
                datasets,
                lambda d: evaluation.make_eval_set(
                    "train_eval",
                    d.train_tokens,
                    config.train.eval_train_batches,
                    config,
                    tokenizer,
                ),
                mesh,
            )
        )
    # holdout_fraction is the program's (a data key), so all members or none.
    if datasets[0].heldout_tokens is not None:
        result.append(
            member_eval_set(
                datasets,
                lambda d: evaluation.heldout_eval_set(
                    config, d.heldout_tokens, tokenizer
                ),
                mesh,
            )
        )
    return result


def member_eval_set(
    datasets: list[data.Dataset], make, mesh: jax.sharding.Mesh
) -> MemberEvalSet:
    """Each member's set ``make(dataset)`` (host batches), made once per
    distinct dataset: shared when the members have one text, else stacked
    (``[M, B, T]``). A set with fewer batches than the others (a shorter
    held-out text evaluated whole) is filled up with batches of weight 0,
    which add nothing to its sums.

    Examples:
        >>> tokenizer = data.CharTokenizer.train("abcdefghij")
        >>> datasets = [data.Dataset(np.arange(n) % 10, None, tokenizer, 1.0)
        ...             for n in (9, 17)]
        >>> config = ml_collections.ConfigDict(
        ...     {"train": {"batch_size": 1}, "data": {"block_size": 4}})
        >>> stacked = member_eval_set(
        ...     datasets,
        ...     lambda d: evaluation.make_eval_set("s", d.train_tokens, None, config,
        ...                                        tokenizer),
        ...     sharding.make_mesh(1, 1))
        >>> [s.num_tokens for s in stacked.sets], len(stacked.batches)
        ([8, 16], 4)
        >>> stacked.batches[3]["weights"].sum(axis=(1, 2)).tolist()
        [0.0, 4.0]
    """
    by_text = {}
    for dataset in datasets:
        if id(dataset) not in by_text:
            by_text[id(dataset)] = make(dataset)
    sets = [by_text[id(d)] for d in datasets]
    if len(by_text) == 1:
        return shared_eval_set(sets[0], mesh, len(datasets))
    count = max(len(s.batches) for s in sets)
    padded = [
        s.batches + [_weightless(s.batches[0])] * (count - len(s.batches)) for s in sets
    ]
    stacked = NamedSharding(
        mesh,
        P(MEMBERS_AXIS) if MEMBERS_AXIS in mesh.axis_names else P(None, DATA_AXIS),
    )
    batches = [
        jax.device_put(jax.tree.map(lambda *xs: np.stack(xs), *group), stacked)
        for group in zip(*padded)
    ]
    return MemberEvalSet(batches, True, sets)


def _weightless(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**batch, "weights": np.zeros_like(batch["weights"])}


def shared_eval_set(
    eval_set: evaluation.EvalSet, mesh: jax.sharding.Mesh, count: int
) -> MemberEvalSet:
    """``eval_set`` (host batches) as every one of ``count`` members' set:
    replicated on a members mesh, else split over ``data`` as a single run's."""
    if MEMBERS_AXIS in mesh.axis_names:
        replicated = NamedSharding(mesh, P())
        batches = [jax.device_put(b, replicated) for b in eval_set.batches]
    else:
        batches = [sharding.shard_batch(b, mesh) for b in eval_set.batches]
    return MemberEvalSet(batches, False, [eval_set] * count)


def state_shardings(program: Program, abstract: Any) -> Any:
    """The stacked state's shardings: members over ``members`` (a members
    mesh), else each member's ``sharding.tree_shardings`` behind a leading
    unsplit axis."""
    if MEMBERS_AXIS in program.mesh.axis_names:
        return jax.tree.map(
            lambda _: NamedSharding(program.mesh, P(MEMBERS_AXIS)), abstract
        )
    member = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), abstract
    )
    return jax.tree.map(
        lambda s: NamedSharding(program.mesh, P(None, *s.spec)),
        sharding.tree_shardings(member, program.mesh),
    )
