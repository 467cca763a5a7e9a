"""Structured output for the experiment's tokenizers: JSON Schema, any JSON
object, a regex, a choice among strings and a context-free grammar, compiled
by llguidance into automata over the run's vocabulary.

:class:`Constraint` names what a text must be (its kind and text, the key of
the compiled cache); :class:`GrammarMasker` is the head library's
:class:`~lmhead.decoding.constraint.TokenMasker` for one tokenizer: it compiles
a constraint once (validated against the vocabulary, kept by its text), gives
each constrained row an automaton of its own (:meth:`GrammarMasker.start`),
and fills the rows' token bitmasks each step. The vocabulary's bytes are
``data.token_bytes``'s, the end-of-text token a special token that a mask
allows only where the grammar accepts (a vocabulary without one gets a
virtual end-of-text past ``V``, so that a row ends where its grammar can take
nothing more). JSON is compact (no whitespace between items): a small model
that may put whitespace anywhere tends to put it everywhere. Why llguidance,
and its cost: ``docs/decoding.md``.
"""

import collections
import dataclasses
import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.numpy as llguidance_numpy
import numpy as np

from lmhead import decoding
from lmhead.decoding.constraint import UNCONSTRAINED, mask_width
from lmhead.lm import data

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# llguidance's JSON options: no free whitespace (see the module's docstring).
JSON_OPTIONS = {"whitespace_flexible": False}
# Compiled constraints kept per masker, the least recently used dropped first.
CACHE_SIZE = 256
# A special token's bytes start with this byte in llguidance's vocabulary.
SPECIAL_PREFIX = b"\xff"


class ConstraintError(ValueError):
    """A constraint that does not compile: ``kind`` names it, the message
    says why (llguidance's words for a grammar it refuses)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a generated text must be.

    Attributes:
        kind: one of :data:`KINDS`.
        text: the JSON Schema as JSON text (``json_schema``), empty
            (``json_object``), the regex (``regex``, matched whole), the
            choices as a JSON list of strings (``choice``), or a Lark or
            GBNF grammar (``grammar``, llguidance's dialects).

    Examples:
        >>> Constraint.choice(["yes", "no"]).text
        '["yes", "no"]'
    """

    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(
                "kind", f"a constraint's kind is one of {', '.join(KINDS)}; "
                f"got {self.kind!r}."
            )  # fmt: skip
        if not isinstance(self.text, str):
            raise ConstraintError(self.kind, f"{self.kind} must be given as text.")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        """A JSON Schema, as a dict or its JSON text."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's ``json_object``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """A regex the whole text matches (Rust's ``regex`` syntax)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "Constraint":
        """One of ``choices``, non-empty strings."""
        choices = list(choices)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ConstraintError(
                "choice", "choice must be a non-empty list of strings."
            )
        return cls("choice", json.dumps(choices))

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        """A context-free grammar in Lark or GBNF syntax."""
        return cls("grammar", text)


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar of ``constraint`` (not yet checked against a
    vocabulary).

    Raises:
        ConstraintError: the text is not JSON where it must be, or the
            grammar cannot be read.
    """
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError(kind, "a JSON Schema is an object or a boolean.")
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=JSON_OPTIONS
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.grammar_from("choice", text)
        return llguidance.grammar_from("grammar", text)
    except ConstraintError:
        raise
    except (ValueError, TypeError) as error:  # bad JSON, a GBNF it cannot read
        raise ConstraintError(kind, f"{kind}: {error}") from None


class _Vocabulary:
    """What llguidance asks of a tokenizer (its ``TokenizerWrapper``
    protocol): each token's bytes, the end-of-text id, and encoding."""

    bos_token_id = None

    def __init__(self, tokenizer: Any):
        tokens = list(data.token_bytes(tokenizer))
        eos = getattr(tokenizer, "eos_id", None)
        if eos is None:  # a virtual end-of-text past V
            eos = len(tokens)
            tokens.append(SPECIAL_PREFIX + b"<|end|>")
        else:
            tokens[eos] = SPECIAL_PREFIX + tokens[eos]
        self.tokens, self.eos_token_id = tokens, eos
        self.special_token_ids = [eos]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        try:
            return list(self._tokenizer.encode(text))
        except ValueError:  # a character outside a character vocabulary
            return []


class GrammarMasker:
    """Constrained rows' automata over one tokenizer's vocabulary: the
    :class:`~lmhead.decoding.constraint.TokenMasker` of
    :class:`~lmhead.decoding.constraint.TokenConstraint`.

    Args:
        tokenizer: a tokenizer of ``lmhead.lm.data`` (character, trained or
            imported byte-level BPE), or any with ``encode``, ``decode``,
            ``vocab_size`` and ``eos_id``.

    Examples:
        >>> masker = GrammarMasker(data.CharTokenizer("ab", data.END_OF_TEXT))
        >>> row = masker.start(Constraint.regex("ab"))
        >>> ids, tokens = np.array([row]), np.array([0])
        >>> decoding.unpack_token_mask(masker.advance(ids, tokens, [False]), 3)
        Array([[ True, False, False]], dtype=bool)
        >>> decoding.unpack_token_mask(masker.advance(ids, tokens, [True]), 3)
        Array([[False,  True, False]], dtype=bool)
        >>> masker.release([row])
    """

    def __init__(self, tokenizer: Any):
        self.vocab_size = tokenizer.vocab_size
        self.width = mask_width(self.vocab_size)
        vocabulary = _Vocabulary(tokenizer)
        self.eos_id = vocabulary.eos_token_id
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(vocabulary)
        )
        self._executor = llguidance.LLExecutor()
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self._rows: dict[int, Any] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> Any:
        """The automaton of ``constraint`` at its start, compiled once and
        kept by its text (:data:`CACHE_SIZE` of them).

        Raises:
            ConstraintError: the constraint does not compile (a bad schema,
                regex or grammar, or one llguidance does not support).
        """
        key = (constraint.kind, constraint.text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        matcher = llguidance.LLMatcher(
            self._tokenizer, grammar_text(constraint), log_level=0
        )
        if matcher.is_error():
            raise ConstraintError(
                constraint.kind, f"{constraint.kind}: {matcher.get_error()}"
            )
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def start(self, constraint: Constraint) -> int:
        """A new row's automaton for ``constraint``: its id (never reused)."""
        matcher = self.compile(constraint).deep_copy()
        with self._lock:
            row, self._next_id = self._next_id, self._next_id + 1
            self._rows[row] = matcher
        return row

    def release(self, ids: Sequence[int]) -> None:
        """Forgets the rows' automata (an unknown id is ignored)."""
        with self._lock:
            for row in ids:
                self._rows.pop(int(row), None)

    def accepting(self, row: int) -> bool:
        """Whether row ``row``'s text so far is a whole text of its grammar."""
        with self._lock:
            matcher = self._rows.get(int(row))
        return matcher is not None and matcher.is_accepting()

    def advance(self, ids: Any, tokens: Any, emitted: Any) -> np.ndarray:
        """Each emitted row's automaton takes its token; returns every row's
        mask of its next token (``int32 [B, W]``; all set for an id that is
        ``-1`` or unknown): see :class:`~lmhead.decoding.constraint.TokenMasker`."""
        ids, tokens = np.asarray(ids), np.asarray(tokens)
        emitted = np.asarray(emitted, bool)
        with self._lock:
            matchers = [self._rows.get(int(row)) for row in ids]
        for matcher, token, took in zip(matchers, tokens, emitted):
            if matcher is not None and took:
                matcher.consume_token(int(token))
        masks = llguidance_numpy.allocate_token_bitmask(
            len(ids), self._tokenizer.vocab_size
        )
        rows = [(m, b) for b, m in enumerate(matchers) if m is not None]
        if rows:
            llguidance_numpy.fill_next_token_bitmask_par(self._executor, rows, masks)
        # A virtual end-of-text's bit is past V: the step never reads it.
        return np.ascontiguousarray(masks[:, : self.width])


_MASKERS: "weakref.WeakKeyDictionary[Any, GrammarMasker]" = weakref.WeakKeyDictionary()
_MASKERS_LOCK = threading.Lock()


def masker_for(tokenizer: Any) -> GrammarMasker:
    """The one :class:`GrammarMasker` of ``tokenizer`` (made on first use,
    kept while the tokenizer lives): one masker, one compile of the
    decoding loop, for every constraint."""
    with _MASKERS_LOCK:
        masker = _MASKERS.get(tokenizer)
        if masker is None:
            masker = _MASKERS[tokenizer] = GrammarMasker(tokenizer)
        return masker


def row_constraint(
    masker: GrammarMasker, constraints: Sequence[Constraint | None]
) -> decoding.TokenConstraint:
    """A :class:`~lmhead.decoding.constraint.TokenConstraint` of one new
    automaton per row (``None``: the row is unconstrained); the caller
    releases ``ids`` when done."""
    ids = [UNCONSTRAINED if c is None else masker.start(c) for c in constraints]
    return decoding.TokenConstraint(np.asarray(ids, np.int32), masker)
