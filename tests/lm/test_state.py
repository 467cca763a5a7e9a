"""Tests for lmhead/lm/state.py: the optimizer (weight decay, schedule,
clipping), the initial state, and restoring the newest checkpoint."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from lmhead.lm import checkpoints, configuration
from lmhead.lm import state as state_lib
from tests.lm.conftest import tiny_config


class TestOptimizer:
    def test_decay_only_dense_kernels(self, untied_state):
        config, state = untied_state
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        # Adam's step is 0 for zero gradients, so only the decay moves weights.
        after = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, zeros).params
        lr = config.optim.lr / (config.optim.warmup_steps + 1)
        shrink = 1 - lr * config.optim.weight_decay
        flat_before = jax.tree_util.tree_flatten_with_path(state.params)[0]
        decayed = []
        for (path, before), new in zip(flat_before, jax.tree.leaves(after)):
            name = "/".join(p.key for p in path)
            if path[-1].key == "kernel":
                np.testing.assert_allclose(new, before * shrink, rtol=1e-6)
                decayed.append(name)
            else:
                np.testing.assert_array_equal(new, before, err_msg=name)
        assert sorted(decayed) == sorted(
            f"blocks_0/{m}/kernel"
            for m in ("attention/qkv", "attention/out", "mlp_in", "mlp_out")
        )
        assert "unembedding" in state.params["head"]

    def test_schedule_is_nanogpts(self):
        config = default.get_config("nanogpt")
        schedule = state_lib.learning_rate_schedule(config)

        def nanogpt_lr(it, lr=1e-3, min_lr=1e-4, warmup=100, decay_iters=2000):
            if it < warmup:
                return lr * (it + 1) / (warmup + 1)
            ratio = (it - warmup) / (decay_iters - warmup)
            return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

        for step in (0, 1, 50, 99, 100, 101, 777, 1500, 1999, 2000):
            assert float(schedule(step)) == pytest.approx(nanogpt_lr(step), rel=1e-5)

    def test_grad_clip(self):
        params = {"dense": {"kernel": jnp.ones((3, 4))}, "bias": jnp.ones(5)}
        grads = jax.tree.map(lambda p: jnp.full_like(p, 100.0), params)

        def first_moment(grad_clip):
            optimizer = state_lib.make_optimizer(
                tiny_config(**{"optim.grad_clip": grad_clip})
            )
            adam_state = jax.tree.leaves(
                optimizer.update(grads, optimizer.init(params), params)[1],
                is_leaf=lambda x: hasattr(x, "mu"),
            )
            return next(s.mu for s in adam_state if hasattr(s, "mu"))

        # Adam normalises the update's scale; its first moment is (1 - b1) g.
        norm = lambda tree: float(optax.tree.norm(tree))
        assert norm(first_moment(1.0)) == pytest.approx(0.1 * 1.0, rel=1e-5)
        assert norm(first_moment(0.5)) == pytest.approx(0.1 * 0.5, rel=1e-5)
        assert norm(first_moment(0.0)) == pytest.approx(
            0.1 * 100 * math.sqrt(17), rel=1e-5
        )


class TestState:
    def test_initial_state(self, untied_state):
        config, state = untied_state
        assert state.step.dtype == jnp.int32 and int(state.step) == 0
        assert state.params["embed"]["embedding"].shape == (84, config.model.d_model)

    def test_restore_or_init(self, untied_state, tmp_path):
        """A fresh state from the key when the manager has no checkpoint, else
        the newest checkpoint's, whatever the key."""
        config, state = untied_state
        model = configuration.make_model(config, vocab_size=84)
        manager = checkpoints.checkpoint_manager(str(tmp_path))
        fresh = state_lib.restore_or_init(manager, model, config, jax.random.key(0))
        jax.tree.map(np.testing.assert_array_equal, fresh.params, state.params)
        moved = state.replace(
            step=jnp.int32(7), params=jax.tree.map(lambda x: x + 1, state.params)
        )
        checkpoints.save(manager, 7, moved)
        restored = state_lib.restore_or_init(manager, model, config, jax.random.key(1))
        manager.close()
        assert int(restored.step) == 7
        jax.tree.map(np.testing.assert_array_equal, restored.params, moved.params)
