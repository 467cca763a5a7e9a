"""Checks that a loss takes ``label_smoothing`` and ``z_loss`` traced.

An ensemble trains its members in one program with ``jax.vmap`` or
``lax.map`` over a leading members axis, so members that differ in these two
values hand the loss traced scalars, one per member. The reference is the
call a single run makes: Python floats, compiled into the program.
"""

import chex
import jax
import numpy as np
from jax import lax

# Three members; each value is 0 for one of them (its term switched off).
LABEL_SMOOTHING = np.array([0.0, 0.1, 0.2], np.float32)
Z_LOSS = np.array([1e-2, 0.0, 1e-3], np.float32)


def static_call(fn):
    """``fn(label_smoothing, z_loss)`` jitted with both as Python floats."""
    jitted = jax.jit(fn, static_argnums=(0, 1))
    return lambda label_smoothing, z_loss: jitted(float(label_smoothing), float(z_loss))


def assert_members_match_static_calls(fn, transforms=("vmap",), rtol=1e-5, atol=1e-6):
    """Member k of ``fn`` over all members equals ``fn`` on member k's floats.

    One program (one compile) holds the batched calls and, as references,
    one call per member with its values as Python floats.

    Args:
        fn: ``fn(label_smoothing, z_loss) -> pytree`` of arrays (e.g. a loss
            and its gradients).
        transforms: any of ``"vmap"`` (``jax.vmap`` over the members) and
            ``"map"`` (``lax.map``, where each member's values are traced
            scalars).
    """
    batched = {
        "vmap": lambda values: jax.vmap(fn)(*values),
        "map": lambda values: lax.map(lambda v: fn(*v), values),
    }
    members = [(float(e), float(z)) for e, z in zip(LABEL_SMOOTHING, Z_LOSS)]

    @jax.jit
    def program(*values):
        return [batched[t](values) for t in transforms], [fn(*v) for v in members]

    got, want = program(LABEL_SMOOTHING, Z_LOSS)
    for transform, outputs in zip(transforms, got):
        for k, expected in enumerate(want):
            chex.assert_trees_all_close(
                jax.tree.map(lambda x, k=k: x[k], outputs),
                expected,
                rtol=rtol,
                atol=atol,
                custom_message=f"{transform}, member {k}",
            )


def assert_traced_equals_static(fn, label_smoothing, z_loss, rtol=1e-6, atol=1e-7):
    """``jax.jit(fn)`` with the two values traced equals the static call."""
    chex.assert_trees_all_close(
        jax.jit(fn)(np.float32(label_smoothing), np.float32(z_loss)),
        static_call(fn)(label_smoothing, z_loss),
        rtol=rtol,
        atol=atol,
    )
