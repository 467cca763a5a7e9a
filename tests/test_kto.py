"""Tests for lmhead/kto.py.

Hand-worked cases pin the formula; the loss is checked against TRL's
KTOTrainer formula written here in float64 numpy (Liger-Kernel 0.8.5's fused
KTO is it with weights 1): the plain loss on random log-probs, the fused one
on numpy's log-softmax of the materialized logits, with gradients by central
differences. B = 4 completions of T = 5 tokens, 3 desirable, some tokens
masked, in chunks of 4 (a ragged last chunk).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmhead import kto
from tests import post_training_references as refs
from tests.errors import bad_input_test, keyword_rows, rules_test

B, T, D, V = 4, 5, 4, 11
BETA, KL = 0.7, 0.3
OPTIONS = dict(scale=0.8, softcap=3.0, temperature=0.9)
DESIRABLE = np.array([True, False, True, True])


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_kto_loss(logps, mask, ref, *, kl=0.0, weights=(1.0, 1.0), average=False):
    """TRL's KTO loss, float64: ``w_D (1 - sigmoid(beta (r - z)))`` for a
    desirable completion, ``w_U (1 - sigmoid(beta (z - r)))`` for an
    undesirable one, ``r`` the sum (or mean) of the log-ratios, averaged
    over all completions."""

    def score(x):
        s = np.sum(mask * x, -1)
        return s / mask.sum(-1) if average else s

    r = score(logps) - (0.0 if ref is None else score(ref))
    chosen = weights[0] * (1 - np_sigmoid(BETA * (r - kl)))
    rejected = weights[1] * (1 - np_sigmoid(BETA * (kl - r)))
    return np.mean(np.where(DESIRABLE, chosen, rejected))


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T))
    mask[0, :2] = 0  # a prompt
    mask[1, -1] = 0  # padding
    mask[2, 0] = 0.5  # a weighted token
    return dict(
        h=rng.standard_normal((B, T, D)),
        w=rng.standard_normal((V, D)),
        bias=rng.standard_normal(V),
        h_ref=rng.standard_normal((B, T, D)),
        w_ref=rng.standard_normal((V, D)),
        ids=rng.integers(0, V, (B, T)).astype(np.int32),
        mask=mask,
    )


class HandWorkedTest(parameterized.TestCase):
    """One token per completion, so the log-ratio is the token's."""

    @parameterized.named_parameters(
        # At the reference point each loss is 1 - sigmoid(0) = 1/2.
        ("at_the_reference_point", [0.3, 0.3], dict(kl=0.3), 0.5),
        # beta = 1, r - z = log 3: desirable 1 - 3/4, undesirable 1 - 1/4,
        # weighted 2 and 0.5: (2 / 4 + 0.5 * 3 / 4) / 2.
        (
            "weighted",
            [np.log(3.0), np.log(3.0)],
            dict(beta=1.0, desirable_weight=2.0, undesirable_weight=0.5),
            (2 / 4 + 0.5 * 3 / 4) / 2,
        ),
    )
    def test_case(self, log_ratios, options, expected):
        loss, metrics = kto.kto_loss(
            jnp.asarray(log_ratios)[:, None],
            jnp.ones((2, 1)),
            jnp.array([True, False]),
            **options,
        )
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        beta = options.get("beta", 0.1)
        np.testing.assert_allclose(
            metrics["reward_margin"], beta * (log_ratios[0] - log_ratios[1]), atol=1e-7
        )

    def test_reference_point_is_trls_clamped_batch_mean(self):
        """Row sums of the log-ratios 0.5 and -1: mean -0.25, clamped to 0.
        The policy 0.5 higher per token: 1.5 and -0.5, mean 0.5. Row means,
        the policy 1 higher per token: 1.25 and 0, mean 0.625."""
        mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])
        policy = jnp.array([[-0.5, -0.5], [-2.0, 7.0]])
        ref = jnp.array([[-1.0, -0.5], [-1.0, 7.0]])
        for shift, average, expected in ((0.0, False, 0.0), (0.5, False, 0.5),
                                         (1.0, True, 0.625)):  # fmt: skip
            np.testing.assert_allclose(
                kto.kto_reference_point(
                    policy + shift, ref, mask, average_log_prob=average
                ),
                expected,
                rtol=1e-6,
            )


# (keywords of kto_loss, of np_kto_loss, with a reference): the references'
# defaults, then each option (TRL's weights, a reference point, Liger's
# means, no reference).
CONVENTIONS = [
    (dict(), dict(), True),
    (
        dict(desirable_weight=1.5, undesirable_weight=0.5, kl=KL),
        dict(weights=(1.5, 0.5), kl=KL),
        True,
    ),
    (dict(average_log_prob=True, kl=KL), dict(average=True, kl=KL), True),
    (dict(kl=KL), dict(kl=KL), False),
]


class FormulaTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*CONVENTIONS)
    def test_value_and_gradients_match_float64(self, options, conventions, with_ref):
        """Value and d/d(logps) equal TRL's formula's and its central
        differences; the reference's log-probs and ``kl`` get none."""
        mask = make_inputs()["mask"]
        rng = np.random.default_rng(1)
        logps, ref = (-rng.exponential(size=(B, T)) for _ in range(2))
        options = dict(options)
        with_kl = options.pop("kl", None) is not None

        def loss(logps, ref, kl):
            return kto.kto_loss(
                logps,
                mask,
                DESIRABLE,
                ref_logps=ref if with_ref else None,
                kl=kl if with_kl else None,
                beta=BETA,
                **options,
            )[0]

        args = [jnp.asarray(logps), jnp.asarray(ref), jnp.asarray(KL)]
        value, grads = self.variant(jax.value_and_grad(loss, (0, 1, 2)))(*args)

        def reference(v):
            return np_kto_loss(v, mask, ref if with_ref else None, **conventions)

        np.testing.assert_allclose(value, reference(logps), rtol=1e-5)
        np.testing.assert_allclose(
            grads[0], refs.numeric_grad(reference, logps), rtol=1e-4, atol=1e-7
        )
        np.testing.assert_array_equal(grads[1], 0.0)
        np.testing.assert_array_equal(grads[2], 0.0)


class FusedTest(parameterized.TestCase):
    # Compiled only, as tests/test_preference.py's FusedTest.
    @chex.variants(with_jit=True)
    @parameterized.parameters(
        ("head", dict()),
        ("logps", dict(desirable_weight=1.5, undesirable_weight=0.5, kl=KL)),
        ("head", dict(average_log_prob=True, kl=KL)),
    )
    def test_value_and_gradients_match_float64(self, reference, options):
        """Value and d/d(h, w, bias) equal TRL's formula's on the float64
        log-probs and its central differences; the reference gets none."""
        x = make_inputs()
        ref, *_ = refs.token_logprobs(x["h_ref"], x["w_ref"], None, x["ids"], **OPTIONS)

        def fused(h, w, bias, h_ref, w_ref):
            given = (
                dict(reference_head=(h_ref, w_ref))
                if reference == "head"
                else dict(reference_logps=ref)
            )
            return kto.fused_kto_loss(
                h,
                w,
                x["ids"],
                x["mask"],
                DESIRABLE,
                bias=bias,
                beta=BETA,
                chunk_size=4,
                **given,
                **OPTIONS,
                **options,
            )[0]

        names = ("h", "w", "bias", "h_ref", "w_ref")
        args = [jnp.asarray(x[n], jnp.float32) for n in names]
        value, grads = self.variant(jax.value_and_grad(fused, tuple(range(5))))(*args)
        conventions = dict(
            weights=(
                options.get("desirable_weight", 1.0),
                options.get("undesirable_weight", 1.0),
            ),
            kl=options.get("kl", 0.0),
            average=options.get("average_log_prob", False),
        )

        def reference_loss(h, w, bias):
            logps, *_ = refs.token_logprobs(h, w, bias, x["ids"], **OPTIONS)
            return np_kto_loss(logps, x["mask"], ref, **conventions)

        inputs = [x[n] for n in names[:3]]
        np.testing.assert_allclose(value, reference_loss(*inputs), rtol=1e-5)
        for i, name in enumerate(names[:3]):

            def along(v, i=i):
                return reference_loss(*inputs[:i], v, *inputs[i + 1 :])

            np.testing.assert_allclose(
                grads[i],
                refs.numeric_grad(along, x[name]),
                rtol=1e-4,
                atol=1e-6,
                err_msg=name,
            )
        np.testing.assert_array_equal(grads[3], 0.0)
        np.testing.assert_array_equal(grads[4], 0.0)

    def test_fused_equals_the_loss_of_materialized_logprobs(self):
        """The fused loss and its metrics equal :func:`kto.kto_loss` on the
        log-softmax of the materialized logits, in float32."""
        x = make_inputs(seed=2)
        h, w, h_ref, w_ref = (
            jnp.asarray(x[n], jnp.float32) for n in ("h", "w", "h_ref", "w_ref")
        )

        def logps(h, w):
            log_p = jax.nn.log_softmax(h @ w.T)
            return jnp.take_along_axis(log_p, x["ids"][..., None], -1)[..., 0]

        options = dict(kl=KL, desirable_weight=1.3)
        fused = kto.fused_kto_loss(
            h,
            w,
            x["ids"],
            x["mask"],
            DESIRABLE,
            reference_head=(h_ref, w_ref),
            chunk_size=4,
            **options,
        )
        materialized = kto.kto_loss(
            logps(h, w), x["mask"], DESIRABLE, ref_logps=logps(h_ref, w_ref), **options
        )
        chex.assert_trees_all_close(fused, materialized, rtol=1e-5, atol=1e-6)


class IgnoredIdsTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_an_id_of_minus_100_is_a_masked_token(self):
        """Ids of -100 where the mask was 0 (a prompt, padding), with the
        mask 1 there, give the loss and gradients of the original mask."""
        x = make_inputs()
        ids = np.where(x["mask"] == 0, -100, x["ids"]).astype(np.int32)
        mask = np.where(x["mask"] == 0, 1.0, x["mask"])

        def value(h, w, ids, mask):
            return kto.fused_kto_loss(
                h, w, ids, mask, DESIRABLE, beta=BETA, kl=KL, chunk_size=4
            )[0]

        h, w = (jnp.asarray(x[n], jnp.float32) for n in ("h", "w"))
        step = self.variant(jax.value_and_grad(value, (0, 1)))
        chex.assert_trees_all_close(
            step(h, w, ids, mask),
            step(h, w, x["ids"], x["mask"]),
            rtol=1e-6,
            atol=1e-7,
        )


def loss(**overrides):
    x = make_inputs()
    args = dict(logps=-np.ones((B, T)), mask=x["mask"], desirable=DESIRABLE)
    return kto.kto_loss(**(args | overrides))


def fused(**overrides):
    x = make_inputs()
    args = dict(h=x["h"], w=x["w"], ids=x["ids"], mask=x["mask"], desirable=DESIRABLE)
    return kto.fused_kto_loss(**(args | overrides))


def reference_point(**overrides):
    args = dict(
        logps=-np.ones((B, T)), ref_logps=-np.ones((B, T)), mask=np.ones((B, T))
    )
    return kto.kto_reference_point(**(args | overrides))


LOSS = [
    ("desirable_weight below 0", dict(desirable_weight=-0.1), ValueError),
    ("undesirable_weight below 0", dict(undesirable_weight=-1.0), ValueError),
    ("beta 0", dict(beta=0.0), ValueError),
    ("desirable not boolean", dict(desirable=np.array([1, 0, 1, 1])), TypeError),
    ("desirable shape", dict(desirable=np.array([True, False])), ValueError),
    ("kl not a scalar", dict(kl=np.zeros(B)), ValueError),
    ("kl nan", dict(kl=np.nan), ValueError),
    ("average_log_prob not bool", dict(average_log_prob=None), TypeError),
    ("mask with no tokens", dict(mask=np.zeros((B, T))), ValueError),
    ("mask shape", dict(mask=np.ones((B, 2))), ValueError),
    ("logps rank", dict(logps=-np.ones(B)), ValueError),
    ("ref shape", dict(ref_logps=np.ones((B, 2))), ValueError),
]  # fmt: skip
FUSED = [
    ("ids shape", dict(ids=np.zeros((B, 2), np.int32)), ValueError),
    ("both references",
     dict(reference_logps=np.zeros((B, T)),
          reference_head=(np.zeros((B, T, D)), np.zeros((V, D)))), ValueError),
    ("reference_head length", dict(reference_head=(np.zeros((V, D)),)), ValueError),
    ("desirable_weight below 0", dict(desirable_weight=-0.1), ValueError),
    ("desirable not boolean", dict(desirable=np.ones(B)), TypeError),
]  # fmt: skip
REFERENCE_POINT = [
    ("mask shape", dict(mask=np.ones((B, 2))), ValueError),
    ("average_log_prob not bool", dict(average_log_prob=1), TypeError),
]
BAD_INPUTS = [
    *keyword_rows("loss", loss, LOSS),
    *keyword_rows("fused", fused, FUSED),
    *keyword_rows("reference point", reference_point, REFERENCE_POINT),
]
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


def _group_metrics(desirable):
    """The rewards' group means when one group is empty: 0 by rule."""
    _, metrics = kto.kto_loss(
        -jnp.ones((2, 3)), jnp.ones((2, 3)), desirable, ref_logps=-2 * jnp.ones((2, 3))
    )
    return jnp.stack([metrics["chosen_rewards"], metrics["rejected_rewards"]])


# beta (S - S_ref) = 0.1 * 3 for the group present, 0 for the empty one.
RULES = [
    ("no undesirable completion", _group_metrics, (jnp.array([True, True]),),
     [0.3, 0.0]),
    ("no desirable completion", _group_metrics, (jnp.array([False, False]),),
     [0.0, 0.3]),
]  # fmt: skip
test_an_empty_group_has_metrics_0 = rules_test(RULES)
