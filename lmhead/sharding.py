r"""Device meshes and shardings: data- and vocabulary-parallel training.

One mesh with two axes, built from ``config.mesh``:

- ``"data"``: the batch is split over it; XLA sums the gradients over it.
- ``"model"``: the vocabulary axis of the ``[V, D]`` tables -- the input
  embedding (which is the unembedding when tied), the untied unembedding and
  the head's bias -- is split over it, as in Megatron-LM.

Everything else is replicated, by a small table of rules (:data:`PARAM_RULES`,
regular expressions on a leaf's path). The rules match the *end* of a path,
and optax keeps each moment (Adam's ``mu`` and ``nu``) as a copy of the
parameter tree, so applying the same rules to the whole train state shards
the optimizer state like its parameters.

With the tables split over ``"model"``, :func:`vocab_parallel_cross_entropy`
computes the loss the way Megatron's vocabulary-parallel cross-entropy does:
each device reduces the logits of its own slice of the vocabulary to
per-token statistics (logsumexp, the label's logit, the sum of the logits,
the argmax), and the statistics are combined over ``"model"`` with
``pmax``/``psum``. Neither the ``[N, V]`` logits nor the whole table are ever
on one device.

Several hosts: :func:`initialize_distributed` starts ``jax.distributed``;
every process then sees the same global mesh, builds the same global batch
(a pure function of the seed and the step) and hands its own rows to
:func:`shard_batch`; orbax saves and restores the sharded arrays, and
:func:`is_main_process` says who writes logs.
"""

import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lmhead import _checks
from lmhead import head
from lmhead import losses

DATA_AXIS = "data"
MODEL_AXIS = "model"

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

# Logits per device in one chunk of the vocabulary-parallel loss when
# chunk_size is not given: chunk_size = CHUNK_LOGITS // (V / m), clipped to
# [MIN_CHUNK_SIZE, MAX_CHUNK_SIZE]. 2**22 float32 numbers are 16 MiB.
CHUNK_LOGITS = 2**22
MIN_CHUNK_SIZE = 128
MAX_CHUNK_SIZE = 4096


def make_mesh(data: int = -1, model: int = 1, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
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
        if isinstance(size, bool) or not isinstance(size, int) or (
                size < 1 and size != -1):
            raise ValueError(f"mesh.{name} must be a positive integer or -1; "
                             f"got {size!r}.")
    if data == -1 and model == -1:
        raise ValueError("mesh.data and mesh.model cannot both be -1.")
    if -1 in (data, model):
        name, known = ("model", model) if data == -1 else ("data", data)
        if count % known:
            raise ValueError(f"mesh.{name} = {known} does not divide the "
                             f"{count} devices.")
        data, model = (count // known, model) if data == -1 else (
            data, count // known)
    if data * model != count:
        raise ValueError(
            f"mesh.data * mesh.model must equal the number of devices, {count};"
            f" got {data} x {model} = {data * model}.")
    return jax.make_mesh((data, model), (DATA_AXIS, MODEL_AXIS),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices)


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
            raise ValueError(f"The rule for {name!r} gives {spec}, but the leaf"
                             f" has shape {np.shape(leaf)}.")
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
                    "data.vocab_size that is a multiple of it).")
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
            "of config.mesh.data.")
    indices = batch_sharding(mesh).addressable_devices_indices_map(
        (batch_size,)).values()
    return np.unique(np.concatenate(
        [np.arange(batch_size)[index[0]] for index in indices]))


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
        return jax.make_array_from_process_local_data(sharding, x[rows],
                                                      x.shape)

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
            return jax.random.wrap_key_data(put(jax.random.key_data(x)),
                                            impl=jax.random.key_impl(x))
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
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        tree, shardings)


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """``jax.distributed.initialize`` for a run over several processes.

    With no arguments, JAX detects the cluster (Cloud TPU, SLURM, Open MPI);
    elsewhere give all three, the same address on every process. Call it
    before anything else touches JAX.
    """
    given = [x is not None for x in (coordinator_address, num_processes,
                                     process_id)]
    if any(given) and not all(given):
        raise ValueError(
            "coordinator_address, num_processes and process_id go together: "
            "give all three, or none to detect the cluster.")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def _check_inputs(h, w, bias, chunk_size, **static):
    _checks.check_unembed_inputs(h, w, bias)
    _checks.check_block_size("chunk_size", chunk_size)
    _checks.check_concrete("vocab_parallel_cross_entropy", **static)
    for name in ("scale", "softcap"):
        _checks.check_in_range(name, static[name], low=0.0, low_open=True)


def _context_mesh(mesh: Mesh | None):
    """``mesh``, or the one set by ``jax.set_mesh``; it must have ``"model"``."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or MODEL_AXIS not in mesh.axis_names:
        raise ValueError(
            "vocab_parallel_cross_entropy needs a mesh with a 'model' axis: "
            "pass mesh=, or trace it under `with jax.set_mesh(mesh):`.")
    return mesh


def _chunk_statistics(h, w, bias, labels, *, scale, softcap, precision):
    """``(lse, label_logit, logit_sum, argmax, peak)``, each ``[c]``, of the
    logits ``[c, V/m]`` of one chunk of tokens against one vocabulary shard."""
    z = head.unembed(h, w, bias, scale=scale, softcap=softcap,
                     precision=precision)
    columns = jnp.arange(z.shape[-1])
    label_logit = jnp.sum(jnp.where(columns == labels[:, None], z, 0.0), -1)
    return (jax.nn.logsumexp(z, axis=-1), label_logit, jnp.sum(z, -1),
            jnp.argmax(z, -1).astype(jnp.int32),
            lax.stop_gradient(jnp.max(z, -1)))


def _shard_statistics(h, w, bias, labels, *, chunk_size, scale, softcap,
                      precision):
    """Per-token statistics against this device's rows of ``w: [V/m, D]``.

    ``labels`` are global ids; one outside this shard matches no row and adds
    0 to ``label_logit``. Tokens go ``chunk_size`` at a time, each chunk
    rematerialized in the backward pass, so the temporaries are
    ``[chunk_size, V/m]`` however many tokens there are.
    """
    num_tokens, width = h.shape[0], w.shape[0]
    offset = lax.axis_index(MODEL_AXIS) * width
    if chunk_size is None:
        chunk_size = min(max(CHUNK_LOGITS // width, MIN_CHUNK_SIZE),
                         MAX_CHUNK_SIZE)
    chunk_size = min(chunk_size, num_tokens)
    padding = -num_tokens % chunk_size
    # Padded tokens get label -1, which matches no row; they are cut off below.
    h = jnp.pad(h, ((0, padding), (0, 0)))
    labels = jnp.pad(labels - offset, (0, padding), constant_values=-1)
    chunk = jax.checkpoint(functools.partial(
        _chunk_statistics, scale=scale, softcap=softcap, precision=precision))
    stats = lax.map(lambda xs: chunk(xs[0], w, bias, xs[1]),
                    (h.reshape(-1, chunk_size, h.shape[1]),
                     labels.reshape(-1, chunk_size)))
    lse, label_logit, logit_sum, argmax, peak = (
        s.reshape(-1)[:num_tokens] for s in stats)
    return lse, label_logit, logit_sum, argmax + offset, peak


def _combine_over_vocab(lse, label_logit, logit_sum, argmax, peak, vocab_size):
    """The statistics of the whole vocabulary from those of each shard."""
    # Any shift is exact for a logsumexp; the largest keeps exp() <= 1.
    shift = lax.pmax(lax.stop_gradient(lse), MODEL_AXIS)
    lse = shift + jnp.log(lax.psum(jnp.exp(lse - shift), MODEL_AXIS))
    best = lax.pmax(peak, MODEL_AXIS)
    # Ties go to the lowest index, as jnp.argmax does.
    argmax = lax.pmin(jnp.where(peak == best, argmax, vocab_size), MODEL_AXIS)
    return (lse, lax.psum(label_logit, MODEL_AXIS),
            lax.psum(logit_sum, MODEL_AXIS), argmax)


def vocab_parallel_cross_entropy(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    *,
    bias: jax.typing.ArrayLike | None = None,
    weights: jax.typing.ArrayLike | None = None,
    label_smoothing: float = 0.0,
    smoothing: str = "uniform",
    z_loss: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    precision: jax.lax.PrecisionLike = None,
    reduction: str = "mean",
    mesh: Mesh | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Cross-entropy of ``unembed(h, w, bias)`` with ``w`` split over the
    vocabulary on the mesh's ``"model"`` axis.

    Device :math:`s` holds rows :math:`V_s` of ``w`` and reduces its logits
    to :math:`m_s = \mathrm{lse}_{i \in V_s} z_i`, :math:`\sum_{i \in V_s}
    z_i`, :math:`z_y [y \in V_s]` and its local argmax; then

    .. math::
        \mathrm{lse}(z) = M + \log \sum_s e^{m_s - M}, \quad
        M = \max_s m_s, \qquad
        z_y = \sum_s z_y [y \in V_s], \qquad
        \sum_i z_i = \sum_s \sum_{i \in V_s} z_i,

    with ``pmax``/``psum`` over ``"model"`` and the argmax of the shard with
    the largest top logit. The loss and the metrics are then those of
    ``losses.cross_entropy`` (:func:`lmhead.losses.token_losses`,
    :func:`lmhead.losses.weighted_metrics`), so label smoothing of both
    conventions, z-loss and softcap work unchanged. Tokens are split over
    ``"data"`` when it divides their number (replicated otherwise), and go
    through the shard ``chunk_size`` at a time, so a device's largest
    temporary is ``[chunk_size, V/m]``; the backward pass recomputes each
    chunk's logits.

    Args:
        h: ``[..., D]`` hidden states.
        w: ``[V, D]`` unembedding; ``V`` divisible by the ``"model"`` size.
        labels: ``[...]`` integer targets.
        bias: optional ``[V]``.
        weights, label_smoothing, smoothing, z_loss, reduction: as in
            ``losses.cross_entropy``.
        scale, softcap, precision: as in ``head.unembed``; concrete numbers.
        chunk_size: tokens per block on each device; default
            ``CHUNK_LOGITS // (V/m)`` clipped to ``[MIN_CHUNK_SIZE,
            MAX_CHUNK_SIZE]``.
        mesh: a mesh with a ``"model"`` axis; default the one set by
            ``jax.set_mesh``.

    Returns:
        ``(loss, metrics)`` as ``losses.cross_entropy`` returns them.

    Raises:
        ValueError, TypeError: bad shapes, dtypes or options, no mesh, or a
            vocabulary not divisible by the ``"model"`` axis.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from lmhead import head, losses
        >>> h = jax.random.normal(jax.random.key(0), (2, 3, 4))
        >>> w = jax.random.normal(jax.random.key(1), (10, 4))
        >>> labels = jnp.array([[1, 2, 3], [4, 5, 6]])
        >>> loss, _ = vocab_parallel_cross_entropy(h, w, labels, z_loss=1e-3,
        ...                                        mesh=make_mesh())
        >>> reference, _ = losses.cross_entropy(head.unembed(h, w), labels,
        ...                                     z_loss=1e-3)
        >>> print(f"{loss:.5f} {reference:.5f}")
        4.55898 4.55898

    References:
        Shoeybi et al., `Megatron-LM: Training Multi-Billion Parameter Language
        Models Using Model Parallelism <https://arxiv.org/abs/1909.08053>`_,
        2019 (section 3, the parallel embedding and cross-entropy).
    """
    mesh = _context_mesh(mesh)
    _check_inputs(h, w, bias, chunk_size, scale=scale, softcap=softcap,
                  label_smoothing=label_smoothing, z_loss=z_loss)
    losses.check_loss_options(label_smoothing, smoothing, z_loss, reduction)
    vocab_size, d_model = jnp.shape(w)
    leading = jnp.shape(h)[:-1]
    losses.check_labels_and_weights(labels, weights, leading, vocab_size)
    if vocab_size % mesh.shape[MODEL_AXIS]:
        raise ValueError(
            f"w has {vocab_size} rows, which the mesh's 'model' axis "
            f"({mesh.shape[MODEL_AXIS]}) must divide.")
    num_tokens = math.prod(leading)
    if num_tokens == 0:  # nothing to split: the logits are empty
        return losses.cross_entropy(
            head.unembed(h, w, bias, scale=scale, softcap=softcap), labels,
            weights=weights, label_smoothing=label_smoothing,
            smoothing=smoothing, z_loss=z_loss, reduction=reduction)
    loss_weights, safe_labels, invalid = losses.valid_weights(
        jnp.reshape(labels, -1),
        None if weights is None else jnp.reshape(weights, -1), vocab_size)
    data_ways = mesh.shape.get(DATA_AXIS, 1)
    tokens = (DATA_AXIS if DATA_AXIS in mesh.axis_names
              and num_tokens % data_ways == 0 else None)
    static = dict(chunk_size=chunk_size,
                  scale=None if scale is None else float(scale),
                  softcap=None if softcap is None else float(softcap),
                  precision=precision)
    dtype = jnp.result_type(h, w)

    def per_device(h, w, labels, *bias):
        stats = _shard_statistics(h, w, bias[0] if bias else None, labels,
                                  **static)
        return _combine_over_vocab(*stats, vocab_size)

    args = (jnp.reshape(h, (num_tokens, d_model)).astype(dtype),
            jnp.asarray(w, dtype), safe_labels) + (
                () if bias is None else (jnp.asarray(bias),))
    stats = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(P(tokens), P(MODEL_AXIS), P(tokens), P(MODEL_AXIS))[
            :len(args)],
        out_specs=P(tokens))(*args)
    lse, label_logit, logit_sum, argmax = stats
    token_loss, nll, z_term = losses.token_losses(
        lse, label_logit, logit_sum, vocab_size,
        label_smoothing=label_smoothing, smoothing=smoothing, z_loss=z_loss)
    loss, metrics = losses.weighted_metrics(
        token_loss, nll, z_term, argmax == safe_labels, loss_weights, invalid,
        reduction)
    if reduction == "none":
        loss = jnp.reshape(loss, leading)
    return loss, metrics
