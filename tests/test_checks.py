"""Tests for lmhead/_checks.py: the argument checks every public function uses.

Each check is tested on its own rule (what passes, what is refused, with
which exception and message); the modules' tests check that they call them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import _checks
from tests.errors import assert_raises_exactly


@pytest.mark.parametrize("value", [1, 7, np.int32(3), np.int64(10**12)])
def test_count_accepts_integers_from_one(value):
    _checks.check_count("n", value)


@pytest.mark.parametrize(
    "value,error",
    [
        (0, ValueError),
        (-2, ValueError),
        (np.int32(0), ValueError),
        (2.0, TypeError),
        (True, TypeError),
        (np.bool_(True), TypeError),
        ("3", TypeError),
        (np.array(3), TypeError),
        (None, TypeError),
    ],
)
def test_count_refuses_what_is_not_a_count(value, error):
    assert_raises_exactly(
        lambda: _checks.check_count("num_beams", value),
        error,
        "num_beams must be an integer >= 1; got",
    )


def test_optional_count_takes_none_and_says_so():
    _checks.check_count("chunk_size", None, optional=True)
    assert_raises_exactly(
        lambda: _checks.check_count("chunk_size", 0, optional=True),
        ValueError,
        "chunk_size must be an integer >= 1 or None; got 0.",
    )


@pytest.mark.parametrize(
    "value,bounds,ok",
    [
        (0.0, dict(low=0.0), True),
        (0.0, dict(low=0.0, low_open=True), False),
        (1.0, dict(high=1.0), True),
        (1.0, dict(high=1.0, high_open=True), False),
        ([0.2, 0.5], dict(low=0.0, high=1.0), True),
        ([0.2, 1.5], dict(low=0.0, high=1.0), False),
        (None, dict(low=0.0), True),
    ],
)
def test_in_range_against_the_interval(value, bounds, ok):
    call = lambda: _checks.check_in_range("top_p", value, **bounds)
    if ok:
        call()
    else:
        with pytest.raises(ValueError, match=r"top_p must be in [\[(]"):
            call()


def test_in_range_names_the_first_bad_element_and_the_interval():
    assert_raises_exactly(
        lambda: _checks.check_in_range(
            "min_p", [0.5, -1.0, 2.0], low=0.0, high=1.0, high_open=True
        ),
        ValueError,
        "min_p must be in [0, 1); got -1.0.",
    )


def test_in_range_skips_traced_values():
    """Inside jit a value's range is unknown; the caller documents the rule."""
    checked = jax.jit(lambda x: (_checks.check_in_range("x", x, low=0.0), x)[1])
    np.testing.assert_array_equal(checked(jnp.float32(-1.0)), -1.0)


def test_choice_lists_what_is_allowed():
    _checks.check_choice("smoothing", "uniform", ("uniform", "normalized"))
    assert_raises_exactly(
        lambda: _checks.check_choice("smoothing", "pytorch", ("uniform", "normalized")),
        ValueError,
        "smoothing must be one of 'uniform', 'normalized'; got 'pytorch'.",
    )


def test_dtype_and_rank_checks():
    _checks.check_floating("h", np.zeros(2, np.float16))
    _checks.check_integer("labels", np.zeros(2, np.int8))
    assert_raises_exactly(
        lambda: _checks.check_floating("h", np.zeros(2, np.int32)),
        TypeError,
        "h must have a floating-point dtype",
    )
    assert_raises_exactly(
        lambda: _checks.check_integer("labels", np.zeros(2, np.float32)),
        TypeError,
        "labels must have an integer dtype",
    )
    _checks.check_rank("w", np.zeros((2, 3)), 2, "[V, D]")
    assert_raises_exactly(
        lambda: _checks.check_rank("w", np.zeros(3), {2, 3}, "[V, D]"),
        ValueError,
        "w must have shape [V, D]; got shape (3,).",
    )


def test_logits_need_a_vocabulary_axis():
    _checks.check_logits(np.zeros((2, 1), np.float32))
    assert_raises_exactly(
        lambda: _checks.check_logits(np.zeros((2, 0), np.float32)),
        ValueError,
        "logits must have shape [..., V] with V >= 1",
    )
    assert_raises_exactly(
        lambda: _checks.as_logits(np.zeros(3, np.float32), "[B, V]"),
        ValueError,
        "logits must have shape [B, V]",
    )
    assert _checks.as_logits(np.zeros((1, 2), np.float16)).dtype == jnp.float32


def test_ids_in_range_only_where_weighted():
    ids, weights = np.array([0, 5, -1]), np.array([1.0, 0.0, 0.0])
    _checks.check_ids_in_range("labels", ids, weights, vocab_size=5)
    assert_raises_exactly(
        lambda: _checks.check_ids_in_range("labels", ids, None, vocab_size=5),
        ValueError,
        "labels must be in [0, 5) wherever weights are nonzero; got 5.",
    )


def test_concrete_refuses_a_traced_number():
    _checks.check_concrete("the fused loss", z_loss=1e-4)
    with pytest.raises(TypeError, match="z_loss must be a concrete number"):
        jax.jit(lambda z: _checks.check_concrete("the fused loss", z_loss=z))(1e-4)
