"""Tests for lmhead/decoding/stop_strings.py (StopStrings) against a reference
that decodes the text after every step and searches it for the stop strings."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.decoding import stop_strings
from lmhead.decoding.stop_strings import StopStrings, token_bytes_from_decode
from tests.decoding.references import stop_step_on_bytes
from tests.errors import assert_raises_exactly, bad_input_test, keyword_rows

# Tokens chosen so that stop strings split across 2 and 3 tokens, end inside
# a token, and hold a two-byte character split across tokens ("é" = c3 a9).
TOKENS = [b"RO", b"MEO", b":", b"\n", b".\n", b"a", b"\xc3", b"\xa9", b"xy", b" "]


def decode(ids):
    return b"".join(TOKENS[i] for i in ids).decode("utf-8", errors="replace")


def reference_stop_step(ids, stops):
    """The first step t whose text (tokens 0..t decoded) holds a stop string."""
    for t in range(len(ids)):
        text = decode(ids[: t + 1])
        if any(s in text for s in stops):
            return t
    return None


def first_ended(stop, ids, update):
    """Steps at which each row first ends, driving ``update`` by hand."""
    ids = np.asarray(ids)
    batch = ids.shape[0]
    carry = stop.init(batch)
    first = [None] * batch
    for t in range(ids.shape[1]):
        active = jnp.array([f is None for f in first])
        carry, ended = update(stop, carry, jnp.asarray(ids[:, t]), active)
        for b in np.flatnonzero(np.asarray(ended)):
            assert first[b] is None, "an inactive row ended"
            first[b] = t
    return first


def random_rows(seed, batch, steps):
    rng = np.random.default_rng(seed)
    # Weighted towards the tokens the stop strings are made of.
    weights = np.array([3, 3, 3, 3, 1, 1, 2, 2, 1, 1], float)
    return rng.choice(len(TOKENS), size=(batch, steps), p=weights / weights.sum())


class StopStringsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_shared_stop_strings_match_the_text_reference(self):
        stops = ["ROMEO:", "\n\n", "é:", "a"]  # 3, 2 tokens; inside ".\n"
        stop = StopStrings.build(stops, TOKENS)
        update = self.variant(lambda s, c, t, a: s.update(c, t, a))
        ids = random_rows(0, 64, 12)
        ids[0, :4] = [5, 0, 1, 2]  # "a" at once
        ids[1, :4] = [9, 0, 1, 2]  # " ROMEO:" over three tokens
        ids[2, :3] = [6, 7, 2]  # "é:" with é split
        ids[3, :3] = [4, 3, 9]  # ".\n" then "\n"
        expected = [reference_stop_step(row.tolist(), stops) for row in ids]
        assert expected[:4] == [0, 3, 2, 1]
        assert any(e is None for e in expected)  # some rows never stop
        assert first_ended(stop, ids, update) == expected

    @chex.variants(with_jit=True, without_jit=True)
    def test_per_row_stop_strings_match_the_text_reference(self):
        rows = [["ROMEO:"], ["\n\n", "O:"], [], ["xy xy", "é"]]
        update = self.variant(lambda s, c, t, a: s.update(c, t, a))
        ids = random_rows(1, 32, 16)
        stop = StopStrings.build([rows[b % 4] for b in range(32)], TOKENS)
        expected = [
            reference_stop_step(row.tolist(), rows[b % 4]) for b, row in enumerate(ids)
        ]
        assert len({e for e in expected if e is not None}) > 3
        assert first_ended(stop, ids, update) == expected

    def test_repeat_rows_repeats_each_rows_strings(self):
        rows = [["ROMEO:"], ["\n\n"]]
        repeated = StopStrings.build(rows, TOKENS).repeat_rows(3)
        by_hand = StopStrings.build([rows[0]] * 3 + [rows[1]] * 3, TOKENS)
        np.testing.assert_array_equal(repeated.stop_bytes, by_hand.stop_bytes)
        np.testing.assert_array_equal(repeated.stop_len, by_hand.stop_len)
        shared = StopStrings.build(["a"], TOKENS)
        assert shared.repeat_rows(4) is shared

    def test_fixed_budgets_give_one_shape_for_every_request(self):
        small = StopStrings.build(["a"], TOKENS, max_bytes=8, max_strings=4)
        large = StopStrings.build(
            ["RO", "é:", "\n\n"], TOKENS, max_bytes=8, max_strings=4
        )
        shapes = lambda s: [x.shape for x in jax.tree.leaves(s)]
        assert shapes(small) == shapes(large)
        ids = np.array([[0, 6, 7, 2, 5]])
        update = jax.jit(lambda s, c, t, a: s.update(c, t, a))
        assert first_ended(large, ids, update) == [0]
        assert first_ended(small, ids, update) == [4]

    def test_inactive_rows_keep_their_window(self):
        stop = StopStrings.build(["\n\n"], TOKENS)
        carry = stop.init(2)
        carry, _ = stop.update(carry, jnp.array([3, 3]), jnp.array([True, True]))
        # Row 1 is inactive for a step (its token is padding): no bytes enter.
        carry, ended = stop.update(carry, jnp.array([5, 0]), jnp.array([True, False]))
        assert ended.tolist() == [False, False]
        _, ended = stop.update(carry, jnp.array([3, 3]), jnp.array([True, True]))
        assert ended.tolist() == [False, True]

    def test_the_prompt_takes_no_part_in_a_match(self):
        # Only generated bytes are in the window: ":" alone after a prompt
        # "ROMEO" does not end "ROMEO:".
        stop = StopStrings.build(["ROMEO:"], TOKENS)
        assert first_ended(stop, [[2, 2]], lambda s, c, t, a: s.update(c, t, a)) == [
            None
        ]

    def test_a_resumed_row_ends_where_one_loop_ends_it(self):
        """A row's loop cut in two (as ``continue_text``'s windows are): the
        second part, resumed from the first's bytes, ends where one loop
        does; without them a string split by the cut is missed."""
        stops = ["ROMEO:", "\n\n", "é:", "xy xy"]
        update = jax.jit(lambda s, c, t, a: s.update(c, t, a))
        ids = random_rows(3, 48, 12)
        ids[0, :4] = [9, 0, 1, 2]  # " ROMEO:", which the cut at 2 splits
        stop = StopStrings.build(stops, TOKENS)
        whole = first_ended(stop, ids, update)
        assert whole[0] == 3
        for cut in (1, 2, 5, 8):
            head = first_ended(stop, ids[:, :cut], update)
            bytes_so_far = [b"".join(TOKENS[i] for i in row[:cut]) for row in ids]
            tail = first_ended(stop.resumed(bytes_so_far), ids[:, cut:], update)
            joined = [
                h if h is not None else (None if t is None else t + cut)
                for h, t in zip(head, tail)
            ]
            assert joined == whole, cut
        assert first_ended(stop, ids[:1, 2:], update) != [1]  # not resumed

    def test_token_bytes_from_decode(self):
        table = token_bytes_from_decode(lambda ids: "".join("aé☃"[i] for i in ids), 3)
        assert table == [b"a", "é".encode(), "☃".encode()]


@pytest.mark.parametrize("num_samples,min_new_tokens", [(1, 0), (3, 0), (2, 5)])
def test_generate_ends_rows_where_the_decoded_text_first_holds_a_stop_string(
    num_samples, min_new_tokens
):
    """In the loop: each row ends at the token that completes one of its stop
    strings, and keeps the tokens it would have drawn without them; with
    ``min_new_tokens``, at the first such token from that many tokens on
    (vLLM's rule)."""
    rng = np.random.default_rng(2)
    table = jnp.asarray(rng.standard_normal((len(TOKENS),) * 2), jnp.float32)
    markov = lambda table, tokens, state: (table[tokens], state)
    rows = [["ROMEO:", "\n\n"], ["a"], ["é:", "é"], ["xy xy", ".\n"]] * 2
    logits = table[jnp.arange(len(rows)) % len(TOKENS)]
    run = lambda **stop: decoding.generate(
        markov, table, logits, (), key=jax.random.key(0), max_new_tokens=24,
        temperature=1.0, num_samples=num_samples, min_new_tokens=min_new_tokens,
        **stop,
    )  # fmt: skip
    plain = run()
    out = run(stop=StopStrings.build(rows, TOKENS))
    ends = []
    for b in range(len(rows) * num_samples):
        ids = np.asarray(plain.tokens[b]).tolist()
        stops = rows[b // num_samples]
        end = stop_step_on_bytes(ids, stops, TOKENS, min_new_tokens)
        if min_new_tokens == 0:
            assert end == reference_stop_step(ids, stops)
        ends.append(end)
        length = 24 if end is None else end + 1
        assert int(out.lengths[b]) == length
        np.testing.assert_array_equal(out.tokens[b, :length], plain.tokens[b, :length])
        reason = decoding.FINISHED_LENGTH if end is None else decoding.FINISHED_STOP
        assert int(out.finish_reasons[b]) == reason
    assert len({e for e in ends if e is not None}) > 2, ends
    if min_new_tokens:  # the rule held some row back
        early = [stop_step_on_bytes(np.asarray(plain.tokens[b]).tolist(),
                                    rows[b // num_samples], TOKENS) for b in range(len(ends))]  # fmt: skip
        assert any(e is not None and e < min_new_tokens - 1 for e in early), early


SPAN_CASES = {
    "no string": [[]] * 4,
    "short": [["\n\n"], ["é:"], [], ["ROMEO:", "xy xy"]],
    "17 bytes": [["ROMEO:ROMEO:ROMEO"], ["é:"], [], ["\n\n"]],
    "66 bytes": [["ROMEO:" * 11], ["é:"], [], ["xy xy", "a"]],
}


@pytest.mark.parametrize("case", SPAN_CASES)
def test_a_wide_table_compares_the_span_its_longest_string_needs(case):
    """A table of 300-byte capacity (the slots'), whose step compares the
    last 16, 64, 256 or 300 bytes: every span ends rows as the reference."""
    assert stop_strings._spans(300) == [16, 64, 256, 300]
    rows = SPAN_CASES[case] * 2
    ids = random_rows(4, len(rows), 40)
    ids[0, :37] = [0, 1, 2] * 12 + [3]  # "ROMEO:" 12 times
    ids[1, 5:8], ids[3, 10:14] = [6, 7, 2], [9, 0, 1, 2]  # "é:", " ROMEO:"
    stop = StopStrings.build(rows, TOKENS, max_bytes=300, max_strings=2)
    update = jax.jit(lambda s, c, t, a: s.update(c, t, a))
    expected = [reference_stop_step(row.tolist(), rows[b]) for b, row in enumerate(ids)]
    assert first_ended(stop, ids, update) == expected
    assert (case == "no string") == all(e is None for e in expected)
    assert (expected[0] is not None) == (case in ("17 bytes", "66 bytes"))


def test_a_table_of_fixed_capacity_may_hold_no_string_and_refuses_more():
    stop_bytes, stop_len = decoding.encode_stop_strings(
        [[], ["ab"]], max_bytes=4, max_strings=2
    )
    assert stop_bytes.shape == (2, 2, 4) and stop_len.tolist() == [[0, 0], [2, 0]]
    empty = StopStrings.build([[]] * 3, TOKENS, max_bytes=4, max_strings=2)
    ids = random_rows(5, 3, 10)
    assert first_ended(empty, ids, lambda s, c, t, a: s.update(c, t, a)) == [None] * 3
    for stop, named in (([["abcde"]], "max_bytes"), ([["a", "b", "c"]], "max_strings")):
        assert_raises_exactly(
            lambda: decoding.encode_stop_strings(stop, max_bytes=4, max_strings=2),
            ValueError, named,
        )  # fmt: skip


def test_check_names_stop():
    stop = StopStrings.build([["a"], ["b"]], TOKENS)
    stop.check(2, len(TOKENS))
    StopStrings.build(["a"], TOKENS).check(5, len(TOKENS))
    assert_raises_exactly(lambda: stop.check(3, len(TOKENS)), ValueError, "stop")
    assert_raises_exactly(lambda: stop.check(2, 99), ValueError, "stop")


def build(stop, token_bytes=TOKENS, **budgets):
    return StopStrings.build(stop, token_bytes, **budgets)


BAD_INPUTS = keyword_rows(
    "StopStrings.build",
    build,
    [
        ("empty string", dict(stop=["a", ""]), ValueError),
        ("no string", dict(stop=[]), ValueError),
        ("no string per row", dict(stop=[[], []]), ValueError),
        ("too long", dict(stop=["abcdef"], max_bytes=4), ValueError),
        ("too long by default", dict(stop=["x" * 300]), ValueError, "stop"),
        ("a character over", dict(stop=["éé"], max_bytes=3), ValueError, "max_bytes"),
        ("too many", dict(stop=["a", "b"], max_strings=1), ValueError, "max_strings"),
        ("bytes", dict(stop=[b"a"]), TypeError),
        ("not a list", dict(stop=3), TypeError),
        ("mixed", dict(stop=["a", ["b"]]), TypeError),
        ("table of str", dict(stop=["a"], token_bytes=["a"]), TypeError, "token_bytes"),
        ("empty table", dict(stop=["a"], token_bytes=[]), TypeError, "token_bytes"),
    ],
)


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
