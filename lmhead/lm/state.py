"""A training run's state: the AdamW optimizer and its schedule, the initial
parameters, and restoring the newest checkpoint that restores.

Weight decay applies to the kernels of dense layers (attention and MLP
projections) and to nothing else: not to LayerNorm scales, biases, the
position table, or the ``[V, D]`` tables of the input embedding and of the
untied unembedding. A tied table is shared by the input and the head and gets
no decay; for an even comparison the untied head's own ``[V, D]`` -- one
vector per token, like the embedding -- gets none either, so tied and untied
runs differ by the tying alone.
"""

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
import orbax.checkpoint as ocp
from flax.training import train_state

from lmhead.lm import checkpoints, sharding
from lmhead.lm import model as model_lib

TrainState = train_state.TrainState

# The keys of config.optim that may differ between an ensemble's members.
OPTIMIZER_VALUES = ("lr", "min_lr", "warmup_steps", "weight_decay")


def optimizer_values(
    config: ml_collections.ConfigDict, values: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The optimizer's per-run values -- ``lr``, ``min_lr``, ``warmup_steps``,
    ``weight_decay`` -- from ``config.optim``, with ``values`` in their place:
    an ensemble passes traced arrays, one element per member, for those its
    members set.

    Examples:
        >>> config = ml_collections.ConfigDict({"optim": {"lr": 1.0, "min_lr": 0.1,
        ...     "warmup_steps": 4, "weight_decay": 0.0}})
        >>> optimizer_values(config, {"lr": 2.0})
        {'lr': 2.0, 'min_lr': 0.1, 'warmup_steps': 4, 'weight_decay': 0.0}
    """
    own = {key: config.optim[key] for key in OPTIMIZER_VALUES}
    return {**own, **(values or {})}


def learning_rate_schedule(
    config: ml_collections.ConfigDict, values: Mapping[str, Any] | None = None
) -> optax.Schedule:
    r"""nanoGPT's schedule: linear warmup, then cosine to ``min_lr`` at ``steps``.

    With peak :math:`\eta`, floor :math:`\eta_{min}`, :math:`W` warmup steps
    and :math:`S` steps, step :math:`s` (0-based) uses

    .. math::
        \eta_s = \eta \frac{s + 1}{W + 1} \quad (s < W), \qquad
        \eta_s = \eta_{min} + \tfrac12 (1 + \cos(\pi r)) (\eta - \eta_{min}),
        \quad r = \frac{s - W}{S - W} \quad (s \ge W).

    ``values`` replaces ``config.optim``'s (:func:`optimizer_values`).

    Examples:
        >>> config = ml_collections.ConfigDict({"train": {"steps": 10},
        ...     "optim": {"lr": 1.0, "min_lr": 0.0, "warmup_steps": 4, "weight_decay": 0.0}})
        >>> [round(float(learning_rate_schedule(config)(s)), 2) for s in (0, 3, 4, 7, 10)]
        [0.2, 0.8, 1.0, 0.5, 0.0]
    """
    values = optimizer_values(config, values)
    peak, floor = values["lr"], values["min_lr"]
    warmup, steps = values["warmup_steps"], config.train.steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        ratio = jnp.clip((step - warmup) / jnp.maximum(steps - warmup, 1), 0.0, 1.0)
        cosine = floor + 0.5 * (1.0 + jnp.cos(jnp.pi * ratio)) * (peak - floor)
        return jnp.where(step < warmup, peak * (step + 1) / (warmup + 1), cosine)

    return schedule


def weight_decay_mask(params: Any) -> Any:
    """True for the parameters that decay: those named ``kernel`` (dense layers).

    Examples:
        >>> weight_decay_mask({"embed": {"embedding": 0}, "mlp": {"kernel": 0,
        ...                    "bias": 0}, "head": {"unembedding": 0}})
        {'embed': {'embedding': False}, 'head': {'unembedding': False}, 'mlp': {'bias': False, 'kernel': True}}
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) == "kernel", params
    )


def make_optimizer(
    config: ml_collections.ConfigDict, values: Mapping[str, Any] | None = None
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the masked weight decay;
    ``values`` replaces ``config.optim``'s (:func:`optimizer_values`)."""
    adamw = optax.adamw(
        learning_rate_schedule(config, values),
        b1=config.optim.b1,
        b2=config.optim.b2,
        weight_decay=optimizer_values(config, values)["weight_decay"],
        mask=weight_decay_mask,
    )
    if not config.optim.grad_clip:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.optim.grad_clip), adamw)


def create_train_state(
    model: model_lib.DecoderLM, config: ml_collections.ConfigDict, key: jax.Array
) -> TrainState:
    """Initial parameters and optimizer state; ``step`` is an int32 array."""
    tokens = jnp.zeros((1, config.data.block_size), jnp.int32)
    params = model.init(key, tokens)["params"]
    state = TrainState.create(
        apply_fn=model.apply, params=params, tx=make_optimizer(config)
    )
    return state.replace(step=jnp.zeros((), jnp.int32))


def restore_or_init(
    manager: ocp.CheckpointManager,
    model: model_lib.DecoderLM,
    config: ml_collections.ConfigDict,
    key: jax.Array,
    mesh: jax.sharding.Mesh | None = None,
) -> TrainState:
    """The newest checkpoint's state, or a fresh one initialised from ``key``,
    sharded over ``mesh`` (default: the first device) whatever mesh saved it.

    A checkpoint that does not restore (truncated, garbled or missing files)
    is moved to ``workdir/corrupt_checkpoints/STEP`` with a warning that
    names the step, and the next older one is tried, so a run never starts
    over from step 0 while it has a checkpoint. Orbax keeps no checksum of
    the array data: bytes changed inside a compressed chunk may restore
    without an error, as different numbers.

    Raises:
        ValueError: a checkpoint holds other arrays or shapes than this
            config's model and optimizer (it belongs to another config).
        RuntimeError: there are checkpoints and none restores; the message
            names the directory and each step's error.
    """
    if mesh is None:
        mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    init = functools.partial(create_train_state, model, config)
    abstract = jax.eval_shape(init, key)
    shardings = sharding.tree_shardings(abstract, mesh)
    target = sharding.abstract_state(abstract, shardings)
    state = checkpoints.restore_newest(manager, target)
    if state is None:
        state = jax.jit(init, out_shardings=shardings)(key)
    return state
