"""Tests for lmhead/decoding/text.py (detokenize)."""

import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import data
from tests.errors import assert_raises_with, bad_input_test


class Letters:
    def decode(self, ids):
        return "".join("abcdefgh"[i] for i in ids)


def test_detokenize_cuts_at_the_first_of_several_eos_ids():
    ids = [[0, 1, 3, 2], [2, 2, 0, 1]]
    for eos_id in ((2, 3), [3, 2], {2, 3}, np.array([3, 2])):
        assert decoding.detokenize(ids, Letters(), eos_id=eos_id) == ["ab", ""]


def test_detokenize_cuts_at_eos_and_drops_padding():
    ids = np.array([[0, 1, 7, 2], [3, 3, 3, 3], [7, 0, 0, 0]])
    assert decoding.detokenize(ids, Letters(), eos_id=7) == ["ab", "dddd", ""]
    assert decoding.detokenize(ids[1], Letters(), pad_id=3) == ""
    assert decoding.detokenize(ids[None], Letters(), eos_id=7) == [["ab", "dddd", ""]]
    assert decoding.detokenize(ids[0], Letters()) == "abhc"


def test_detokenize_with_the_project_and_library_tokenizers():
    import tokenizers
    from tokenizers import models

    char = data.CharTokenizer.train("to be or not")
    ids = char.encode("to be")
    assert decoding.detokenize(jnp.array(ids), char) == "to be"
    words = tokenizers.Tokenizer(
        models.WordLevel({"to": 0, "be": 1, "<eos>": 2}, unk_token="<eos>")
    )
    assert decoding.detokenize([[0, 1, 2, 0]], words, eos_id=2) == ["to be"]


def reference_trim(text, stops):
    """The shortest prefix that ends with a stop string, less the longest such
    string; the whole text when none occurs."""
    for end in range(len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - max(map(len, ending))]
    return text


@pytest.mark.parametrize("seed", range(4))
def test_trim_at_stop_against_a_brute_force_reference(seed):
    rng = np.random.default_rng(seed)
    stops = ["ab", "b", "bca", "\n\n", "é:"]
    for _ in range(200):
        text = "".join(rng.choice(list("abcé:\n"), size=rng.integers(0, 12)))
        chosen = list(rng.choice(stops, size=rng.integers(1, 4), replace=False))
        expected = reference_trim(text, chosen)
        assert decoding.trim_at_stop(text, chosen) == expected, (text, chosen)
        assert decoding.trim_at_stop(text, chosen[::-1]) == expected
        found = decoding.find_stop(text, chosen)
        assert (found is None) == (not any(s in text for s in chosen))


def test_trim_at_stop_follows_the_stop_the_loop_meets_first():
    # "b" ends before "abc" does, so the loop stops there and the text is cut
    # before "b"; of two ending together the longer one goes.
    assert decoding.trim_at_stop("xabc", ["abc", "b"]) == "xa"
    assert decoding.trim_at_stop("xabc", ["bc", "abc"]) == "x"
    assert decoding.find_stop("xabc", ["c", "abc"]) == (1, 4)


def test_detokenize_trims_at_a_stop_string():
    ids = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    assert decoding.detokenize(ids, Letters(), stop="c") == ["ab", "d"]
    assert decoding.detokenize(ids, Letters(), stop=["bc", "cb"]) == ["a", "d"]
    assert decoding.detokenize(ids[0], Letters(), stop="z", eos_id=3) == "abc"


# ---------------------------------------------------------------------------
# bad input: the message names the argument and what is allowed
# (BAD_INPUT_MESSAGES, whose fragments are pinned), and each case raises
# exactly the expected type with a message that names the argument
# (BAD_INPUTS, tests/errors.py).

BAD_INPUT_MESSAGES = [
    (
        lambda: decoding.detokenize(3, Letters()),
        ValueError,
        "ids must have shape [..., N]",
    ),
    (
        lambda: decoding.detokenize([1], object()),
        TypeError,
        "tokenizer must have a decode",
    ),
]


@pytest.mark.parametrize("call,error,fragment", BAD_INPUT_MESSAGES)
def test_bad_input_is_named(call, error, fragment):
    assert_raises_with(call, error, fragment)


BAD_INPUTS = [
    (
        "detokenize eos_id not an id",
        lambda: decoding.detokenize([0, 1], Letters(), eos_id=1.0),
        TypeError,
        "eos_id",
    ),
    (
        "trim_at_stop empty string",
        lambda: decoding.trim_at_stop("abc", ["b", ""]),
        ValueError,
        "stop",
    ),
    (
        "trim_at_stop not a string",
        lambda: decoding.trim_at_stop("abc", [3]),
        TypeError,
        "stop",
    ),
    (
        "detokenize empty stop",
        lambda: decoding.detokenize([0, 1], Letters(), stop=""),
        ValueError,
        "stop",
    ),
    (
        "detokenize no decode",
        lambda: decoding.detokenize([[0, 1]], object()),
        TypeError,
        ("tokenizer", "decode"),
    ),
    (
        "detokenize float ids",
        lambda: decoding.detokenize([0.5], Letters()),
        TypeError,
        "ids",
    ),
    (
        "detokenize scalar ids",
        lambda: decoding.detokenize(3, Letters()),
        ValueError,
        "ids",
    ),
]


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
