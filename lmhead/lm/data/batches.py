"""Batches of token windows: random ones for training, fixed ones for
evaluation, and the characters their labels decode to.

As in nanoGPT's ``shakespeare_char``, training batches are random contiguous
windows (:func:`train_batch`), and evaluation uses the whole split in
consecutive windows or a fixed, evenly spaced subset of windows
(:func:`eval_batches`). The batch of step ``s`` is a pure function of
``(seed, s)``, so a resumed run needs nothing but the step to continue the
same data stream.
"""

import numpy as np

from lmhead.lm.data.tokenization import Tokenizer, text_length

# Keeps the two numpy streams apart: default_rng([seed, TRAIN_STREAM, step]).
TRAIN_STREAM = 0


def windows(
    tokens: np.ndarray, starts: np.ndarray, block_size: int
) -> dict[str, np.ndarray]:
    """Cuts ``block_size + 1`` tokens at each start into inputs and labels.

    Args:
        tokens: [N] token ids.
        starts: [B] window starts, each in ``[0, N - block_size - 1]``.
        block_size: T, the model's context length.

    Returns:
        ``{"inputs": [B, T], "labels": [B, T]}`` int32, labels = inputs shifted
        left by one.

    Examples:
        >>> windows(np.arange(10), np.array([0, 5]), 3)["labels"]
        array([[1, 2, 3],
               [6, 7, 8]], dtype=int32)
    """
    window = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int32)
    return {"inputs": window[:, :-1], "labels": window[:, 1:]}


def train_batch(
    tokens: np.ndarray, *, seed: int, step: int, batch_size: int, block_size: int
) -> dict[str, np.ndarray]:
    """The training batch of ``step``: uniform random windows of ``tokens``.

    A pure function of ``(seed, step)``: the starts are drawn by
    ``np.random.default_rng([seed, 0, step])``, so resuming at a step needs no
    generator state.

    Args:
        tokens: [N] training token ids.
        seed: the run's seed (non-negative).
        step: the 0-based index of the optimizer step.
        batch_size: B.
        block_size: T.

    Returns:
        ``{"inputs": [B, T], "labels": [B, T]}`` int32.

    Examples:
        >>> batch = train_batch(np.arange(100), seed=0, step=3, batch_size=2,
        ...                     block_size=4)
        >>> batch["inputs"].shape
        (2, 4)
        >>> bool((batch["labels"] == batch["inputs"] + 1).all())
        True
    """
    rng = np.random.default_rng([seed, TRAIN_STREAM, step])
    starts = rng.integers(0, len(tokens) - block_size, size=batch_size)
    return windows(tokens, starts, block_size)


def label_chars(tokenizer: Tokenizer, batches: list[dict[str, np.ndarray]]) -> int:
    """The number of characters that the weighted labels of ``batches`` decode
    to, window by window, the end-of-text token counting none
    (``tokenization.text_length``): the denominator of bits per character.

    Bits per character = (sum of the labels' nats, the end-of-text token's
    included) / (ln 2 * this), the same computation for every tokenizer. (A
    byte-level BPE window that starts or ends inside a multi-byte character
    counts its bytes as one replacement character each.)

    Examples:
        >>> from lmhead.lm.data import CharTokenizer
        >>> tok = CharTokenizer.train("abcdefgh")
        >>> label_chars(tok, eval_batches(tok.encode_array("abcdefgh"),
        ...                               num_batches=None, batch_size=4, block_size=3))
        6
    """
    return sum(
        text_length(tokenizer, labels[weights > 0])
        for batch in batches
        for labels, weights in zip(batch["labels"], batch["weights"])
    )


def eval_batches(
    tokens: np.ndarray, *, num_batches: int | None, batch_size: int, block_size: int
) -> list[dict[str, np.ndarray]]:
    """A fixed validation set: evenly spaced windows, or the whole split.

    With ``num_batches``: ``num_batches * batch_size`` evenly spaced windows,
    a sample of the whole split with no randomness, so every evaluation of
    every run sees the same tokens. With ``None``: consecutive windows
    starting at ``0, T, 2T, ...``, so that each of the first
    ``T * floor((N - 1) / T)`` labels is predicted exactly once (at most
    ``T - 1`` tokens at the end are left out); the last batch is filled up
    with copies of the first window, of weight 0, so that every batch has
    the same shape.

    Args:
        tokens: [N] validation token ids.
        num_batches: how many batches, or None for the whole split.
        batch_size: B.
        block_size: T.

    Returns:
        A list of dicts ``{"inputs": [B, T], "labels": [B, T], "weights":
        [B, T]}`` (int32, int32, float32).

    Examples:
        >>> [b["inputs"][:, 0].tolist()
        ...  for b in eval_batches(np.arange(20), num_batches=2, batch_size=2,
        ...                        block_size=4)]
        [[0, 5], [10, 15]]
        >>> last = eval_batches(np.arange(11), num_batches=None, batch_size=2,
        ...                     block_size=3)[-1]
        >>> last["labels"].tolist(), last["weights"].tolist()
        ([[7, 8, 9], [1, 2, 3]], [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    """
    if num_batches is None:
        starts = np.arange((len(tokens) - 1) // block_size) * block_size
    else:
        starts = np.linspace(
            0, len(tokens) - block_size - 1, num_batches * batch_size
        ).astype(np.int64)
    padding = -len(starts) % batch_size
    weights = np.ones([len(starts) + padding, block_size], np.float32)
    weights[len(starts) :] = 0.0
    starts = np.concatenate([starts, np.zeros(padding, np.int64)])
    return [
        {
            **windows(tokens, starts[i : i + batch_size], block_size),
            "weights": weights[i : i + batch_size],
        }
        for i in range(0, len(starts), batch_size)
    ]
