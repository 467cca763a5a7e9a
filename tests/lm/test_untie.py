"""Tests of untying during training (``model.untie_step``) and of the tables'
learning-rate multiplier (``optim.table_lr_multiplier``): lmhead/lm/train.py's
``train_step`` and lmhead/lm/state.py's optimizer.

One tiny untied model trained by hand with ``untie_step = U`` serves the
untying tests, against the tied model trained from the same seed on the same
batches, and against an AdamW step written in numpy; the multiplier is
checked against ``optax.multi_transform`` on a small tree of its own.
"""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import default
from lmhead.lm import checkpoints, configuration, data, sharding, train
from lmhead.lm import state as state_lib
from tests.lm import conftest

UNTIE_STEP = 4
STEPS = UNTIE_STEP + 2
# The same computation in two compiled programs (the tied model's and the
# untied one's with the table as its head): equal up to float32 rounding.
RTOL, ATOL = 1e-6, 1e-7


def tiny_config(**overrides):
    config = conftest.tiny_config(**overrides)
    configuration.validate_config(config)
    return config


UNTIE = {"model.tied": False, "model.untie_step": UNTIE_STEP}


def head(tree):
    return np.asarray(tree["head"]["unembedding"])


def table(tree):
    return np.asarray(tree["embed"]["embedding"])


def adam_moments(state):
    """AdamW's ``(mu, nu)`` trees in ``state.opt_state``."""
    found = [
        s
        for s in jax.tree.leaves(
            state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(found) == 1
    return found[0].mu, found[0].nu


def compiled_step(config, model, state, batch, key):
    """A run's train step (``train.compile_steps``' of a program of one), on
    a run's state, batch and key (given the members axis of one, as copies:
    the step donates its state); returns the run's state and metrics."""
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])

    def one(tree):
        return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)

    train_fn = train.compile_steps(
        model, [config], one(state), one(batch), one(key), {}, mesh
    )[0]
    active = jnp.ones(1, bool)

    def step(state, batch, key):
        new, metrics = train_fn(one(state), one(batch), one(key), {}, active)
        return jax.tree.map(lambda x: x[0], (new, metrics))

    return step


@pytest.fixture(scope="module")
def trained(corpus):
    """``STEPS`` steps of the tied model and of the untied one with
    ``untie_step = UNTIE_STEP``, same seed and batches: every state (index =
    step), every loss and the compiled step of each."""
    base = tiny_config(**{"data.path": corpus})
    dataset = data.load_dataset(base.data)
    batches = [
        data.train_batch(
            dataset.train_tokens, seed=0, step=s, batch_size=8, block_size=16
        )
        for s in range(STEPS)
    ]
    key = jax.random.key(1)
    runs = {}
    for name, overrides in (("tied", {}), ("untie", UNTIE)):
        config = tiny_config(**{"data.path": corpus, **overrides})
        model = configuration.make_model(config, dataset.vocab_size)
        states = [state_lib.create_train_state(model, config, jax.random.key(0))]
        step = compiled_step(config, model, states[0], batches[0], key)
        losses = []
        for batch in batches:
            state, metrics = step(states[-1], batch, key)
            states.append(state)
            losses.append(float(metrics["loss"]))
        runs[name] = dict(
            config=config, model=model, states=states, losses=losses, step=step
        )
    return dict(**runs, batches=batches, key=key)


class TestUntie:
    def test_tied_until_the_untie_step(self, trained):
        """Before U the untied model trains as the tied one: the same losses,
        the same table and body, the same moments for the table; and every
        state up to step U (the one step U starts from included) has the head
        equal to the table, and the head's moments equal to its (to
        rounding: the two are computed by different fusions)."""
        tied, untie = trained["tied"], trained["untie"]
        # Step U's loss too: it starts with the head equal to the table.
        np.testing.assert_allclose(
            untie["losses"][: UNTIE_STEP + 1],
            tied["losses"][: UNTIE_STEP + 1],
            rtol=RTOL,
        )
        assert untie["losses"][UNTIE_STEP + 1] != tied["losses"][UNTIE_STEP + 1]
        close = functools.partial(np.testing.assert_allclose, rtol=RTOL, atol=ATOL)
        for step in range(UNTIE_STEP + 1):
            state = untie["states"][step]
            params = dict(state.params)
            np.testing.assert_array_equal(head(params), table(params))
            del params["head"]
            # Two programs: the key biases, whose gradient is rounding alone,
            # left out (conftest.without_key_bias).
            jax.tree.map(
                close,
                conftest.without_key_bias(params),
                conftest.without_key_bias(tied["states"][step].params),
            )
            for got, want in zip(
                adam_moments(state), adam_moments(tied["states"][step])
            ):
                # One program, two fusions: equal to float32 rounding of
                # the moment's scale.
                scale = np.max(np.abs(table(got)))
                np.testing.assert_allclose(
                    head(got), table(got), rtol=1e-5, atol=1e-6 * scale
                )
                close(table(got), table(want))
            if step:
                assert np.any(table(adam_moments(state)[1]) > 0)

    def test_the_untie_step_is_the_untied_adamw_step(self, trained):
        """Step U, from the state where the head is the table: the untied
        model's gradient (the table's from the inputs alone, the head's from
        the logits), clipped and through AdamW as written in numpy. Head and
        table move apart, and both move."""
        untie = trained["untie"]
        config, model = untie["config"], untie["model"]
        before, after = untie["states"][UNTIE_STEP], untie["states"][UNTIE_STEP + 1]
        grads = jax.jit(
            jax.grad(
                lambda p: train.train_loss(
                    p,
                    trained["batches"][UNTIE_STEP],
                    jax.random.fold_in(trained["key"], UNTIE_STEP),
                    model=model,
                    loss_kwargs=train.loss_keywords(config.loss),
                )[0]
            )
        )(before.params)
        norm = math.sqrt(
            sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(grads))
        )
        clip = min(1.0, config.optim.grad_clip / norm)
        lr = float(state_lib.learning_rate_schedule(config)(UNTIE_STEP))
        b1, b2, count = config.optim.b1, config.optim.b2, UNTIE_STEP + 1
        mu, nu = adam_moments(before)
        for name in ("head", "table"):
            pick = head if name == "head" else table
            g = clip * pick(grads).astype(np.float64)
            m = b1 * pick(mu) + (1 - b1) * g
            v = b2 * pick(nu) + (1 - b2) * g * g
            step = (m / (1 - b1**count)) / (np.sqrt(v / (1 - b2**count)) + 1e-8)
            want = pick(before.params) - lr * step
            np.testing.assert_allclose(pick(after.params), want, rtol=1e-5, atol=1e-7)
            assert np.max(np.abs(pick(after.params) - pick(before.params))) > lr / 2
        assert np.max(np.abs(head(after.params) - table(after.params))) > lr / 2
        for moment in adam_moments(after):
            assert not np.array_equal(head(moment), table(moment))

    def test_resumes_across_the_untie_step_bitwise(self, trained, tmp_path):
        """A checkpoint before U, restored as a run restores it, then stepped
        across U: the uninterrupted states, bitwise (one CPU device)."""
        untie = trained["untie"]
        saved = UNTIE_STEP - 2
        manager = checkpoints.checkpoint_manager(str(tmp_path))
        checkpoints.save(manager, saved, untie["states"][saved])
        state = state_lib.restore_or_init(
            manager, untie["model"], untie["config"], jax.random.key(7)
        )
        manager.close()
        assert int(state.step) == saved
        # The step was compiled for the fixture's optimizer object (the same
        # optimizer; a run compiles for the one it restored with).
        state = state.replace(tx=untie["states"][0].tx)
        for step in range(saved, STEPS):
            state = untie["step"](state, trained["batches"][step], trained["key"])[0]
        jax.tree.map(
            np.testing.assert_array_equal,
            (state.params, state.opt_state),
            (untie["states"][STEPS].params, untie["states"][STEPS].opt_state),
        )

    def test_in_an_ensemble(self, trained):
        """Two members across U (one of them with the tables at 3x the rate)
        step as their single runs do."""
        untie = trained["untie"]
        config, model = untie["config"], untie["model"]
        start = UNTIE_STEP - 1
        stack = lambda *xs: jnp.stack(xs)  # noqa: E731
        states = jax.tree.map(lambda x: stack(x, x), untie["states"][start])
        step = jax.jit(
            functools.partial(
                train.program_train_step, model=model, config=config, vmap_size=1
            )
        )
        values = {"optim.table_lr_multiplier": jnp.array([1.0, 3.0])}
        tripled = tiny_config(**{**UNTIE, "optim.table_lr_multiplier": 3.0})
        # A single run's optimizer is its state's, made from its config.
        single = untie["states"][start].replace(tx=state_lib.make_optimizer(tripled))
        single_step = compiled_step(
            tripled, model, single, trained["batches"][0], trained["key"]
        )
        for s in range(start, STEPS):
            batch, key = trained["batches"][s], trained["key"]
            states, _ = step(
                states,
                jax.tree.map(lambda x: stack(x, x), batch),
                stack(key, key),
                values,
                jnp.array([True, True]),
            )
            single = single_step(single, batch, key)[0]
            for index, want in enumerate((untie["states"][s + 1], single)):
                got = jax.tree.map(lambda x, i=index: x[i], states)
                jax.tree.map(
                    functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
                    conftest.without_key_bias((got.params, adam_moments(got))),
                    conftest.without_key_bias((want.params, adam_moments(want))),
                )


def toy_params():
    """A tree with the tables' paths, a dense kernel and a bias."""
    keys = jax.random.split(jax.random.key(0), 4)
    return {
        "embed": {"embedding": jax.random.normal(keys[0], (5, 3))},
        "head": {"unembedding": jax.random.normal(keys[1], (5, 3))},
        "mlp": {"kernel": jax.random.normal(keys[2], (3, 4)), "bias": jnp.zeros(4)},
        "position_embedding": jax.random.normal(keys[3], (2, 3)),
    }


def run_optimizer(optimizer, steps=3):
    """``steps`` updates of ``toy_params`` with fixed pseudo-random
    gradients: the parameters and the optimizer state after each."""
    params, out = toy_params(), []
    state = optimizer.init(params)
    for step in range(steps):
        grads = jax.tree.map(
            lambda p, s=step: jax.random.normal(jax.random.key(s), p.shape), params
        )
        updates, state = jax.jit(optimizer.update)(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append((params, state))
    return out


class TestTableLearningRate:
    def test_equals_adamw_at_the_multiplied_rate(self):
        """The tables at m times the rate: optax.multi_transform of two AdamWs,
        one at m * lr for the tables, after the global-norm clipping."""
        config = tiny_config(**{"optim.table_lr_multiplier": 3.0})
        schedule = state_lib.learning_rate_schedule(config)
        adamw = functools.partial(
            optax.adamw,
            b1=config.optim.b1,
            b2=config.optim.b2,
            weight_decay=config.optim.weight_decay,
            mask=state_lib.weight_decay_mask,
        )
        reference = optax.chain(
            optax.clip_by_global_norm(config.optim.grad_clip),
            optax.multi_transform(
                {"table": adamw(lambda s: 3.0 * schedule(s)), "rest": adamw(schedule)},
                lambda p: jax.tree.map(
                    lambda t: "table" if t else "rest", state_lib.table_mask(p)
                ),
            ),
        )
        got = run_optimizer(state_lib.make_optimizer(config))
        want = run_optimizer(reference)
        for (got_params, _), (want_params, _) in zip(got, want):
            jax.tree.map(
                functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7),
                got_params,
                want_params,
            )
        first = jax.tree.map(lambda a, b: a - b, got[0][0], toy_params())
        lr = float(schedule(0))
        # Adam's first step is lr * sign(g), once clipped.
        for path, rate in ((("embed", "embedding"), 3 * lr), (("mlp", "bias"), lr)):
            moved = np.abs(first[path[0]][path[1]])
            np.testing.assert_allclose(moved, rate, rtol=1e-4)

    def test_a_multiplier_of_one_is_todays_optimizer(self):
        """m = 1: optax.adamw after the clipping, state for state and bitwise;
        other multipliers keep the same state tree (checkpoints restore)."""
        config = tiny_config()
        today = optax.chain(
            optax.clip_by_global_norm(config.optim.grad_clip),
            optax.adamw(
                state_lib.learning_rate_schedule(config),
                b1=config.optim.b1,
                b2=config.optim.b2,
                weight_decay=config.optim.weight_decay,
                mask=state_lib.weight_decay_mask,
            ),
        )
        got, want = (
            run_optimizer(state_lib.make_optimizer(config)),
            run_optimizer(today),
        )
        assert jax.tree.structure(got) == jax.tree.structure(want)
        jax.tree.map(np.testing.assert_array_equal, got, want)
        tripled = state_lib.make_optimizer(
            tiny_config(**{"optim.table_lr_multiplier": 3.0})
        )
        assert jax.tree.structure(tripled.init(toy_params())) == jax.tree.structure(
            today.init(toy_params())
        )

    def test_a_config_without_the_key_trains_at_one(self):
        """A run's config.json written before the key: the multiplier is 1."""
        config = ml_collections.ConfigDict(tiny_config().to_dict())
        del config.optim["table_lr_multiplier"]
        assert state_lib.optimizer_values(config)["table_lr_multiplier"] == 1.0
        jax.tree.map(
            np.testing.assert_array_equal,
            run_optimizer(state_lib.make_optimizer(config), steps=1),
            run_optimizer(state_lib.make_optimizer(tiny_config()), steps=1),
        )


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"model.tied": False, "model.untie_step": 0}, ValueError,
         r"config.model.untie_step must be in \[1, inf\); got 0"),
        ({"model.tied": False, "model.untie_step": 2.5}, TypeError,
         "config.model.untie_step must be int or None"),
        ({"model.untie_step": 10}, ValueError,
         "config.model.untie_step .*config.model.tied=False; got untie_step=10 "
         "with tied=True"),
        ({"optim.table_lr_multiplier": 0.0}, ValueError,
         r"config.optim.table_lr_multiplier must be in \(0.0, inf\); got 0.0"),
        ({"optim.table_lr_multiplier": -3.0}, ValueError,
         "config.optim.table_lr_multiplier must be in"),
    ],
)  # fmt: skip
def test_bad_values_are_refused(overrides, error, match):
    config = ml_collections.ConfigDict(default.get_config("tiny").to_dict())
    for name, value in overrides.items():
        section, key = name.split(".")
        config[section][key] = value
    with pytest.raises(error, match=match):
        configuration.validate_config(config)
