"""A program: runs that train as one, each a member with a workdir of its
own, and :class:`Program`, the one run class that the loop of every run
(:mod:`lmhead.lm.loop`) reads. A single run is a program of one, whose
member's workdir is the program's; an ensemble is a program of several
(:mod:`lmhead.lm.members` says what may differ between them).

:func:`make_program` makes one: the members' data with one tokenizer, their
evaluation sets, the mesh, the traced values and keys;
:func:`lmhead.lm.train.train_program` restores its state, compiles its steps
and trains it. The tokenizer is trained once, in the program's workdir, and
every member's workdir gets the ``tokenizer.json`` and ``tokens.npz`` a
single run would write. The validation windows are shared; the training and
held-out windows are stacked, one set per member, when the members train on
different text. Every member's workdir ends with what a single run's holds,
its checkpoint included (one layout: ``lmhead.lm.checkpoints``); an
ensemble's own workdir holds its config, ``ensemble.json`` (its members),
the tokenizer and the checkpoints of the whole program.
"""

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lmhead.lm import (
    checkpoints,
    configuration,
    data,
    evaluation,
    generation,
    monitoring,
    sharding,
    versions,
)
from lmhead.lm import members as members_lib
from lmhead.lm import model as model_lib


@dataclasses.dataclass
class Program:
    """A program as the loop of every run (:func:`lmhead.lm.loop.train_loop`)
    reads it, made once by :func:`make_program`: its members' configs and
    workdirs, a state with a leading members axis ``M``, and, where a member
    has ``train.patience``, the best states in memory and in the program's
    checkpoints (``best``; None without).

    Attributes: ``config`` (the program's, before the members' overrides),
    ``configs`` (each member's), ``manager`` (the checkpoint manager of the
    program's workdir), ``writers`` and ``stoppings`` (each member's
    ``monitoring.MetricWriter`` and ``evaluation.EarlyStopping``, opened by
    :meth:`start`), ``dataset`` (its tokenizer is every member's),
    ``train_fn`` and ``eval_fns`` (``train.compile_steps``'s), ``failed``
    and ``finished`` (member indices: a non-finite value stopped it; it had
    a summary before this process began).
    """

    config: ml_collections.ConfigDict
    workdir: str
    members: list[members_lib.Member]
    configs: list[ml_collections.ConfigDict]
    model: model_lib.DecoderLM
    dataset: data.Dataset
    train_tokens: list[np.ndarray]
    mesh: jax.sharding.Mesh
    manager: Any
    keys: dict[str, jax.Array]
    values: dict[str, jax.Array]
    eval_sets: list[evaluation.MemberEvalSet]
    vmap_size: int
    writers: list[monitoring.MetricWriter] = dataclasses.field(default_factory=list)
    stoppings: list[evaluation.EarlyStopping] = dataclasses.field(default_factory=list)
    train_fn: Any = None
    eval_fns: dict = dataclasses.field(default_factory=dict)
    compile_seconds: float = 0.0
    failed: set = dataclasses.field(default_factory=set)
    finished: set = dataclasses.field(default_factory=set)
    _active: tuple = (None, None)

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def workdirs(self) -> list[str]:
        return [m.workdir for m in self.members]

    @property
    def single(self) -> bool:
        """A single run: one member, in the program's own workdir."""
        return self.count == 1 and _same_path(self.workdirs[0], self.workdir)

    @property
    def keeps_best(self) -> bool:
        """Whether the best states are kept: a member has ``train.patience``."""
        return any(c.train.patience for c in self.configs)

    def start(self, step: int) -> None:
        """Opens each member's metric writer at ``step`` (the restored one;
        later records are dropped) and its early-stopping count."""
        self.writers = [monitoring.MetricWriter(w, step) for w in self.workdirs]
        self.stoppings = [
            evaluation.EarlyStopping.from_records(c.train.patience, w.records)
            for c, w in zip(self.configs, self.writers)
        ]

    def member_name(self, index: int) -> str:
        """How the progress lines name member ``index``."""
        return (
            "the run" if self.count == 1 else f"member {index} ({self.workdirs[index]})"
        )

    def train_step(self, state, step: int, active: np.ndarray):
        """``(state, metrics)`` after training step ``step`` of the ``active``
        members (``[M]`` bool); the metrics' leaves are ``[M]``."""
        if self._active[0] is None or not np.array_equal(self._active[0], active):
            self._active = (active.copy(), sharding.replicate(active, self.mesh))
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
        return sharding.shard_members(stacked, self.mesh)

    def evaluate(self, params) -> list[dict[str, float]]:
        """Each member's metrics over the periodic evaluation sets."""
        results = [{} for _ in self.members]
        for eval_set in self.eval_sets:
            for index, metrics in enumerate(self.evaluate_set(params, eval_set)):
                results[index].update(metrics)
        return results

    def evaluate_set(self, params, eval_set: evaluation.MemberEvalSet) -> list[dict]:
        return evaluation.evaluate(self.eval_fns[eval_set.stacked], params, eval_set)

    def evaluate_test(self, params, test_set: evaluation.EvalSet) -> list[dict]:
        """Each member's metrics over ``test_set``."""
        shared = evaluation.shared_eval_set(test_set, self.mesh, self.count)
        return self.evaluate_set(params, shared)

    def save(self, step: int, state, best) -> None:
        """Checkpoints the states (and the best ones, where kept) as ``step``."""
        checkpoints.save(self.manager, step, state, best)

    def keep_best(self, improved: np.ndarray, state, best):
        """Keeps ``state`` as the best of the members where ``improved``;
        returns ``best``."""
        if best is None:
            return None
        return select(sharding.replicate(improved, self.mesh), state, best)

    def best_params(self, state, best) -> tuple[Any, list[int]]:
        """The parameters that the test split evaluates (a member's best with
        ``train.patience``, else its last) and the step of each member's."""
        steps = [int(s) for s in jax.device_get(state.step)]
        if best is None:
            return state.params, steps
        with_patience = np.array([c.train.patience > 0 for c in self.configs])
        params = select(
            sharding.replicate(with_patience, self.mesh), best.params, state.params
        )
        best_steps = jax.device_get(best.step)
        return params, [
            int(b if p else s) for b, s, p in zip(best_steps, steps, with_patience)
        ]

    def fail(self, index: int, done: int, pending: list[dict], state) -> None:
        """Member ``index``'s ``pending`` metrics (the last at step ``done``)
        or state are not finite. A single run stops with the
        ``FloatingPointError`` of ``checkpoints.check_finite``, which names
        the step and the checkpoint a rerun resumes from. A member of an
        ensemble is frozen, without a summary, and the others go on; its
        ``failed.json`` names the step, so that a rerun of the program does
        not train it again."""
        if self.single:
            checkpoints.check_finite(pending, done, state, self.manager)
        self.failed.add(index)
        with open(
            os.path.join(self.workdirs[index], members_lib.FAILED_FILE), "w"
        ) as f:
            json.dump(dict(step=done), f)
        monitoring.log(
            f"{self.member_name(index)}: a non-finite loss, gradient norm or "
            f"state by step {done}; it is stopped without a summary."
        )

    def end_members(self, state, best) -> list[Any]:
        """What each trained member keeps beside its summary: its checkpoint
        in its workdir (a single run's is the program's own), with
        ``train.patience`` its best state in ``best_checkpoint/``, and its
        samples (``sample.num_samples``, written by process 0). Returns each
        one's parameters (a members axis of one), None for a failed or
        finished member."""
        params = []
        for index, member_config in enumerate(self.configs):
            if index in self.failed or index in self.finished:
                params.append(None)
                continue
            own = _member(state, index, self.count)
            own_best = None if best is None else _member(best, index, self.count)
            workdir = self.workdirs[index]
            kept = own_best if member_config.train.patience else None
            if not _same_path(workdir, self.workdir):
                manager = checkpoints.checkpoint_manager(workdir)
                checkpoints.save(manager, int(own.step[0]), own, kept)
                manager.close()
            if kept is not None:
                manager = checkpoints.best_checkpoint_manager(workdir)
                checkpoints.save(manager, int(kept.step[0]), kept)
                manager.close()
            if member_config.sample.num_samples:
                host = jax.tree.map(lambda x: x[0], sharding.to_host(own.params))
                if sharding.is_main_process():
                    generation.write_samples(
                        member_config,
                        self.model,
                        host,
                        self.dataset.tokenizer,
                        self.keys["sample"][index],
                        workdir,
                    )
            params.append(own.params)
        return params

    def summary_extra(self, index: int) -> dict:
        """Keys of member ``index``'s summary beyond a single run's."""
        if self.single:
            return {}
        return {
            "ensemble": dict(
                program=str(self.manager.directory.parent),
                members=self.count,
                index=index,
            )
        }

    def close(self) -> None:
        """Closes the metric writers and the checkpoint manager."""
        for writer in self.writers:
            writer.close()
        self.manager.close()


def _member(tree: Any, index: int, count: int) -> Any:
    """Member ``index`` of a program's ``tree``, with a members axis of one."""
    if count == 1:
        return tree
    return jax.tree.map(lambda x: x[index : index + 1], tree)


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


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


def default_vmap_members(config: ml_collections.ConfigDict, count: int) -> int:
    """``train.vmap_members``, or when unset 1 on a CPU and ``count`` elsewhere."""
    if config.train.vmap_members is not None:
        return config.train.vmap_members
    return 1 if jax.default_backend() == "cpu" else count


def make_program(
    config: ml_collections.ConfigDict,
    members: list[members_lib.Member],
    configs: list[ml_collections.ConfigDict],
    workdir: str,
) -> Program:
    """The program of ``members`` (their ``configs``) in ``workdir``: the mesh
    (its errors come before any file is written), the data and the model, the
    checkpoint manager, the traced values and keys, the evaluation sets;
    each unfinished member's workdir gets its ``config.json`` and
    ``versions.json`` (:func:`start_workdir`), an ensemble's own workdir its
    ``config.json`` and ``ensemble.json``. Its state is restored, its metric
    writers opened and its steps compiled later (``train``)."""
    mesh = sharding.program_mesh(config.mesh, len(members))  # before any file
    datasets, train_tokens = _load_datasets(configs, members, workdir)
    dataset = datasets[0]
    model = configuration.make_model(config, dataset.vocab_size)
    varying = {
        key: [_get(c, key) for c in configs]
        for key in members_lib.TRACED_KEYS
        if len({_get(c, key) for c in configs}) > 1
    }
    values = {
        key: sharding.replicate(np.asarray(v, np.float32), mesh)
        for key, v in varying.items()
    }
    split_keys = [jax.random.split(jax.random.key(c.train.seed), 3) for c in configs]
    keys = {
        name: sharding.replicate(jnp.stack([k[i] for k in split_keys]), mesh)
        for i, name in enumerate(("init", "dropout", "sample"))
    }
    program = Program(
        config=config,
        workdir=workdir,
        members=members,
        configs=configs,
        model=model,
        dataset=dataset,
        train_tokens=train_tokens,
        mesh=mesh,
        manager=checkpoints.checkpoint_manager(workdir),
        keys=keys,
        values=values,
        eval_sets=evaluation.program_eval_sets(config, datasets, mesh),
        vmap_size=default_vmap_members(config, len(members)),
    )
    for member_config, member in zip(configs, members):
        if not os.path.exists(os.path.join(member.workdir, members_lib.SUMMARY_FILE)):
            start_workdir(member_config, member.workdir)
    if not program.single and sharding.is_main_process():
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))
        with open(os.path.join(workdir, members_lib.ENSEMBLE_FILE), "w") as f:
            json.dump(dict(members=members_lib.members_record(members)), f, indent=2)
    return program


def start_workdir(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Process 0 writes ``config.json`` and ``versions.json``."""
    if not sharding.is_main_process():
        return
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    versions.write_versions(workdir)


def _get(config, key: str):
    section, name = key.split(".")
    return config[section][name]


def check_mesh(config: ml_collections.ConfigDict, count: int) -> None:
    """Refuses what an ensemble (``count > 1`` members) does not support: a
    vocabulary split, ``mesh.members > 1`` with a data split, several
    processes. A single run has them all."""
    if count == 1:
        return
    if config.mesh.model != 1:
        raise ValueError(
            "config.mesh.model must be 1 in an ensemble; the vocabulary "
            f"split is for single runs. Got {config.mesh.model}."
        )
    if (config.mesh.members or 1) > 1 and config.mesh.data not in (1, -1):
        raise ValueError(
            "config.mesh.members > 1 splits the members over the devices; "
            f"config.mesh.data must then be 1 (or -1); got {config.mesh.data}."
        )
    if jax.process_count() > 1:
        raise ValueError("An ensemble runs in one process; got several.")


def _load_datasets(configs, members, workdir):
    """Each member's dataset, with one tokenizer: trained once in the
    program's workdir, on the text that covers every member's
    (``members`` module docstring), and each distinct data config encoded
    once; every member's workdir gets ``tokenizer.json`` and ``tokens.npz``.
    The prompt must encode: unknown characters fail now, not after training."""
    os.makedirs(workdir, exist_ok=True)
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
        elif not _same_path(member.workdir, encoded[settings][1]):
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
