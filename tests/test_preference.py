"""Tests for lmhead/preference.py.

Hand-worked cases pin each loss's formula; the losses are checked against
the same formulas written here in float64 numpy, in the convention each
reference uses by default (Liger-Kernel 0.8.5's ``chunked_loss``, TRL's
DPOTrainer and CPOTrainer) and with each option that departs from it: the
plain loss on random log-probs, the fused one on numpy's log-softmax of the
materialized logits, with gradients by central differences. B = 2 pairs of
T = 5 tokens (chosen) and 4 (rejected), N = 18 tokens in chunks of 4 (a
ragged last chunk), some masked.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmhead import preference
from tests import post_training_references as refs
from tests.errors import bad_input_test, keyword_rows

B, T_C, T_R, D, V = 2, 5, 4, 4, 11
BETA, GAMMA, ALPHA, SMOOTHING = 0.7, 0.3, 0.6, 0.1
OPTIONS = dict(scale=0.8, softcap=3.0, temperature=0.9)


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def np_log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


# The references' defaults, from their source: means of log-probs for IPO
# (TRL; Liger 0.8.5 has no IPO), SimPO and ORPO, sums for the others; the
# chosen tokens' NLL for ORPO and CPO (Liger's compute_nll_loss, TRL's
# cpo_alpha), not for SimPO (its paper, Liger's function, TRL's docs).
REFERENCE_MEANS = ("ipo", "simpo", "orpo")
REFERENCE_NLL = ("orpo", "cpo")


def np_preference_loss(
    lc, lr, mc, mr, loss_type, ref_c=None, ref_r=None, average=None, nll=None
):
    """The losses from their papers' formulas, float64; ``average`` and
    ``nll`` None for the reference's default."""
    average = loss_type in REFERENCE_MEANS if average is None else average
    nll = loss_type in REFERENCE_NLL if nll is None else nll

    def score(x, m):
        if x is None:
            return 0.0
        s = np.sum(m * x, -1)
        return s / m.sum(-1) if average else s

    p_c, p_r = score(lc, mc), score(lr, mr)
    eps = SMOOTHING
    smoothed = lambda x: -(1 - eps) * np_log_sigmoid(x) - eps * np_log_sigmoid(-x)  # noqa: E731
    if loss_type in ("sigmoid", "hinge", "ipo", "robust"):
        delta = (p_c - score(ref_c, mc)) - (p_r - score(ref_r, mr))
        x = BETA * delta
        per_pair = {
            "sigmoid": lambda: smoothed(x),
            # Chowdhury et al. 2024, as Liger's and TRL's "robust".
            "robust": lambda: (
                (-(1 - eps) * np_log_sigmoid(x) + eps * np_log_sigmoid(-x))
                / (1 - 2 * eps)
            ),
            "hinge": lambda: np.maximum(0, 1 - x),
            "ipo": lambda: (delta - 1 / (2 * BETA)) ** 2,
        }[loss_type]()
    elif loss_type == "simpo":
        per_pair = smoothed(BETA * (p_c - p_r) - GAMMA)
    elif loss_type == "cpo":
        per_pair = smoothed(BETA * (p_c - p_r))
    else:
        odds = lambda a: a - np.log1p(-np.exp(a))  # noqa: E731
        per_pair = -BETA * np_log_sigmoid(odds(p_c) - odds(p_r))
    # The NLL: a token mean over all chosen tokens, sums or means aside.
    return per_pair.mean() + (ALPHA * -np.sum(mc * lc) / mc.sum() if nll else 0.0)


def make_inputs(seed=0, pairs=B):
    rng = np.random.default_rng(seed)
    mask_c = np.ones((pairs, T_C))
    mask_c[0, :2] = 0  # a prompt
    mask_r = np.ones((pairs, T_R))
    mask_r[1, -1] = 0  # padding
    mask_r[-1, 0] = 0.5  # a weighted token
    return dict(
        h_c=rng.standard_normal((pairs, T_C, D)),
        h_r=rng.standard_normal((pairs, T_R, D)),
        w=rng.standard_normal((V, D)),
        bias=rng.standard_normal(V),
        h_rc=rng.standard_normal((pairs, T_C, D)),
        h_rr=rng.standard_normal((pairs, T_R, D)),
        w_ref=rng.standard_normal((V, D)),
        ids_c=rng.integers(0, V, (pairs, T_C)).astype(np.int32),
        ids_r=rng.integers(0, V, (pairs, T_R)).astype(np.int32),
        mask_c=mask_c,
        mask_r=mask_r,
    )


def fused_loss(x, h_chosen, h_rejected, w, **kwargs):
    """``fused_preference_loss`` of the hidden states given, on the ids and
    masks of the inputs ``x``."""
    ids_and_masks = (x["ids_c"], x["ids_r"], x["mask_c"], x["mask_r"])
    return preference.fused_preference_loss(
        h_chosen, h_rejected, w, *ids_and_masks, **kwargs
    )


def reference_logps(x):
    """The frozen reference's per-token log-probs of the chosen and rejected
    tokens, float64."""
    return tuple(
        refs.token_logprobs(x[h], x["w_ref"], None, x[ids], **OPTIONS)[0]
        for h, ids in (("h_rc", "ids_c"), ("h_rr", "ids_r"))
    )


def assert_matches_float64(x, loss_type, value, grads, names, **conventions):
    """``value`` and ``grads`` (of ``names``) equal the numpy formula's on the
    float64 log-probs, and its central differences; ``conventions`` are
    :func:`np_preference_loss`'s ``average`` and ``nll``."""
    ref_c, ref_r = reference_logps(x)

    def reference_loss(h_c, h_r, w, bias):
        lc, *_ = refs.token_logprobs(h_c, w, bias, x["ids_c"], **OPTIONS)
        lr, *_ = refs.token_logprobs(h_r, w, bias, x["ids_r"], **OPTIONS)
        return np_preference_loss(
            lc, lr, x["mask_c"], x["mask_r"], loss_type, ref_c, ref_r, **conventions
        )

    inputs = [x[n] for n in ("h_c", "h_r", "w", "bias")]
    np.testing.assert_allclose(value, reference_loss(*inputs), rtol=1e-5)
    for i, name in enumerate(names):

        def along(v, i=i):
            return reference_loss(*inputs[:i], v, *inputs[i + 1 :])

        np.testing.assert_allclose(
            grads[i],
            refs.numeric_grad(along, x[name]),
            rtol=1e-4,
            atol=1e-5,
            err_msg=name,
        )


class HandWorkedTest(parameterized.TestCase):
    """Sequences of one token each, so S = A = the token's log-prob."""

    @parameterized.named_parameters(
        # Delta = 0: -log sigmoid(0) = log 2.
        ("dpo_sigmoid_at_0", "sigmoid", -1.0, -1.0, dict(beta=0.1), np.log(2)),
        # Delta = 2, beta = 0.5: -log sigmoid(1) = log(1 + e^-1).
        ("dpo_sigmoid", "sigmoid", -1.0, -3.0, dict(beta=0.5), np.log1p(np.exp(-1))),
        # max(0, 1 - 0.25 * 2) = 0.5.
        ("dpo_hinge", "hinge", -1.0, -3.0, dict(beta=0.25), 0.5),
        # (Delta - 1 / (2 beta))^2 = (2 - 5)^2 = 9.
        ("ipo", "ipo", -1.0, -3.0, dict(beta=0.1), 9.0),
        # beta (A_c - A_r) - gamma = 0 - 0.5: log(1 + e^0.5).
        ("simpo", "simpo", -2.0, -2.0, dict(gamma=0.5), np.log1p(np.exp(0.5))),
        # odds(1/2) = 1, odds(1/4) = 1/3: -0.1 log sigmoid(log 3) = 0.1 log(4/3),
        # plus the NLL -log(1/2).
        (
            "orpo",
            "orpo",
            np.log(0.5),
            np.log(0.25),
            dict(beta=0.1),
            0.1 * np.log(4 / 3) + np.log(2),
        ),
        # -log sigmoid(1 * (log 1/2 - log 1/4)) = log(1 + 1/2), plus 0.5 log 2.
        (
            "cpo",
            "cpo",
            np.log(0.5),
            np.log(0.25),
            dict(beta=1.0, alpha=0.5),
            np.log(1.5) + 0.5 * np.log(2),
        ),
        # Delta = log 3, sigmoid(log 3) = 3/4: (-0.9 log 3/4 + 0.1 log 1/4) / 0.8.
        (
            "robust",
            "robust",
            -1.0,
            -1.0 - np.log(3.0),
            dict(beta=1.0, label_smoothing=0.1),
            (0.9 * np.log(4 / 3) - 0.1 * np.log(4)) / 0.8,
        ),
        # At Delta = 0 the robust loss is log 2 whatever eps.
        ("robust_at_0", "robust", -1.0, -1.0, dict(label_smoothing=0.3), np.log(2)),
        # SimPO with CPO's NLL: log(1 + e^0.5) plus 0.5 * 2.
        (
            "simpo_nll",
            "simpo",
            -2.0,
            -2.0,
            dict(gamma=0.5, alpha=0.5, compute_nll_loss=True),
            np.log1p(np.exp(0.5)) + 1.0,
        ),
    )
    def test_case(self, loss_type, chosen, rejected, options, expected):
        one = jnp.ones((1, 1))
        loss, metrics = preference.preference_loss(
            jnp.full((1, 1), chosen),
            jnp.full((1, 1), rejected),
            one,
            one,
            loss_type=loss_type,
            **options,
        )
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        self.assertEqual(float(metrics["reward_accuracy"]), float(chosen > rejected))

    def test_dpo_rewards_subtract_the_reference(self):
        """beta = 0.5, S_c = -1 (ref -2), S_r = -3 (ref -1): rewards 0.5 and
        -1, margin 1.5, accuracy 1."""
        one = jnp.ones((1, 1))
        _, m = preference.preference_loss(
            jnp.full((1, 1), -1.0),
            jnp.full((1, 1), -3.0),
            one,
            one,
            beta=0.5,
            ref_chosen_logps=jnp.full((1, 1), -2.0),
            ref_rejected_logps=jnp.full((1, 1), -1.0),
        )
        for name, value in dict(
            chosen_rewards=0.5,
            rejected_rewards=-1.0,
            reward_margin=1.5,
            reward_accuracy=1.0,
        ).items():
            np.testing.assert_allclose(m[name], value, rtol=1e-6, err_msg=name)

    @parameterized.named_parameters(
        # Chosen (-1, -3), rejected (-4): sums Delta = 0, loss
        # log(1 + e^0) = log 2 plus the NLL 2; means Delta = 2, loss
        # log(1 + e^-0.2), plus 2.
        ("cpo_sums", "cpo", None, np.log(2) + 2.0),
        ("cpo_means", "cpo", True, np.log1p(np.exp(-0.2)) + 2.0),
        # IPO, beta = 0.1: means (TRL's) (2 - 5)^2, sums (0 - 5)^2.
        ("ipo_means", "ipo", None, 9.0),
        ("ipo_sums", "ipo", False, 25.0),
    )
    def test_sums_or_means(self, loss_type, average_log_prob, expected):
        loss, _ = preference.preference_loss(
            jnp.array([[-1.0, -3.0]]),
            jnp.array([[-4.0, 0.0]]),
            jnp.ones((1, 2)),
            jnp.array([[1.0, 0.0]]),
            loss_type=loss_type,
            beta=0.1,
            average_log_prob=average_log_prob,
        )
        np.testing.assert_allclose(loss, expected, rtol=1e-6)

    def test_masked_tokens_are_left_out_of_sums_and_means(self):
        """SimPO, beta = 1, gamma = 0: chosen (-1, masked -100) has A = -1,
        rejected (-2, -4) has A = -3; -log sigmoid(2) = log(1 + e^-2)."""
        loss, _ = preference.preference_loss(
            jnp.array([[-1.0, -100.0]]),
            jnp.array([[-2.0, -4.0]]),
            jnp.array([[1.0, 0.0]]),
            jnp.ones((1, 2)),
            loss_type="simpo",
            beta=1.0,
            gamma=0.0,
        )
        np.testing.assert_allclose(loss, np.log1p(np.exp(-2)), rtol=1e-6)


# Options that depart from a reference's default, each on a loss that has
# it: (loss_type, preference_loss keywords, np_preference_loss conventions).
DEPARTURES = [
    ("cpo", dict(average_log_prob=True), dict(average=True)),  # means
    ("cpo", dict(compute_nll_loss=False), dict(nll=False)),
    ("simpo", dict(compute_nll_loss=True), dict(nll=True)),  # CPO-SimPO
    ("orpo", dict(compute_nll_loss=False), dict(nll=False)),
    ("ipo", dict(average_log_prob=False), dict(average=False)),  # sums
    ("sigmoid", dict(average_log_prob=True), dict(average=True)),
    ("robust", dict(compute_nll_loss=True), dict(nll=True)),
]


class FormulaTest(parameterized.TestCase):
    """The plain loss on random log-probs: value and gradients w.r.t. the
    policy's log-probs equal the float64 formula's and its central
    differences; the reference's log-probs get none."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(
        *[(loss_type, {}, {}) for loss_type in preference.LOSS_TYPES], *DEPARTURES
    )
    def test_value_and_gradients_match_float64(self, loss_type, options, conventions):
        x = make_inputs(seed=3)
        rng = np.random.default_rng(3)
        logps = [-rng.exponential(size=(B, t)) for t in (T_C, T_R)]
        ref = [-rng.exponential(size=(B, t)) for t in (T_C, T_R)]
        masks = x["mask_c"], x["mask_r"]

        def loss(lc, lr, ref_c, ref_r):
            return preference.preference_loss(
                lc,
                lr,
                *masks,
                loss_type=loss_type,
                beta=BETA,
                gamma=GAMMA,
                alpha=ALPHA,
                label_smoothing=SMOOTHING,
                ref_chosen_logps=ref_c,
                ref_rejected_logps=ref_r,
                **options,
            )

        step = self.variant(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))
        (value, metrics), grads = step(*(jnp.asarray(a) for a in logps + ref))

        def reference(lc, lr):
            return np_preference_loss(lc, lr, *masks, loss_type, *ref, **conventions)

        np.testing.assert_allclose(value, reference(*logps), rtol=1e-5)
        for i, want in enumerate(
            (
                refs.numeric_grad(lambda v: reference(v, logps[1]), logps[0]),
                refs.numeric_grad(lambda v: reference(logps[0], v), logps[1]),
            )
        ):
            np.testing.assert_allclose(grads[i], want, rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(grads[2], 0.0)
        np.testing.assert_array_equal(grads[3], 0.0)
        self.assertEqual(
            "nll" in metrics,
            conventions.get("nll", loss_type in REFERENCE_NLL),
        )


class FusedTest(parameterized.TestCase):
    # Compiled only: the sweep runs its scans and custom VJP compiled either
    # way, and the plain JAX around it is stricter under jit than op by op.
    @chex.variants(with_jit=True)
    @parameterized.parameters(
        *[(loss_type, "head", {}, {}) for loss_type in preference.LOSS_TYPES],
        *[(loss_type, "logps", {}, {}) for loss_type in preference.WITH_REFERENCE],
        *[(loss_type, "head", *options) for loss_type, *options in DEPARTURES],
    )
    def test_value_and_gradients_match_float64(
        self, loss_type, reference, options, conventions
    ):
        """Value and d/d(h_chosen, h_rejected, w, bias) equal the numpy
        formula's and its central differences; the reference gets none."""
        x = make_inputs()
        ref_c, ref_r = reference_logps(x)
        kwargs = dict(
            loss_type=loss_type,
            beta=BETA,
            gamma=GAMMA,
            alpha=ALPHA,
            label_smoothing=SMOOTHING,
            chunk_size=4,
            **OPTIONS,
            **options,
        )

        def fused(h_c, h_r, w, bias, h_rc, w_ref):
            if reference == "head":
                kwargs["reference_head"] = (h_rc, x["h_rr"], w_ref)
            else:
                kwargs["reference_logps"] = (ref_c, ref_r)
            return fused_loss(x, h_c, h_r, w, bias=bias, **kwargs)[0]

        names = ("h_c", "h_r", "w", "bias", "h_rc", "w_ref")
        args = [jnp.asarray(x[n], jnp.float32) for n in names]
        value, grads = self.variant(jax.value_and_grad(fused, tuple(range(6))))(*args)
        assert_matches_float64(x, loss_type, value, grads, names[:4], **conventions)
        # The frozen reference: exactly no gradient.
        np.testing.assert_array_equal(grads[4], 0.0)
        np.testing.assert_array_equal(grads[5], 0.0)


class PairSegmentsTest(parameterized.TestCase):
    """The margin losses without the NLL term (the DPO family, SimPO, CPO
    with ``compute_nll_loss=False``) take their gradient in the forward
    sweep, a pair being a segment of the sweep (``Plan.segment_length``):
    IPO on means, the others on sums. 3 pairs of
    9 tokens, in chunks of 4 inside a pair (each pair's gradient scaled once
    it is done; its last chunk clamped to its end) or of 18, two whole pairs
    (the last chunk clamped to the tokens' end, overlapping a pair)."""

    @chex.variants(with_jit=True)
    # Each loss with both chunkings and both accumulations of dw, each pair
    # of chunking and accumulation twice.
    @parameterized.parameters(
        (loss_type, chunk_size, ("float32", "kahan")[(i + j) % 2])
        for i, loss_type in enumerate(preference.MARGIN_LOSSES)
        for j, chunk_size in enumerate((4, 20))
    )
    def test_gradients_match_float64(self, loss_type, chunk_size, dw_accumulation):
        x = make_inputs(seed=1, pairs=3)
        ref_c, ref_r = reference_logps(x)

        def fused(h_c, h_r, w, bias):
            return fused_loss(
                x,
                h_c,
                h_r,
                w,
                bias=bias,
                reference_logps=(ref_c, ref_r),
                loss_type=loss_type,
                beta=BETA,
                gamma=GAMMA,
                label_smoothing=SMOOTHING,
                compute_nll_loss=False,
                chunk_size=chunk_size,
                dw_accumulation=dw_accumulation,
                **OPTIONS,
            )

        names = ("h_c", "h_r", "w", "bias")
        args = [jnp.asarray(x[n], jnp.float32) for n in names]
        step = jax.value_and_grad(fused, (0, 1, 2, 3), has_aux=True)
        (value, metrics), grads = self.variant(step)(*args)
        assert_matches_float64(x, loss_type, value, grads, names, nll=False)
        np.testing.assert_allclose(metrics["preference_loss"], value, rtol=1e-5)

    def test_a_metric_differentiated_takes_the_recompute_sweep(self):
        """d(reward margin)/dw: a cotangent on the log-probs themselves,
        against the float64 margin's central differences (DPO, no reference:
        margin = beta (S_c - S_r) averaged over pairs)."""
        x = make_inputs(seed=2, pairs=3)

        def margin(w):
            _, metrics = fused_loss(
                x,
                *(jnp.asarray(x[n], jnp.float32) for n in ("h_c", "h_r")),
                w,
                beta=BETA,
                chunk_size=4,
                **OPTIONS,
            )
            return metrics["reward_margin"]

        def reference(w):
            lc, *_ = refs.token_logprobs(x["h_c"], w, None, x["ids_c"], **OPTIONS)
            lr, *_ = refs.token_logprobs(x["h_r"], w, None, x["ids_r"], **OPTIONS)
            sums = np.sum(x["mask_c"] * lc, -1) - np.sum(x["mask_r"] * lr, -1)
            return BETA * sums.mean()

        grad = jax.jit(jax.grad(margin))(jnp.asarray(x["w"], jnp.float32))
        np.testing.assert_allclose(
            grad, refs.numeric_grad(reference, x["w"]), rtol=1e-4, atol=1e-5
        )


def loss(**overrides):
    one = np.ones((2, 3))
    args = dict(chosen_logps=-one, rejected_logps=-one, chosen_mask=one)
    return preference.preference_loss(**(args | dict(rejected_mask=one) | overrides))


def fused(**overrides):
    x = make_inputs()
    args = dict(h_chosen=x["h_c"], h_rejected=x["h_r"], w=x["w"])
    args |= dict(chosen_ids=x["ids_c"], rejected_ids=x["ids_r"])
    args |= dict(chosen_mask=x["mask_c"], rejected_mask=x["mask_r"])
    return preference.fused_preference_loss(**(args | overrides))


LOSS = [
    ("batch sizes differ", dict(rejected_logps=-np.ones((3, 3))), ValueError,
     ("chosen_logps", "rejected_logps")),
    ("mask with no tokens", dict(chosen_mask=np.array([[1.0] * 3, [0.0] * 3])),
     ValueError),
    ("mask shape", dict(rejected_mask=np.ones((2, 2))), ValueError),
    ("unknown loss_type", dict(loss_type="apo_zero"), ValueError),
    ("beta 0", dict(beta=0.0), ValueError),
    ("smoothing above half", dict(label_smoothing=0.6), ValueError),
    ("robust smoothing half", dict(loss_type="robust", label_smoothing=0.5),
     ValueError, "label_smoothing"),
    ("average_log_prob not bool", dict(average_log_prob="yes"), TypeError),
    ("compute_nll_loss not bool", dict(compute_nll_loss=1), TypeError),
    ("logps rank", dict(chosen_logps=-np.ones(2)), ValueError),
    ("ref shape", dict(ref_chosen_logps=np.ones((2, 2))), ValueError),
]  # fmt: skip
FUSED = [
    ("ids shape", dict(chosen_ids=np.zeros((B, 2), np.int32)), ValueError),
    ("both references",
     dict(reference_logps=(np.zeros((B, T_C)), np.zeros((B, T_R))),
          reference_head=(np.zeros((B, T_C, D)), np.zeros((B, T_R, D)),
                          np.zeros((V, D)))),
     ValueError),
    ("reference_head length",
     dict(reference_head=(np.zeros((B, T_C, D)), np.zeros((V, D)))), ValueError),
    ("robust smoothing half", dict(loss_type="robust", label_smoothing=0.5),
     ValueError, "label_smoothing"),
    ("batch sizes differ",
     dict(h_rejected=np.zeros((3, T_R, D)), rejected_ids=np.zeros((3, T_R), np.int32),
          rejected_mask=np.ones((3, T_R))),
     ValueError, ("chosen_logps", "rejected_logps")),
]  # fmt: skip
BAD_INPUTS = [*keyword_rows("loss", loss, LOSS), *keyword_rows("fused", fused, FUSED)]
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


class IgnoredIdsTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("sigmoid", "orpo", "cpo")
    def test_an_id_of_minus_100_is_a_masked_token(self, loss_type):
        """Ids of -100 (the tokens masked out by hand: the chosen prompt,
        the rejected padding) give the loss and gradients of the masks that
        leave them out, whichever sweep the loss takes; the mask there is
        ignored, and a custom ``ignore_index`` works alike."""
        x = make_inputs()
        ignored = dict(x)
        for ids, mask in (("ids_c", "mask_c"), ("ids_r", "mask_r")):
            ignored[ids] = np.where(x[mask] == 0, -100, x[ids]).astype(np.int32)
            ignored[mask] = np.where(x[mask] == 0, 1.0, x[mask])
        custom = dict(ignored)
        for ids in ("ids_c", "ids_r"):
            custom[ids] = np.where(ignored[ids] == -100, V, ignored[ids])
        ref = reference_logps(x)
        options = dict(
            loss_type=loss_type, beta=BETA, chunk_size=4, reference_logps=ref
        )

        def loss(inputs, **extra):
            def value(h_c, h_r, w):
                return fused_loss(inputs, h_c, h_r, w, **options, **extra)[0]

            args = [jnp.asarray(x[n], jnp.float32) for n in ("h_c", "h_r", "w")]
            return self.variant(jax.value_and_grad(value, (0, 1, 2)))(*args)

        expected = loss(x)
        for found in (loss(ignored), loss(custom, ignore_index=V)):
            chex.assert_trees_all_close(found, expected, rtol=1e-6, atol=1e-7)
