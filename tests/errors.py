"""Checks of bad input shared by the test files: an error of exactly the
expected type, whose message names the argument or config key.

The wording around the name is free to improve, so it is not pinned; where
the message must say more -- the allowed choices, the closest key to a
misspelled one -- the test names those words too.
"""

import re

import pytest


def names(message: str, name: str) -> bool:
    """True when ``message`` contains ``name`` as a whole word."""
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message) is not None


def assert_raises_exactly(call, error, named) -> None:
    """``call()`` raises exactly ``error`` (not a subclass, not an error from
    deeper down) with a message that names ``named`` (a name or a tuple of
    names), whatever its wording."""
    with pytest.raises(Exception) as raised:
        call()
    assert type(raised.value) is error, repr(raised.value)
    for name in (named,) if isinstance(named, str) else named:
        assert names(str(raised.value), name), (name, str(raised.value))


def assert_raises_with(call, error, fragment: str) -> None:
    """``call()`` raises ``error`` (or a subclass) whose message contains
    ``fragment`` verbatim: for messages whose wording is the contract."""
    with pytest.raises(error) as raised:
        call()
    assert fragment in str(raised.value), (fragment, str(raised.value))
