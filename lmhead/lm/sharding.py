"""Device meshes and shardings: data- and vocabulary-parallel training, and
a program's members over devices.

One mesh with two axes, built from ``config.mesh``: ``"data"`` splits the
batch (XLA sums the gradients over it), and ``"model"`` splits the
vocabulary axis of the ``[V, D]`` tables (the embedding, the untied
unembedding, the head's bias), as in Megatron-LM, for
:func:`lmhead.vocab_parallel.vocab_parallel_cross_entropy`. Everything else is
replicated by :data:`PARAM_RULES`, which match the end of a leaf's path, so
the optimizer's moments shard like their parameters. A program's state and
batches have a leading members axis (a single run's, of size 1): unsplit
behind each member's shardings, or split over a one-axis
:data:`MEMBERS_AXIS` mesh (:func:`program_mesh`, :func:`stacked_shardings`,
:func:`shard_members`). Several hosts: :func:`initialize_distributed`,
:func:`shard_batch` (each process hands its own rows) and
:func:`is_main_process`. docs/scale_out.md gives the design.
"""

import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lmhead import _checks
from lmhead.vocab_parallel import DATA_AXIS, MODEL_AXIS

# (regex searched in a leaf's "/"-joined path, spec); the first match wins and
# a leaf that matches nothing is replicated. ``$`` anchors each rule at the
# end of the path, so "params/embed/embedding" and Adam's
# "opt_state/.../mu/embed/embedding" get the same spec.
PARAM_RULES = (
    (r"(^|/)embed/embedding$", P(MODEL_AXIS, None)),
    (r"(^|/)head/unembedding$", P(MODEL_AXIS, None)),
    (r"(^|/)head/bias$", P(MODEL_AXIS)),
)

Rules = Sequence[tuple[str, P]]
# The mesh axis that a program's members are split over (mesh.members > 1, or
# None on several CPU devices: member_devices).
MEMBERS_AXIS = "members"


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the system
    has one (``taskset``, a sweep's ``--cpus_per_run``), else every CPU.

    Examples:
        >>> available_cpus() >= 1
        True
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def dividing_devices(count: int, devices: int) -> int:
    """The most of ``devices`` that divide ``count`` evenly: how many devices
    a split of ``count`` rows or members uses (1: no split).

    Examples:
        >>> dividing_devices(8, 2), dividing_devices(6, 4), dividing_devices(7, 2)
        (2, 3, 1)
    """
    _checks.check_count("count", count)
    _checks.check_count("devices", devices)
    return max(d for d in range(1, min(devices, count) + 1) if count % d == 0)


def make_mesh(
    data: int = -1, model: int = 1, *, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``("data", "model")`` mesh over all devices (of every process).

    Args:
        data: devices along the batch; ``-1`` means all that ``model`` leaves.
        model: devices along the vocabulary; ``-1`` means all that ``data``
            leaves.
        devices: default ``jax.devices()``.

    Returns:
        A ``Mesh`` of shape ``(data, model)`` whose axes are ``Auto`` (XLA
        partitions what the shardings do not say).

    Raises:
        ValueError: unless ``data * model`` equals the number of devices.

    Examples:
        >>> dict(make_mesh(-1, 1).shape)
        {'data': 1, 'model': 1}
    """
    devices = jax.devices() if devices is None else list(devices)
    count = len(devices)
    for name, size in (("data", data), ("model", model)):
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or (size < 1 and size != -1)
        ):
            raise ValueError(
                f"mesh.{name} must be a positive integer or -1; got {size!r}."
            )
    if data == -1 and model == -1:
        raise ValueError("mesh.data and mesh.model cannot both be -1.")
    if -1 in (data, model):
        name, known = ("model", model) if data == -1 else ("data", data)
        if count % known:
            raise ValueError(
                f"mesh.{name} = {known} does not divide the {count} devices."
            )
        data, model = (count // known, model) if data == -1 else (data, count // known)
    if data * model != count:
        raise ValueError(
            f"mesh.data * mesh.model must equal the number of devices, {count};"
            f" got {data} x {model} = {data * model}."
        )
    return jax.make_mesh(
        (data, model),
        (DATA_AXIS, MODEL_AXIS),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=devices,
    )


def members_mesh(devices: Sequence[jax.Device]) -> Mesh:
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


def member_devices(mesh: Any, count: int, devices: int, platform: str) -> int:
    """How many devices a program of ``count`` members splits them over:
    ``mesh.members`` (``config.mesh``), or when it is None, on a CPU the most
    of the ``devices`` that divide ``count`` (while ``mesh.data`` and
    ``mesh.model`` leave the devices free: 1 or -1), else 1.

    Examples:
        >>> import ml_collections
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
    return dividing_devices(count, devices)


def program_mesh(mesh: Any, count: int) -> Mesh:
    """The mesh of a program of ``count`` members (``mesh``: ``config.mesh``).

    A program of one, a single run, has :func:`make_mesh`'s ``mesh.data`` x
    ``mesh.model`` over every device (of every process). More members are
    split over :func:`member_devices` devices (a :func:`members_mesh`); where
    that is 1 with ``mesh.members`` None they train on one device, as on a
    machine of one, so that the CPU devices given to split members are not
    asked to split each member's batch instead; with ``mesh.members = 1``
    each member's batch is split over ``mesh.data``.

    Raises:
        ValueError: a ``mesh.members`` other than the device count, or one
            that does not divide the members.

    Examples:
        >>> import ml_collections
        >>> mesh = ml_collections.ConfigDict(dict(data=-1, model=1, members=None))
        >>> dict(program_mesh(mesh, 1).shape), dict(program_mesh(mesh, 3).shape)
        ({'data': 1, 'model': 1}, {'data': 1, 'model': 1})
    """
    if count == 1:
        return make_mesh(mesh.data, mesh.model)
    devices = jax.devices()
    split = member_devices(mesh, count, len(devices), jax.default_backend())
    if split == 1 and mesh.members is None:
        return make_mesh(devices=devices[:1])
    if split == 1:
        return make_mesh(mesh.data, mesh.model)
    if mesh.members is not None and (split != len(devices) or count % split):
        raise ValueError(
            f"config.mesh.members={mesh.members} must equal the number "
            f"of devices, {len(devices)}, and divide the {count} members."
        )
    return members_mesh(devices[:split])


def leaf_path(path: Sequence[Any]) -> str:
    """``"params/embed/embedding"`` for a ``jax.tree_util`` key path."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def partition_specs(tree: Any, rules: Rules = PARAM_RULES) -> Any:
    """The ``PartitionSpec`` of every leaf of ``tree`` by the first rule that
    matches its path; ``P()`` (replicated) when none does.

    Raises:
        ValueError: when a rule's spec has more axes than the leaf.

    Examples:
        >>> tree = {"embed": {"embedding": np.zeros((8, 4))},
        ...         "mlp": {"kernel": np.zeros((4, 4))}}
        >>> partition_specs(tree)
        {'embed': {'embedding': P('model', None)}, 'mlp': {'kernel': P()}}
    """
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]

    def spec_of(path, leaf):
        name = leaf_path(path)
        spec = next((s for r, s in compiled if r.search(name)), P())
        if len(spec) > np.ndim(leaf):
            raise ValueError(
                f"The rule for {name!r} gives {spec}, but the leaf"
                f" has shape {np.shape(leaf)}."
            )
        return spec

    return jax.tree_util.tree_map_with_path(spec_of, tree)


def tree_shardings(tree: Any, mesh: Mesh, rules: Rules = PARAM_RULES) -> Any:
    """``NamedSharding`` of every leaf of ``tree`` (params, a train state, or
    their ``jax.eval_shape``), by :func:`partition_specs`.

    Raises:
        ValueError: naming the leaf, when a sharded dimension is not divisible
            by its mesh axes (e.g. a vocabulary of 84 over ``model=8``).

    Examples:
        >>> mesh = make_mesh()
        >>> tree_shardings({"head": {"bias": np.zeros(6)}}, mesh)["head"]["bias"].spec
        P('model',)
    """

    def sharding_of(path, leaf, spec):
        for dim, axes in enumerate(spec):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
            ways = math.prod(mesh.shape[a] for a in axes)
            if np.shape(leaf)[dim] % ways:
                raise ValueError(
                    f"{leaf_path(path)} has shape {np.shape(leaf)}; dimension "
                    f"{dim} ({np.shape(leaf)[dim]}) must be divisible by mesh "
                    f"axes {axes} of size {ways}. For the vocabulary, choose "
                    "mesh.model dividing the vocabulary size (or a BPE "
                    "data.vocab_size that is a multiple of it)."
                )
        return NamedSharding(mesh, spec)

    specs = partition_specs(tree, rules)
    return jax.tree_util.tree_map_with_path(sharding_of, tree, specs)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``"data"``, the rest replicated."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    """The same value on every device of ``mesh``."""
    return NamedSharding(mesh, P())


def process_rows(batch_size: int, mesh: Mesh) -> np.ndarray:
    """The rows of a ``[batch_size, ...]`` global batch that this process's
    devices hold, in order (all of them on one host).

    Raises:
        ValueError: unless ``"data"`` divides ``batch_size``.

    Examples:
        >>> process_rows(4, make_mesh())
        array([0, 1, 2, 3])
    """
    ways = mesh.shape[DATA_AXIS]
    if batch_size % ways:
        raise ValueError(
            f"The batch size ({batch_size}) must be divisible by the mesh's "
            f"data axis ({ways}); set config.train.batch_size to a multiple "
            "of config.mesh.data."
        )
    indices = (
        batch_sharding(mesh).addressable_devices_indices_map((batch_size,)).values()
    )
    return np.unique(
        np.concatenate([np.arange(batch_size)[index[0]] for index in indices])
    )


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Global arrays split over ``"data"`` from the global batch on the host.

    Every process passes the same global batch (``[B, ...]`` numpy leaves);
    each keeps only :func:`process_rows` and sends them to its own devices.

    Examples:
        >>> x = shard_batch({"inputs": np.zeros((4, 3), np.int32)}, make_mesh())
        >>> x["inputs"].shape, x["inputs"].sharding.spec
        ((4, 3), P('data',))
    """
    sharding = batch_sharding(mesh)

    def put(x):
        x = np.asarray(x)
        rows = process_rows(x.shape[0], mesh)
        return jax.make_array_from_process_local_data(sharding, x[rows], x.shape)

    return jax.tree.map(put, batch)


def stacked_shardings(tree: Any, mesh: Mesh, rules: Rules = PARAM_RULES) -> Any:
    """``NamedSharding`` of every leaf of a program's ``tree`` (its state, or
    the state's ``jax.eval_shape``; leaves ``[M, ...]``): on a members mesh
    every leaf split over :data:`MEMBERS_AXIS`, else each member's
    :func:`tree_shardings` behind an unsplit leading axis.

    Examples:
        >>> tree = {"head": {"bias": np.zeros((1, 6))}}
        >>> stacked_shardings(tree, make_mesh())["head"]["bias"].spec
        P(None, 'model')
    """
    if MEMBERS_AXIS in mesh.axis_names:
        return jax.tree.map(lambda _: NamedSharding(mesh, P(MEMBERS_AXIS)), tree)
    member = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, P(None, *s.spec)),
        tree_shardings(member, mesh, rules),
    )


def shard_members(batch: Any, mesh: Mesh) -> Any:
    """Global arrays from a program's stacked batch on the host (``[M, B,
    ...]`` numpy leaves, the same on every process): the members split over
    :data:`MEMBERS_AXIS` on a members mesh, else each member's rows over
    ``"data"``, each process keeping its own (:func:`process_rows`), as
    :func:`shard_batch` splits a batch.

    Examples:
        >>> x = shard_members({"inputs": np.zeros((1, 4, 3), np.int32)}, make_mesh())
        >>> x["inputs"].shape, x["inputs"].sharding.spec
        ((1, 4, 3), P(None, 'data'))
    """
    if MEMBERS_AXIS in mesh.axis_names:
        return jax.device_put(batch, NamedSharding(mesh, P(MEMBERS_AXIS)))
    sharding = NamedSharding(mesh, P(None, DATA_AXIS))

    def put(x):
        x = np.asarray(x)
        rows = process_rows(x.shape[1], mesh)
        return jax.make_array_from_process_local_data(sharding, x[:, rows], x.shape)

    return jax.tree.map(put, batch)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Global replicated arrays (PRNG keys included) from values that every
    process holds.

    Examples:
        >>> replicate(jax.random.key(0), make_mesh()).sharding.spec
        P()
    """
    sharding = replicated(mesh)

    def put(x):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            return jax.random.wrap_key_data(
                put(jax.random.key_data(x)), impl=jax.random.key_impl(x)
            )
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, x.shape)

    return jax.tree.map(put, tree)


def is_main_process() -> bool:
    """True on process 0, the one that writes logs, summaries and samples."""
    return jax.process_index() == 0


def main_process_first(fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` on process 0, then on the others once it has returned.

    For work that fills a cache on a shared disk (the tokenizer and encoded
    corpus in the workdir): the others then read what process 0 wrote.
    """
    if jax.process_count() == 1:
        return fn()
    if is_main_process():
        result = fn()
    multihost_utils.sync_global_devices("lmhead: main process first")
    if not is_main_process():
        result = fn()
    return result


def to_host(tree: Any) -> Any:
    """Whole numpy copies of global (sharded, multi-process) arrays, on every
    process; every process must call it."""
    return multihost_utils.process_allgather(tree, tiled=True)


def abstract_state(tree: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves that carry ``shardings``: the target
    that orbax restores a checkpoint onto, whatever mesh wrote it."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """``jax.distributed.initialize`` for a run over several processes.

    With no arguments, JAX detects the cluster (Cloud TPU, SLURM, Open MPI);
    elsewhere give all three, the same address on every process. Call it
    before anything else touches JAX.
    """
    given = [x is not None for x in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
        raise ValueError(
            "coordinator_address, num_processes and process_id go together: "
            "give all three, or none to detect the cluster."
        )
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
