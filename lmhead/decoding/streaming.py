"""Streaming: :func:`generate_stream`, :func:`~lmhead.decoding.generate` in chunks of steps."""

import inspect
from collections.abc import Iterator
from typing import Any

import jax

from lmhead import _checks
from lmhead.decoding import sampling
from lmhead.decoding._loop import StepFn
from lmhead.decoding.sampling import Generation


def generate_stream(
    step_fn: StepFn,
    params: Any,
    logits: jax.typing.ArrayLike,
    state: Any,
    *,
    chunk_steps: int,
    **arguments: Any,
) -> Iterator[Generation]:
    """:func:`~lmhead.decoding.generate`, yielding its columns ``chunk_steps`` at a time.

    The first chunk runs :func:`~lmhead.decoding.generate`'s compiled loop to
    step ``k = chunk_steps``; each next one resumes it from its carried state
    (donated: updated in place) to ``k`` steps further. Chunk ``c`` holds
    columns ``c k ... min((c + 1) k, N) - 1`` of ``tokens``, ``log_probs``,
    ``top_tokens`` and ``top_log_probs``, and ``lengths`` and
    ``finish_reasons`` as they stand after those steps. Every chunk runs the
    same loop body as one call, so the chunks concatenated along the token
    axis (with the last chunk's ``lengths`` and ``finish_reasons``) equal one
    :func:`~lmhead.decoding.generate` call bitwise. The iterator always
    covers all ``N = max_new_tokens`` columns; once every row has ended, the
    rest are ``pad_id`` and the loop does no more steps. Each chunk's
    successor is already dispatched when the chunk is yielded, so the
    device decodes while the caller reads; a caller that stops early has
    paid for one chunk more.

    The arguments are checked when this function is called, not at the first
    chunk.

    Args:
        step_fn, params, logits, state: as for :func:`~lmhead.decoding.generate`.
        chunk_steps: ``k >= 1`` steps per chunk.
        **arguments: :func:`~lmhead.decoding.generate`'s keyword arguments
            (``key`` and ``max_new_tokens`` are required).

    Returns:
        An iterator of ``ceil(N / k)`` :class:`~lmhead.decoding.Generation`
        chunks.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> table = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.2, 0.1, 0.7],
        ...                            [0.5, 0.3, 0.2]]))
        >>> markov = lambda table, tokens, state: (table[tokens], state)
        >>> chunks = generate_stream(
        ...     markov, table, table[jnp.array([0])], (), chunk_steps=2,
        ...     key=jax.random.key(0), max_new_tokens=5, temperature=0.0)
        >>> [chunk.tokens.tolist() for chunk in chunks]
        [[[1, 2]], [[0, 1]], [[2]]]
    """
    _checks.check_count("chunk_steps", chunk_steps)
    bound = inspect.signature(sampling.generate).bind(
        step_fn, params, logits, state, **arguments
    )
    bound.apply_defaults()
    loop = sampling._prepare(**bound.arguments)
    return _chunks(loop, chunk_steps)


def _chunks(loop: Any, chunk_steps: int) -> Iterator[Generation]:
    num_new = loop.config.max_new_tokens
    end = min(chunk_steps, num_new)
    start_loop, resume_loop = sampling._loops(loop)
    # Each program returns its chunk's columns beside the state, so that the
    # next one is dispatched before the caller reads (and so waits for) this
    # one: the device decodes while the caller reads.
    s, chunk = start_loop(end, width=end)
    while end < num_new:
        width = min(chunk_steps, num_new - end)
        end += width
        s, following = resume_loop(s, end, width=width)
        yield chunk
        chunk = following
    yield chunk
