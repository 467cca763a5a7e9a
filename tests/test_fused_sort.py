"""The fused sweep's row order of the vocabulary (``vocab_order``), for every
rule: invisible to the caller, within filtering's bound, and checked.

Each rule's value and gradients with a random permutation and with
``"mean_logit"`` against the unsorted sweep (float32 rounding: the blocks'
merges and ``dh``'s sum run in another order) and against a float64 numpy
reference from the materialized logits. N = 23 tokens in chunks of 5 (a
ragged last chunk), V = 37 rows in blocks of 8 (a ragged last block), some
tokens of weight 0, a bias.
"""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import (
    _vocab_order,
    distillation,
    fused,
    modules,
    policy_gradient,
    preference,
    sparse_distillation,
    token_logprobs,
    vocab_parallel,
)
from lmhead.lm import configuration, train
from tests.errors import bad_input_test, keyword_rows

N, D, V = 23, 6, 37
CHUNK, ROWS = 5, 8
ORDERS = {"permutation": np.random.default_rng(7).permutation(V), "mean": "mean_logit"}


@pytest.fixture(autouse=True)
def small_blocks_and_exact_matmuls(monkeypatch):
    monkeypatch.setitem(fused.VOCAB_BLOCK_ROWS, jax.default_backend(), ROWS)
    with jax.default_matmul_precision("highest"):
        yield


def make_inputs(peaked=False, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((V, D))
    labels = rng.integers(0, V, N)
    h = rng.standard_normal((N, D))
    if peaked:  # each h points at its label's row: a trained model's softmax
        labels = rng.integers(0, 12, N)
        h = 3.0 * w[labels] + 0.3 * h
    bias = 0.5 * rng.standard_normal(V)
    weights = rng.uniform(0.5, 2.0, N) * (rng.random(N) < 0.8)
    f32 = lambda x: x.astype(np.float32)  # noqa: E731
    return f32(h), f32(w), f32(bias), labels, f32(weights)


def np_softmax(z):
    p = np.exp(z - z.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def np_grads(h, w, bias, coef):
    """``(dh, dw, dbias)`` of a loss whose gradient w.r.t. the logits is
    ``coef [N, V]``, in float64."""
    return coef @ w.astype(np.float64), coef.T @ h.astype(np.float64), coef.sum(0)


def np_cross_entropy(h, w, bias, labels, weights):
    z = h.astype(np.float64) @ w.astype(np.float64).T + bias
    p = np_softmax(z)
    onehot = np.eye(V)[labels]
    c = weights / weights.sum()
    loss = -np.sum(c * np.log(np.sum(p * onehot, 1)))
    return loss, np_grads(h, w, bias, c[:, None] * (p - onehot))


def np_distillation(h, w, bias, labels, weights, teacher, hard):
    """``hard * nll + (1 - hard) * KL(teacher || student)``, weighted mean."""
    z = h.astype(np.float64) @ w.astype(np.float64).T + bias
    q, p = np_softmax(z), np_softmax(teacher.astype(np.float64))
    onehot = np.eye(V)[labels]
    c = weights / weights.sum()
    kl = np.sum(p * (np.log(p) - np.log(q)), 1)
    nll = -np.log(np.sum(q * onehot, 1))
    loss = np.sum(c * (hard * nll + (1 - hard) * kl))
    coef = c[:, None] * (hard * (q - onehot) + (1 - hard) * (q - p))
    return loss, np_grads(h, w, bias, coef)


def grpo_setup(labels, weights):
    ids = labels.reshape(1, N)
    mask = (weights > 0).astype(np.float32).reshape(1, N)
    return ids, mask, np.array([0.7], np.float32)


def np_grpo(h, w, bias, labels, weights):
    """GRPO's gradient, its per-token coefficient on ``log p`` from autodiff
    of the materialized ``policy_gradient_loss``, then ``c (onehot - p)``."""
    ids, mask, advantages = grpo_setup(labels, weights)
    z = h.astype(np.float64) @ w.astype(np.float64).T + bias
    logp = np.log(np_softmax(z))[np.arange(N), labels].reshape(1, N)
    loss, grad = jax.value_and_grad(
        lambda lp: policy_gradient.policy_gradient_loss(
            lp, mask, advantages, loss_type="grpo"
        )[0]
    )(logp.astype(np.float32))
    c = np.asarray(grad, np.float64).reshape(N, 1)
    return float(loss), np_grads(h, w, bias, c * (np.eye(V)[labels] - np_softmax(z)))


def rule_cases():
    """``(name, loss(h, w, bias, vocab_order), reference(h, w, bias))``."""
    _, _, _, labels, weights = make_inputs()
    teacher = np.random.default_rng(3).standard_normal((N, V)).astype(np.float32)
    ids, mask, advantages = grpo_setup(labels, weights)
    kw = dict(chunk_size=CHUNK)
    return [
        (
            "cross_entropy",
            lambda h, w, b, order: fused.fused_cross_entropy(
                h, w, labels, bias=b, weights=weights, vocab_order=order, **kw
            ),
            lambda h, w, b: np_cross_entropy(h, w, b, labels, weights),
        ),
        (
            "distillation",
            lambda h, w, b, order: distillation.fused_distillation_loss(
                h,
                w,
                teacher,
                labels=labels,
                bias=b,
                weights=weights,
                hard_weight=0.3,
                vocab_order=order,
                **kw,
            ),
            lambda h, w, b: np_distillation(h, w, b, labels, weights, teacher, 0.3),
        ),
        (
            "grpo",
            lambda h, w, b, order: policy_gradient.fused_policy_gradient_loss(
                h[None],
                w,
                ids,
                mask,
                advantages,
                bias=b,
                loss_type="grpo",
                vocab_order=order,
                **kw,
            ),
            lambda h, w, b: np_grpo(h, w, b, labels, weights),
        ),
    ]


class SortedTest(chex.TestCase):
    # Compiled only, as the other fused tests: the sweep runs its scans and
    # custom VJP compiled either way.
    @chex.variants(with_jit=True)
    def test_every_rule_is_the_same_in_the_callers_order(self):
        h, w, bias, _, _ = make_inputs()
        for name, loss, reference in rule_cases():

            def step(order, loss=loss):
                def value(h, w, b):
                    out, metrics = loss(h, w, b, order)
                    return out, metrics

                return self.variant(
                    jax.value_and_grad(value, argnums=(0, 1, 2), has_aux=True)
                )(h, w, bias)

            (base, base_metrics), base_grads = step(None)
            ref_loss, ref_grads = reference(h, w, bias)
            np.testing.assert_allclose(base, ref_loss, rtol=1e-5, err_msg=name)
            for order in ORDERS.values():
                (value, metrics), grads = step(order)
                np.testing.assert_allclose(value, base, rtol=2e-6, err_msg=name)
                for key in base_metrics:  # accuracy, weight_sum, ...
                    np.testing.assert_allclose(
                        metrics[key], base_metrics[key], rtol=2e-6, err_msg=key
                    )
                for got, same, want in zip(grads, base_grads, ref_grads):
                    np.testing.assert_allclose(got, same, rtol=1e-5, atol=2e-7)
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)

    @chex.variants(with_jit=True)
    def test_argmax_entropy_and_the_recomputed_gradient_map_back(self):
        # reduction="none" and the entropy's gradient take the sweep's second
        # pass, given the outputs; the argmax is an id, mapped back.
        h, w, bias, labels, weights = make_inputs(peaked=True)
        labels[:3] = np.argmax(h[:3] @ w.T + bias, 1)  # some correct

        def value(order):
            def objective(h, w, b):
                loss, metrics = fused.fused_cross_entropy(
                    h,
                    w,
                    labels,
                    bias=b,
                    weights=weights,
                    reduction="none",
                    entropy=True,
                    chunk_size=CHUNK,
                    vocab_order=order,
                )
                total = jnp.sum(loss) + 0.3 * jnp.sum(metrics["token_entropy"])
                return total, metrics["accuracy"]

            return self.variant(
                jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)
            )(h, w, bias)

        (total, accuracy), grads = value(None)
        assert 0 < accuracy < 1
        for order in ORDERS.values():
            (got, got_accuracy), got_grads = value(order)
            np.testing.assert_allclose(got, total, rtol=2e-6)
            assert got_accuracy == accuracy
            # The entropy's p log p terms cancel: rounding relative to the
            # largest entry.
            for g, e in zip(got_grads, grads):
                np.testing.assert_allclose(g, e, atol=1e-5 * np.abs(e).max())


def test_a_sorted_filter_stays_within_the_bound():
    # Sorting changes which tiles are skipped, not the bound of
    # SweepOptions.gradient_options: summed over every row (token) it bounds
    # any set of skipped tiles.
    h, w, _, labels, weights = make_inputs(peaked=True, seed=1)
    eps = 0.05

    def grads(**options):
        return jax.jit(
            jax.grad(
                lambda h, w: fused.fused_cross_entropy(
                    h, w, labels, weights=weights, chunk_size=CHUNK, **options
                )[0],
                argnums=(0, 1),
            )
        )(h, w)

    exact = grads()
    sigma = weights / weights.sum()
    dh_bound = eps * sigma[:, None] * np.abs(w).sum(0)
    dw_bound = eps * np.abs(sigma @ np.abs(h))
    # Labels in the first 12 rows: the frequency order of the labels puts
    # them in the first blocks, the reversed table spreads them.
    for order in (
        _vocab_order.frequency_order(np.bincount(labels, minlength=V)),
        np.arange(V)[::-1],
    ):
        dh, dw = grads(filter_eps=eps, vocab_order=order)
        assert np.any(dh != exact[0]) and np.any(dw != exact[1])  # tiles skipped
        assert np.all(np.abs(dh - exact[0]) <= dh_bound + 1e-6)
        assert np.all(np.abs(dw - exact[1]) <= dw_bound + 1e-6)


def test_mean_logit_order_under_vmap_is_each_members_own():
    # An ensemble's members vmap the loss: each member's order comes from its
    # own h, w and bias, and its loss and gradients are its own unsorted ones.
    members = [make_inputs(peaked=True, seed=s) for s in (3, 4)]
    h, w, bias, labels, weights = (np.stack(x) for x in zip(*members))

    def loss(h, w, bias, labels, weights):
        return fused.fused_cross_entropy(
            h,
            w,
            labels,
            bias=bias,
            weights=weights,
            chunk_size=CHUNK,
            vocab_order="mean_logit",
        )[0]

    values, grads = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2))))(
        h, w, bias, labels, weights
    )
    orders = jax.vmap(
        lambda h, w, b, k: _vocab_order.mean_logit_order(h, w, b, weights=k)
    )(h, w, bias, weights)
    assert not np.array_equal(orders[0], orders[1])
    for m, (hm, wm, bm, lm, km) in enumerate(members):
        np.testing.assert_array_equal(
            orders[m], _vocab_order.mean_logit_order(hm, wm, bm, weights=km)
        )
        want, reference = np_cross_entropy(hm, wm, bm, lm, km)
        np.testing.assert_allclose(values[m], want, rtol=2e-6)
        for got, ref in zip((g[m] for g in grads), reference):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_frequency_order_is_most_frequent_first_ties_by_id():
    counts = np.random.default_rng(0).integers(0, 4, 50)  # many ties
    want = sorted(range(50), key=lambda i: (-counts[i], i))
    np.testing.assert_array_equal(_vocab_order.frequency_order(counts), want)
    assert _vocab_order.frequency_order(counts.astype(np.float32)).dtype == np.int32


def test_mean_logit_order_sorts_the_rows_by_their_mean_logit():
    h, w, bias, _, weights = make_inputs()
    live = weights != 0
    mean = (h[live].astype(np.float64) @ w.T.astype(np.float64)).mean(0) * 2.0 + bias
    want = sorted(range(V), key=lambda i: (-mean[i], i))
    got = _vocab_order.mean_logit_order(h, w, bias, scale=2.0, weights=weights)
    np.testing.assert_array_equal(got, want)


def bad_order_call(**kw):
    h, w, _, labels, _ = make_inputs()
    return fused.fused_cross_entropy(h, w, labels, chunk_size=CHUNK, **kw)


def vocab_parallel_call(**kw):
    h, w, _, labels, _ = make_inputs()
    mesh = jax.make_mesh(
        (1, 1),
        ("data", "model"),
        (jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:1],
    )
    return vocab_parallel.vocab_parallel_cross_entropy(h, w, labels, mesh=mesh, **kw)


PERMUTATION = np.arange(V)
BAD_INPUTS = [
    *keyword_rows(
        "cross_entropy",
        bad_order_call,
        [
            ("short", dict(vocab_order=PERMUTATION[:-1]), ValueError),
            ("repeated", dict(vocab_order=np.r_[0, PERMUTATION[:-1]]), ValueError),
            ("out_of_range", dict(vocab_order=PERMUTATION + 1), ValueError),
            ("negative", dict(vocab_order=PERMUTATION - 1), ValueError),
            ("float", dict(vocab_order=PERMUTATION.astype(float)), TypeError),
            ("word", dict(vocab_order="frequency"), ValueError),
            ("scalar", dict(vocab_order=3), TypeError),
        ],
    ),
    *keyword_rows(
        "vocab_parallel",
        vocab_parallel_call,
        [("split", dict(vocab_order=PERMUTATION), ValueError)],
    ),
    (
        "logprobs repeated",
        lambda: token_logprobs.fused_token_logprobs(
            *make_inputs()[:2], np.zeros(N, int), vocab_order=np.zeros(V, int)
        ),
        ValueError,
        "vocab_order",
    ),
    (
        "counts",
        lambda: _vocab_order.frequency_order(np.ones((2, 3))),
        ValueError,
        "counts",
    ),
]
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


def test_a_traced_order_is_taken_as_given():
    # Under jit the permutation is not checked (the documented rule): a
    # valid one gives the unsorted loss.
    h, w, _, labels, weights = make_inputs()
    loss = jax.jit(
        lambda order: fused.fused_cross_entropy(
            h, w, labels, weights=weights, chunk_size=CHUNK, vocab_order=order
        )[0]
    )
    want = fused.fused_cross_entropy(h, w, labels, weights=weights, chunk_size=CHUNK)
    np.testing.assert_allclose(loss(ORDERS["permutation"]), want[0], rtol=2e-6)


def config_with(**loss):
    config = configuration.load_config("tiny")
    for key, value in loss.items():
        config.loss[key] = value
    return config


CONFIG_ROWS = [
    (
        "config word",
        lambda: configuration.validate_config(config_with(vocab_order="sorted")),
        ValueError,
        "loss.vocab_order",
    ),
    (
        "config materialized",
        lambda: configuration.validate_config(
            config_with(vocab_order="mean_logit", loss_impl="materialized")
        ),
        ValueError,
        ("loss.vocab_order", "loss_impl"),
    ),
    (
        "config frequency without tokens",
        lambda: train.loss_keywords(config_with(vocab_order="frequency").loss),
        ValueError,
        "loss.vocab_order",
    ),
]
test_bad_config_raises_exactly_naming_the_key = bad_input_test(CONFIG_ROWS)


def test_training_counts_its_tokens_and_the_head_passes_the_order():
    h, w, _, labels, weights = make_inputs()
    tokens = np.random.default_rng(5).zipf(1.5, 500) % V
    dataset = types.SimpleNamespace(train_tokens=tokens.astype(np.uint16), vocab_size=V)
    keywords = train.loss_keywords(config_with(vocab_order="frequency").loss, dataset)
    counts = np.array([np.sum(tokens == i) for i in range(V)])
    want = sorted(range(V), key=lambda i: (-counts[i], i))
    np.testing.assert_array_equal(keywords["vocab_order"], want)
    assert "vocab_order" not in train.loss_keywords(config_with().loss)
    assert (
        train.loss_keywords(config_with(vocab_order="mean_logit").loss)["vocab_order"]
        == "mean_logit"
    )

    def head_loss(h, **options):
        return modules.LMHead(V).apply(
            {},
            h,
            labels,
            w,
            weights=weights,
            chunk_size=CHUNK,
            method="loss",
            **options,
        )[0]

    order = keywords["vocab_order"]
    sorted_dh = jax.jit(jax.grad(lambda h: head_loss(h, vocab_order=order)))(h)
    dh = jax.jit(jax.grad(head_loss))(h)
    np.testing.assert_allclose(sorted_dh, dh, rtol=1e-5, atol=2e-7)
    assert np.any(sorted_dh != dh)  # the order was applied: other rounding


@pytest.mark.parametrize("name", ["dpo", "sparse_distillation"])
def test_the_other_post_training_losses_take_the_order(name):
    # DPO's pairs are segments of the sweep (their gradient deferred to the
    # pair's end); the sparse teacher's ids are mapped as labels are.
    h, w, bias, labels, weights = make_inputs()
    ids = labels[:22].reshape(2, 11)
    mask = (weights[:22] > 0).astype(np.float32).reshape(2, 11)
    teacher_ids = np.stack([labels, (labels + 5) % V], -1)
    teacher_logps = np.log(np.full((N, 2), 0.4, np.float32))
    losses = {
        "dpo": lambda h, w, b, order: preference.fused_preference_loss(
            h[:11][None],
            h[11:22][None],
            w,
            ids[:1],
            ids[1:],
            mask[:1],
            mask[1:],
            bias=b,
            reference_logps=(np.zeros((1, 11)), np.zeros((1, 11))),
            chunk_size=CHUNK,
            vocab_order=order,
        )[0],
        "sparse_distillation": lambda h, w, b, order: (
            sparse_distillation.fused_sparse_distillation_loss(
                h,
                w,
                teacher_ids,
                teacher_logps,
                bias=b,
                weights=weights,
                chunk_size=CHUNK,
                vocab_order=order,
            )[0]
        ),
    }
    step = jax.jit(jax.value_and_grad(losses[name], argnums=(0, 1, 2)))
    value, grads = step(h, w, bias, None)
    got, got_grads = step(h, w, bias, ORDERS["permutation"])
    np.testing.assert_allclose(got, value, rtol=2e-6)
    for g, e in zip(got_grads, grads):
        assert np.any(e != 0)
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=2e-7)
