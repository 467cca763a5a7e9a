"""Rows split over devices, a loop per device: decoding's one row split.

When ``step_fn`` splits the rows over a one-axis mesh (``step_fn.mesh``, and
``step_fn.per_device()`` the step of one device's rows, as
``lmhead.lm.inference.make_step_fn(model, mesh)`` gives), each device runs the
whole decoding loop on its own block of rows, a ``shard_map`` with no
collective: :func:`~lmhead.decoding.generate` and its streams
(:func:`split_loops`), and :func:`~lmhead.decoding.beam_search` (its prompts,
each with its beams: :func:`split_rows`). A single sampling key's draw takes
each device's rows of the whole batch's noise (``StepConfig.row_axis``), so a
row's draws do not depend on the split. A ``processor`` hook, which sees every
row, a constraint, whose masker serves every row from the host, and
speculative decoding keep the loop over the whole batch. ``docs/decoding.md`` measures it.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lmhead.decoding.step import per_row_keys


def _row_specs(tree: Any, axis: str) -> Any:
    """A ``PartitionSpec`` per leaf of ``tree`` (knobs or a stop condition):
    ``P(axis)`` for a leaf with one entry per row (``tree.repeat_rows(2)``
    doubles its leading axis), ``P()`` for a shared one."""
    leaves, structure = jax.tree.flatten(tree)
    shapes = tuple((jnp.shape(leaf), jnp.result_type(leaf)) for leaf in leaves)
    return structure.unflatten(_row_spec_leaves(structure, shapes, axis))


@functools.lru_cache(maxsize=256)
def _row_spec_leaves(structure: Any, shapes: tuple, axis: str) -> tuple:
    # Cached: finding them traces repeat_rows, which costs more than a step.
    tree = structure.unflatten([jax.ShapeDtypeStruct(*shape) for shape in shapes])
    doubled = jax.tree.leaves(jax.eval_shape(lambda t: t.repeat_rows(2), tree))
    return tuple(
        P(axis) if shape and new.shape[0] == 2 * shape[0] else P()
        for (shape, _), new in zip(shapes, doubled)
    )


def rows_mesh(step_fn: Any, batch: int) -> Mesh | None:
    """The one-axis mesh over which ``step_fn`` splits ``batch`` rows, with
    one loop per device (``step_fn.mesh`` and ``step_fn.per_device``), or
    None: the step has none, or its devices do not divide the rows (the
    step then says so itself)."""
    mesh = getattr(step_fn, "mesh", None)
    if mesh is None or getattr(step_fn, "per_device", None) is None:
        return None
    return None if batch % mesh.size else mesh


def split_rows(local: Callable, mesh: Mesh, in_specs: tuple) -> Callable:
    """``local`` run by each device of ``mesh`` on its own block of rows: a
    ``shard_map`` with no collective, whose every output is split by rows
    and whose inputs are split as ``in_specs`` says (``P(axis)``: by rows;
    ``P()``: whole on every device)."""
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=P(mesh.axis_names[0]),
        check_vma=False,
    )


@functools.lru_cache(maxsize=64)
def _split_programs(
    step_fn, config, mesh, tree, leaves, per_row_key, donate, start_loop, advance,
    columns,
):  # fmt: skip
    """The compiled start and resume of :func:`split_loops`, and the specs
    of the knobs, stops and rows (one per set of static arguments and
    shardings, as ``jax.jit`` caches a function's)."""
    axis = mesh.axis_names[0]
    logits_spec, state_spec, key_spec, history_spec, *row_specs = tree.unflatten(leaves)
    row_specs = tuple(row_specs)  # the knobs', stops' and rows' specs

    # Outside, a device's own scalars (its step, and the single key it
    # splits) are stacked: one per device. A stream's chunk is cut inside.
    def stacked(s):
        key = s.rows.key if per_row_key else s.rows.key[None]
        return s._replace(step=s.step[None], rows=s.rows._replace(key=key))

    def unstacked(s):
        key = s.rows.key if per_row_key else s.rows.key[0]
        return s._replace(step=s.step[0], rows=s.rows._replace(key=key))

    split = functools.partial(split_rows, mesh=mesh)

    def start(
        params, logits, model_state, key, history, knobs, stop, rows, until, width
    ):
        def local(params, logits, model_state, key, history, knobs, stop, rows, until):
            s = start_loop(step_fn, params, logits, model_state, key, history,
                           knobs, stop, rows, config, until)  # fmt: skip
            return columns(stacked(s), until, width)

        specs = (P(), logits_spec, state_spec, key_spec, history_spec, *row_specs, P())
        return split(local, in_specs=specs)(
            params, logits, model_state, key, history, knobs, stop, rows, until
        )

    def resume(s, until, params, knobs, stop, rows, width):
        def local(s, until, params, knobs, stop, rows):
            s = advance(unstacked(s), until, step_fn, params, knobs, stop, rows, config)
            return columns(stacked(s), until, width)

        specs = (P(axis), P(), P(), *row_specs)
        return split(local, in_specs=specs)(s, until, params, knobs, stop, rows)

    return (
        jax.jit(start, static_argnames="width", donate_argnums=(2,) if donate else ()),
        jax.jit(resume, static_argnames="width", donate_argnums=(0,)),
        row_specs,
    )


def split_loops(
    arguments: Any, start: Callable, advance: Callable, columns: Callable
) -> tuple[Callable, Callable] | None:
    """``(start(until, width=None), resume(s, until, width=None))`` of the
    sampling loop (``arguments``: its ``_LoopArguments``; ``start``,
    ``advance`` and ``columns``: its functions of the whole batch) with each
    device running its own rows' loop, or None where the rows cannot split
    (see the module's docstring). The parameters and per-row inputs are
    placed on the mesh once, for all of a stream's chunks."""
    a = arguments
    mesh = rows_mesh(a.step_fn, a.logits.shape[0])
    whole_batch = (
        a.config.step.processor is not None
        or a.rows.constraint is not None
        or a.config.proposer is not None
    )
    if mesh is None or whole_batch:
        return None
    per_row_key = per_row_keys(a.key)
    axis = mesh.axis_names[0]
    specs = (
        P(axis),  # logits
        P(axis),  # model_state
        P(axis) if per_row_key else P(),
        P(axis),  # history
        _row_specs(a.knobs, axis),
        tuple(_row_specs(c, axis) for c in a.stop),
        P(axis),  # rows
    )
    leaves, tree = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
    config = a.config._replace(step=a.config.step._replace(row_axis=axis))
    start_split, resume_split, specs = _split_programs(
        a.step_fn.per_device(), config, mesh, tree, tuple(leaves), per_row_key,
        a.donate, start, advance, columns,
    )  # fmt: skip
    # Placed once, rather than sent to the devices by each chunk (no copy
    # where the caller has replicated them: sharding.replicate).
    params, knobs, stop, rows = jax.device_put(
        (a.params, a.knobs, a.stop, a.rows),
        jax.tree.map(
            lambda spec: NamedSharding(mesh, spec),
            (P(), *specs),
            is_leaf=lambda x: isinstance(x, P),
        ),
    )
    return (
        lambda until, width=None: start_split(
            params, *a[2:6], knobs, stop, rows, np.int32(until), width=width
        ),
        lambda s, until, width=None: resume_split(
            s, np.int32(until), params, knobs, stop, rows, width=width
        ),
    )
