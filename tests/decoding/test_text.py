"""Tests for lmhead/decoding/text.py (detokenize)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import data
from tests.errors import bad_input_test, keyword_rows


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


def reference_find(text, stops, after):
    """``(start, end)`` of the first stop string to end past ``after``
    characters, the longest of those ending there; None if none does."""
    for end in range(after + 1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end - max(map(len, ending)), end
    return None


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
        after = int(rng.integers(0, len(text) + 1))
        assert decoding.find_stop(text, chosen, after) == reference_find(
            text, chosen, after
        )


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


LETTERS = Letters()


def detokenize(ids=(0, 1), tokenizer=LETTERS, **options):
    return decoding.detokenize(ids, tokenizer, **options)


BAD_INPUTS = keyword_rows(
    "detokenize",
    detokenize,
    [
        ("eos_id not an id", dict(eos_id=1.0), TypeError),
        ("empty stop", dict(stop=""), ValueError),
        ("no decode", dict(tokenizer=object()), TypeError, ("tokenizer", "decode")),
        ("float ids", dict(ids=[0.5]), TypeError),
        ("scalar ids", dict(ids=3), ValueError, ("ids", "[..., N]")),
    ],
) + keyword_rows(
    "trim_at_stop",
    functools.partial(decoding.trim_at_stop, "abc"),
    [
        ("an empty stop string", dict(stop=["b", ""]), ValueError),
        ("a stop string not a str", dict(stop=[3]), TypeError),
    ],
)


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
