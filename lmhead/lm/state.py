"""A training run's state: the AdamW optimizer and its schedule, the initial
parameters, and restoring the newest checkpoint that restores.

Weight decay applies to the dense layers' kernels only: not to norms,
biases, the position table or the ``[V, D]`` tables (:data:`TABLES`), so tied
and untied runs differ by the tying alone. The tables may train at a multiple
of the schedule's rate (``optim.table_lr_multiplier``), with the same
optimizer state; an untied run with ``model.untie_step`` keeps its head and
the head's moments equal to the table's until that step
(:func:`copy_table_to_head`). docs/training.md gives the rules.
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
OPTIMIZER_VALUES = (
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "table_lr_multiplier",
)
# The params paths of the [V, D] tables (the [V, r] factors of a factorized
# head): the input embedding (also the tied head's unembedding) and the
# untied head's own unembedding.
EMBEDDING = ("embed", "embedding")
UNEMBEDDING = ("head", "unembedding")
TABLES = (EMBEDDING, UNEMBEDDING)


def optimizer_values(
    config: ml_collections.ConfigDict, values: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The optimizer's per-run values -- ``lr``, ``min_lr``, ``warmup_steps``,
    ``weight_decay``, ``table_lr_multiplier`` -- from ``config.optim``, with
    ``values`` in their place: an ensemble passes traced arrays, one element
    per member, for those its members set. A config written before
    ``table_lr_multiplier`` existed (a run's ``config.json``) has 1.

    Examples:
        >>> config = ml_collections.ConfigDict({"optim": {"lr": 1.0, "min_lr": 0.1,
        ...     "warmup_steps": 4, "weight_decay": 0.0}})
        >>> optimizer_values(config, {"lr": 2.0})  # doctest: +NORMALIZE_WHITESPACE
        {'lr': 2.0, 'min_lr': 0.1, 'warmup_steps': 4, 'weight_decay': 0.0,
         'table_lr_multiplier': 1.0}
    """
    own = {key: config.optim[key] for key in OPTIMIZER_VALUES[:-1]}
    own["table_lr_multiplier"] = config.optim.get("table_lr_multiplier", 1.0)
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


def table_mask(params: Any) -> Any:
    """True for the ``[V, D]`` tables (:data:`TABLES`), False elsewhere.

    Examples:
        >>> table_mask({"embed": {"embedding": 0}, "position_embedding": 0,
        ...             "head": {"unembedding": 0, "bias": 0}})
        {'embed': {'embedding': True}, 'head': {'bias': False, 'unembedding': True}, 'position_embedding': False}
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: tuple(getattr(p, "key", None) for p in path) in TABLES, params
    )


def scale_by_learning_rate(
    schedule: optax.Schedule, table_multiplier: jax.typing.ArrayLike = 1.0
) -> optax.GradientTransformation:
    r"""AdamW's last step, ``optax.scale_by_learning_rate(schedule)``, with the
    tables' updates times ``table_multiplier``.

    At step :math:`s`, a parameter's update :math:`u` becomes
    :math:`-\eta_s m\, u`, with :math:`m` = ``table_multiplier`` for the
    tables (:func:`table_mask`) and 1 for the rest: the tables train at
    :math:`m \eta_s` (with their weight decay, none, as it is). The state is
    optax's, the step count, whatever :math:`m`, so a checkpoint restores
    under any multiplier; a Python 1 is optax's transform itself. A traced
    :math:`m` (an ensemble's members) is applied as any other.

    Examples:
        >>> params = {"embed": {"embedding": jnp.ones(2)}, "mlp": {"kernel": jnp.ones(2)}}
        >>> scale = scale_by_learning_rate(lambda step: 0.5, table_multiplier=3.0)
        >>> updates, _ = scale.update(params, scale.init(params))
        >>> jax.tree.map(lambda u: u.tolist(), updates)
        {'embed': {'embedding': [-1.5, -1.5]}, 'mlp': {'kernel': [-0.5, -0.5]}}
    """
    base = optax.scale_by_learning_rate(schedule)
    if isinstance(table_multiplier, (int, float)) and table_multiplier == 1:
        return base

    def update(updates, state, params=None):
        updates, state = base.update(updates, state, params)
        scaled = jax.tree.map(
            lambda u, is_table: u * table_multiplier if is_table else u,
            updates,
            table_mask(updates),
        )
        return scaled, state

    return optax.GradientTransformation(base.init, update)


def make_optimizer(
    config: ml_collections.ConfigDict, values: Mapping[str, Any] | None = None
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the masked weight decay, the
    tables at ``table_lr_multiplier`` times the rate; ``values`` replaces
    ``config.optim``'s (:func:`optimizer_values`).

    AdamW is ``optax.adamw``'s own chain, written out so that its last step
    can scale the tables (:func:`scale_by_learning_rate`): with a multiplier
    of 1 it is ``optax.adamw``, transform for transform and state for state.
    """
    values = optimizer_values(config, values)
    adamw = optax.chain(
        optax.scale_by_adam(b1=config.optim.b1, b2=config.optim.b2),
        optax.add_decayed_weights(values["weight_decay"], weight_decay_mask),
        scale_by_learning_rate(
            learning_rate_schedule(config, values), values["table_lr_multiplier"]
        ),
    )
    if not config.optim.grad_clip:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.optim.grad_clip), adamw)


def table_as_head(tree: Any, where: jax.typing.ArrayLike = True) -> Any:
    """``tree`` -- the params, or a tree shaped like them (AdamW's moments) --
    with the untied head's ``[V, D]`` entry replaced by the embedding table's
    where ``where`` (a boolean scalar, traced or not).

    Inside the loss this is the tied model in the untied one's parameters:
    the gradient of the table gets the head's part, the head's own entry
    none.

    Examples:
        >>> tree = {"embed": {"embedding": jnp.ones(2)},
        ...         "head": {"unembedding": jnp.zeros(2)}}
        >>> table_as_head(tree, jnp.array(True))["head"]["unembedding"].tolist()
        [1.0, 1.0]
    """
    (embed, embedding), (head, unembedding) = EMBEDDING, UNEMBEDDING
    own = tree[head][unembedding]
    return {
        **tree,
        head: {
            **tree[head],
            unembedding: jnp.where(where, tree[embed][embedding], own),
        },
    }


def copy_table_to_head(
    state: TrainState, where: jax.typing.ArrayLike = True
) -> TrainState:
    """``state`` with the untied head's unembedding, and its entry in every
    params-shaped part of the optimizer state (AdamW's ``mu`` and ``nu``), set
    to the embedding table's where ``where`` (:func:`table_as_head`).

    ``model.untie_step = U``: every state of a step ``<= U`` has them so
    (``train.train_step`` copies after each update, :func:`create_train_state`
    at step 0), so the step ``U`` starts the head from the table and its
    moments, and any state before it is the tied model's.

    Examples:
        >>> params = {"embed": {"embedding": jnp.ones(2)},
        ...           "head": {"unembedding": jnp.zeros(2)}}
        >>> state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.5))
        >>> grads = {"embed": {"embedding": jnp.ones(2)},
        ...          "head": {"unembedding": jnp.zeros(2)}}
        >>> state = copy_table_to_head(state.apply_gradients(grads=grads))
        >>> state.params["head"]["unembedding"].tolist()
        [0.5, 0.5]
        >>> [round(x, 6) for x in state.opt_state[0].mu["head"]["unembedding"].tolist()]
        [0.1, 0.1]
    """
    structure = jax.tree.structure(state.params)

    def is_params_tree(x):
        return jax.tree.structure(x) == structure

    opt_state = jax.tree.map(
        lambda x: table_as_head(x, where) if is_params_tree(x) else x,
        state.opt_state,
        is_leaf=is_params_tree,
    )
    return state.replace(params=table_as_head(state.params, where), opt_state=opt_state)


def create_train_state(
    model: model_lib.DecoderLM, config: ml_collections.ConfigDict, key: jax.Array
) -> TrainState:
    """Initial parameters and optimizer state; ``step`` is an int32 array.

    With ``model.untie_step`` the head starts as the table
    (:func:`copy_table_to_head`)."""
    tokens = jnp.zeros((1, config.data.block_size), jnp.int32)
    params = model.init(key, tokens)["params"]
    state = TrainState.create(
        apply_fn=model.apply, params=params, tx=make_optimizer(config)
    )
    state = state.replace(step=jnp.zeros((), jnp.int32))
    if config.model.get("untie_step") is not None:
        state = copy_table_to_head(state)
    return state


def restore_or_init(
    manager: ocp.CheckpointManager,
    model: model_lib.DecoderLM,
    config: ml_collections.ConfigDict,
    key: jax.Array,
    mesh: jax.sharding.Mesh | None = None,
) -> TrainState:
    """A run's state: that of the newest checkpoint (a program of one,
    ``checkpoints.save``'s layout; its ``best`` is left out), or a fresh one
    initialised from ``key``, sharded over ``mesh`` (default: the first
    device) whatever mesh saved it. What loaders read a run with (its
    parameters for generation, scoring, serving); training restores a whole
    program (``train.train_program``).

    A checkpoint that does not restore (truncated, garbled or missing files)
    is moved to ``workdir/corrupt_checkpoints/STEP`` with a warning that
    names the step, and the next older one is tried. Orbax keeps no checksum
    of the array data: bytes changed inside a compressed chunk may restore
    without an error, as different numbers.

    Raises:
        ValueError: a checkpoint holds other arrays or shapes than this
            config's model and optimizer (it belongs to another config), or
            has the single-run layout written before the one layout (the
            message names the command that converts it).
        RuntimeError: there are checkpoints and none restores; the message
            names the directory and each step's error.
    """
    if mesh is None:
        mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    init = functools.partial(create_train_state, model, config)
    abstract = jax.eval_shape(init, key)
    shardings = sharding.tree_shardings(abstract, mesh)
    stacked = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((1, *x.shape), x.dtype), abstract
    )
    target = sharding.abstract_state(stacked, sharding.stacked_shardings(stacked, mesh))
    restored = checkpoints.restore_newest(manager, {"state": target})
    if restored is None:
        return jax.jit(init, out_shardings=shardings)(key)
    member = jax.jit(lambda s: jax.tree.map(lambda x: x[0], s), out_shardings=shardings)
    return member(restored["state"])
