"""Evaluation sets, their metrics, and early stopping.

An :class:`EvalSet` is a fixed list of windows with the number of tokens and
characters they predict, made once per run; :func:`evaluate` reduces a
jitted ``eval_step`` over it to the loss, its standard error over windows,
perplexity, bits per character, accuracy and calibration error.
:func:`periodic_eval_sets` are a run's periodic sets, :func:`make_test_set`
the whole test split's, :func:`program_eval_sets` a program's (each set
shared by its members or stacked, one per member: :class:`MemberEvalSet`),
and :class:`EarlyStopping` counts evaluations without a lower validation
loss. docs/training.md, "Evaluation", gives the
rules (bits per character, the end-of-text token, the per-word perplexity).
"""

import dataclasses
import math
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lmhead import metrics
from lmhead.lm import data, sharding


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """A fixed set of evaluation windows.

    Attributes:
        name: the prefix of its metrics: ``"eval"`` (validation),
            ``"train_eval"`` (training windows), ``"heldout"`` (the held-out
            chunks of the training plays) or ``"test"``.
        batches: ``data.eval_batches``'s batches (sharded or not).
        num_tokens: the labels evaluated (the weight sum).
        num_chars: the characters those labels decode to
            (``data.label_chars``).
        num_words: the words of the whole text (:func:`count_words`), for
            the per-word perplexity; None (no word metrics) for the periodic
            sets, which are samples of their split.
    """

    name: str
    batches: list
    num_tokens: int
    num_chars: float
    num_words: int | None = None


def make_eval_set(
    name: str,
    tokens: np.ndarray,
    num_batches: int | None,
    config: ml_collections.ConfigDict,
    tokenizer: data.Tokenizer,
    num_words: int | None = None,
) -> EvalSet:
    """``num_batches`` batches of evenly spaced windows of ``tokens`` (None:
    all of them, consecutive), on the host (a program places them:
    :func:`shared_eval_set`, :func:`stacked_eval_set`); ``num_words`` is the
    set's :attr:`EvalSet.num_words`."""
    batches = data.eval_batches(
        tokens,
        num_batches=num_batches,
        batch_size=config.train.batch_size,
        block_size=config.data.block_size,
    )
    num_tokens = int(sum(b["weights"].sum() for b in batches))
    num_chars = data.label_chars(tokenizer, batches)
    return EvalSet(name, batches, num_tokens, num_chars, num_words)


def count_words(text: str) -> int:
    """The words of ``text``, counted one way for every tokenizer: the
    runs of non-whitespace characters, ``len(text.split())`` (punctuation
    stays with its word, as in ``"lord,"``).

    Examples:
        >>> count_words("  O Romeo, Romeo!\\nwherefore art thou Romeo?  ")
        7
        >>> count_words("")
        0
    """
    return len(text.split())


def make_test_set(
    tokens: np.ndarray,
    config: ml_collections.ConfigDict,
    tokenizer: data.Tokenizer,
) -> EvalSet:
    """The whole test split's set, named ``"test"``: every consecutive
    window of ``tokens`` (``data.load_test_tokens``'s, ``[N]``), with
    :attr:`EvalSet.num_words` the words of the test text,
    ``count_words(tokenizer.decode(tokens))`` (both tokenizers decode their
    encoding back to the text exactly, so this is the text read from the
    corpus), the end-of-text token being no word but a boundary between
    two (the works on either side are counted apart).

    Its labels are tokens ``1 .. T * floor((N - 1) / T)`` (``T`` =
    ``data.block_size``): the whole text but its first token and at most
    ``T - 1`` tokens at its end (``data.eval_batches``); the per-word
    perplexity sums the nats of exactly those labels, over every word of
    the text.
    """
    return make_eval_set(
        "test",
        tokens,
        None,
        config,
        tokenizer,
        num_words=sum(map(count_words, _documents(tokenizer, tokens))),
    )


def _documents(tokenizer: data.Tokenizer, tokens: np.ndarray) -> list[str]:
    """The texts of ``tokens`` between end-of-text tokens (all of it, for a
    tokenizer without one)."""
    text = tokenizer.decode(tokens)
    return text.split(tokenizer.eos_token) if tokenizer.eos_token else [text]


def periodic_eval_sets(
    config: ml_collections.ConfigDict, dataset: data.Dataset
) -> list[EvalSet]:
    """The fixed validation windows, the training windows of
    ``train.eval_train_batches``, and the held-out windows of
    ``data.holdout_fraction`` (:func:`heldout_eval_set`)."""
    eval_sets = [
        make_eval_set(
            "eval",
            dataset.val_tokens,
            config.train.eval_batches,
            config,
            dataset.tokenizer,
        )
    ]
    if config.train.eval_train_batches:
        eval_sets.append(
            make_eval_set(
                "train_eval",
                dataset.train_tokens,
                config.train.eval_train_batches,
                config,
                dataset.tokenizer,
            )
        )
    if dataset.heldout_tokens is not None:
        eval_sets.append(
            heldout_eval_set(config, dataset.heldout_tokens, dataset.tokenizer)
        )
    return eval_sets


def heldout_eval_set(
    config: ml_collections.ConfigDict,
    tokens: np.ndarray,
    tokenizer: data.Tokenizer,
) -> EvalSet:
    """The ``"heldout"`` set of the held-out ``tokens`` (``[N]``): the
    validation set's ``train.eval_batches`` batches of evenly spaced
    windows, or every consecutive window when the text has no more than
    those (``(N - 1) // block_size`` of them), so that a short held-out text
    is evaluated once, not in repeated windows.

    Examples:
        >>> config = ml_collections.ConfigDict(
        ...     {"train": {"eval_batches": 2, "batch_size": 2}, "data": {"block_size": 4}})
        >>> tokenizer = data.CharTokenizer.train("abcdefghij")
        >>> [heldout_eval_set(config, np.arange(n) % 10, tokenizer).num_tokens
        ...  for n in (12, 200)]  # 2 consecutive windows; 2 x 2 spaced ones
        [8, 16]
    """
    num_batches = config.train.eval_batches
    consecutive = (len(tokens) - 1) // config.data.block_size
    if num_batches is not None and num_batches * config.train.batch_size >= consecutive:
        num_batches = None
    return make_eval_set("heldout", tokens, num_batches, config, tokenizer)


@dataclasses.dataclass(frozen=True)
class MemberEvalSet:
    """An evaluation set of every member of a program: ``batches`` shared
    (``[B, T]``) or stacked (``[M, B, T]``, one set per member), and each
    member's :class:`EvalSet` for its token and character counts."""

    batches: list
    stacked: bool
    sets: list[EvalSet]


def program_eval_sets(
    config: ml_collections.ConfigDict,
    datasets: list[data.Dataset],
    mesh: jax.sharding.Mesh,
) -> list[MemberEvalSet]:
    """The periodic sets (:func:`periodic_eval_sets`) of a program whose
    members have ``datasets``, made once per distinct dataset: the
    validation set is the first dataset's (the validation split is every
    member's), and each other set is shared where the members train on one
    text, else stacked (:func:`stacked_eval_set`)."""
    made = {}
    for dataset in datasets:
        if id(dataset) not in made:
            made[id(dataset)] = periodic_eval_sets(config, dataset)
    result = []
    for sets in zip(*(made[id(d)] for d in datasets)):
        if sets[0].name == "eval" or len(made) == 1:
            result.append(shared_eval_set(sets[0], mesh, len(datasets)))
        else:
            result.append(stacked_eval_set(list(sets), mesh))
    return result


def shared_eval_set(
    eval_set: EvalSet, mesh: jax.sharding.Mesh, count: int
) -> MemberEvalSet:
    """``eval_set`` (host batches) as every one of ``count`` members' set:
    replicated on a members mesh, else split over ``data`` as a single run's.

    Examples:
        >>> tokenizer = data.CharTokenizer.train("abcdefghij")
        >>> config = ml_collections.ConfigDict(
        ...     {"train": {"batch_size": 2}, "data": {"block_size": 4}})
        >>> one = make_eval_set("s", np.arange(20) % 10, None, config, tokenizer)
        >>> shared = shared_eval_set(one, sharding.make_mesh(), 3)
        >>> shared.stacked, shared.batches[0]["inputs"].shape, len(shared.sets)
        (False, (2, 4), 3)
    """
    if sharding.MEMBERS_AXIS in mesh.axis_names:
        replicated = NamedSharding(mesh, P())
        batches = [jax.device_put(b, replicated) for b in eval_set.batches]
    else:
        batches = [sharding.shard_batch(b, mesh) for b in eval_set.batches]
    return MemberEvalSet(batches, False, [eval_set] * count)


def stacked_eval_set(sets: list[EvalSet], mesh: jax.sharding.Mesh) -> MemberEvalSet:
    """Each member's own set (host batches) stacked, ``[M, B, T]``
    (:func:`sharding.shard_members`). A set with fewer batches than the
    others (a shorter held-out text evaluated whole) is filled up with
    batches of weight 0, which add nothing to its sums.

    Examples:
        >>> tokenizer = data.CharTokenizer.train("abcdefghij")
        >>> config = ml_collections.ConfigDict(
        ...     {"train": {"batch_size": 1}, "data": {"block_size": 4}})
        >>> sets = [make_eval_set("s", np.arange(n) % 10, None, config, tokenizer)
        ...         for n in (9, 17)]
        >>> stacked = stacked_eval_set(sets, sharding.make_mesh(1, 1))
        >>> [s.num_tokens for s in stacked.sets], len(stacked.batches)
        ([8, 16], 4)
        >>> stacked.batches[3]["weights"].sum(axis=(1, 2)).tolist()
        [0.0, 4.0]
    """
    count = max(len(s.batches) for s in sets)
    padded = [
        s.batches + [_weightless(s.batches[0])] * (count - len(s.batches)) for s in sets
    ]
    batches = [
        sharding.shard_members(jax.tree.map(lambda *xs: np.stack(xs), *group), mesh)
        for group in zip(*padded)
    ]
    return MemberEvalSet(batches, True, sets)


def _weightless(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**batch, "weights": np.zeros_like(batch["weights"])}


def wants_test_evaluation(config: ml_collections.ConfigDict) -> bool:
    """``train.test_eval``; unset (None) means: when there is a test split.

    Examples:
        >>> config = ml_collections.ConfigDict(
        ...     {"train": {"test_eval": None}, "data": {"split": "works"}})
        >>> wants_test_evaluation(config)
        True
    """
    if config.train.test_eval is None:
        return config.data.split == "works"
    return config.train.test_eval


def evaluate(eval_fn, params: Any, eval_set: MemberEvalSet) -> list[dict[str, float]]:
    r"""Each member's metrics over ``eval_set``, named ``{name}/...`` by its
    :class:`EvalSet`. ``eval_fn(params, batch)`` gives every member's sums
    of ``train.eval_step`` (leaves ``[M, ...]``); they are read once.

    ``loss`` is the nll in nats per token, :math:`\bar\ell = \sum_w y_w /
    \sum_w n_w` over windows :math:`w` with summed nll :math:`y_w` and
    :math:`n_w` tokens. ``loss_stderr`` is its standard error with the
    windows as independent draws (the ratio estimator's),
    :math:`\sqrt{\sum_w (y_w - \bar\ell n_w)^2 / (k(k-1))} / \bar n` for
    :math:`k` windows of mean size :math:`\bar n` (NaN for one window, and
    for a loss that is not finite).
    ``bits_per_char`` is :math:`\sum_w y_w / (\ln 2 \cdot` the characters the
    labels decode to), the same for every tokenizer; an end-of-text label's
    nats are in the sum, and it adds no characters. Also ``perplexity``
    (per token), ``accuracy`` and ``ece``.

    A set with :attr:`EvalSet.num_words` (the test split's,
    :func:`make_test_set`) also gets ``words`` (that count) and
    ``word_perplexity`` :math:`= \exp(\sum_w y_w / \text{words})`: the
    summed nats of the evaluated labels over the words of the text, the
    per-word perplexity of Press & Wolf (2017) and Inan et al. (2017), on
    this corpus's words.
    """
    sums = jax.device_get([eval_fn(params, batch) for batch in eval_set.batches])
    return [
        metrics_from_sums(
            [jax.tree.map(lambda x, k=index: x[k], s) for s in sums], own_set
        )
        for index, own_set in enumerate(eval_set.sets)
    ]


def metrics_from_sums(sums: list[dict[str, np.ndarray]], eval_set: EvalSet) -> dict:
    """:func:`evaluate`'s metrics from ``eval_step``'s sums over
    ``eval_set``'s batches, on the host (one dict per batch)."""
    window_nll, window_count = (
        np.concatenate([s[k] for s in sums]).astype(np.float64)
        for k in ("window_nll", "window_count")
    )
    window_nll, window_count = (x[window_count > 0] for x in (window_nll, window_count))
    count, k = window_count.sum(), len(window_count)
    nll = window_nll.sum() / count
    stderr = (
        (
            np.sqrt(np.sum((window_nll - nll * window_count) ** 2) / (k * (k - 1)))
            / window_count.mean()
        )
        if k > 1 and np.isfinite(nll)
        else math.nan
    )
    values = {
        "loss": nll,
        "loss_stderr": stderr,
        "perplexity": metrics.perplexity(nll),
        "bits_per_char": metrics.bits_per_character(
            nll, eval_set.num_chars / eval_set.num_tokens
        ),
        "accuracy": np.sum([s["correct_sum"] for s in sums]) / count,
        "ece": metrics.calibration_error_from_bins(
            np.sum([s["bins"] for s in sums], axis=0)
        ),
    }
    if eval_set.num_words is not None:
        values["words"] = eval_set.num_words
        values["word_perplexity"] = (
            np.exp(window_nll.sum() / eval_set.num_words)
            if eval_set.num_words
            else math.nan
        )
    return {f"{eval_set.name}/{k}": float(v) for k, v in values.items()}


@dataclasses.dataclass
class EarlyStopping:
    """Stops when ``patience`` evaluations in a row have not lowered the best
    validation loss (``patience=0``: never). A NaN loss never improves.

    Examples:
        >>> stopping = EarlyStopping(patience=2)
        >>> [stopping.update(step, loss) for step, loss in
        ...  [(10, 3.0), (20, 2.5), (30, 2.6), (40, 2.5)]]
        [True, True, False, False]
        >>> stopping.best_step, stopping.should_stop
        (20, True)
    """

    patience: int
    best_step: int | None = None
    best_loss: float = math.inf
    evaluations_since_best: int = 0

    @classmethod
    def from_records(cls, patience: int, records: list[dict]) -> "EarlyStopping":
        """The state after the evaluations in ``records`` (a resumed run's)."""
        stopping = cls(patience)
        for record in records:
            if "eval/loss" in record:
                stopping.update(record["step"], record["eval/loss"])
        return stopping

    def update(self, step: int, loss: float) -> bool:
        """Counts the evaluation at ``step``; True when it is a new best."""
        if loss < self.best_loss:
            self.best_step, self.best_loss = step, loss
            self.evaluations_since_best = 0
            return True
        self.evaluations_since_best += 1
        return False

    @property
    def should_stop(self) -> bool:
        return 0 < self.patience <= self.evaluations_since_best
