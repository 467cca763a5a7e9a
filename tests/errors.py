"""Checks of bad input shared by the test files: an error of exactly the
expected type, whose message names the argument or config key.

The wording around the name is free to improve, so it is not pinned; where
the message must say more -- the allowed choices, the closest key to a
misspelled one -- the test names those words too.
"""

import functools
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


def cases(table) -> list:
    """pytest parameters of a table whose rows are ``(id, *arguments)``."""
    return [pytest.param(*row[1:], id=row[0]) for row in table]


def keyword_rows(prefix: str, fn, rows) -> list:
    """Rows ``(id, kwargs, error[, named])`` of calls ``fn(**kwargs)`` as rows
    of :func:`bad_input_test`, each id after ``prefix``: a table of one
    function's bad arguments, written as the arguments alone. Without
    ``named`` the message must name the keywords given."""
    return [
        (f"{prefix} {id_}", functools.partial(fn, **kw), error, *(named or [tuple(kw)]))
        for id_, kw, error, *named in rows
    ]


def bad_input_test(table):
    """The test of a table of bad inputs, rows ``(id, call, error, named)``:
    each ``call()`` raises exactly ``error`` naming ``named``.

    A test module binds it to a ``test_`` name, e.g.
    ``test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)``.
    """

    @pytest.mark.parametrize("call,error,named", cases(table))
    def test(call, error, named):
        assert_raises_exactly(call, error, named)

    return test


def rules_test(table, rtol: float = 1e-6):
    """The test of a table of documented rules for values that cannot be
    checked under jit, rows ``(id, fn, args, expected)``: ``fn(*args)``,
    eager and compiled, has no NaN and equals ``expected``."""
    import jax
    import numpy as np

    @pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
    @pytest.mark.parametrize("fn,args,expected", cases(table))
    def test(fn, args, expected, jit):
        got = np.asarray((jax.jit(fn) if jit else fn)(*args))
        assert not np.any(np.isnan(got)), got
        np.testing.assert_allclose(got, expected, rtol=rtol)

    return test
