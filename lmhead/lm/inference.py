"""The decoding interface of :class:`~lmhead.lm.model.DecoderLM`.

:func:`prefill` runs a prompt once and fills a key/value cache
(:mod:`lmhead.lm.kv_cache`); :func:`make_step_fn` gives the decoders'
``step_fn(params, tokens, cache) -> (logits, cache)`` (:class:`DecodeStep`,
with the cache operations beam search, continuous batching and speculative
decoding use), :func:`rows_mesh` the mesh that splits a batch's rows over
devices, and :class:`MTPProposer` speculative decoding's proposals from a
run's MTP heads. ``lmhead.decoding``'s decoders take these and know no model.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks
from lmhead.lm import kv_cache, sharding
from lmhead.lm.model import DecoderLM


@functools.partial(jax.jit, static_argnums=(0, 5))
def _compiled_extend(model, params, tokens, cache, lengths, every_position=False):
    return model.apply(
        {"params": params},
        tokens,
        cache,
        lengths,
        every_position,
        method=DecoderLM.extend,
    )


@functools.partial(jax.jit, static_argnums=(0, 4))
def _compiled_propose(model, params, last, cache, num_tokens):
    return model.apply(
        {"params": params}, last, cache, num_tokens, method=DecoderLM.propose
    )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _split_prefill(model, mesh, params, tokens, lengths):
    """``_compiled_prefill`` with the rows split over ``mesh``'s one axis: each
    device fills its own rows' cache (a ``shard_map`` without collectives),
    and the logits and cache stay there for a decoder that runs a loop per
    device (``lmhead/decoding/split.py``)."""
    rows = jax.sharding.PartitionSpec(mesh.axis_names[0])
    split = jax.shard_map(
        functools.partial(_compiled_prefill, model, None),
        mesh=mesh,
        in_specs=(jax.sharding.PartitionSpec(), rows, rows),
        out_specs=(rows, rows),
    )
    return split(params, tokens, lengths)


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def _compiled_prefill(model, mesh, params, tokens, lengths, mtp=False):
    # The empty cache is made inside the program: made op by op, each of its
    # pieces would cost a dispatch at every prefill.
    if mesh is not None:
        return _split_prefill(model, mesh, params, tokens, lengths)
    cache = kv_cache.init_cache(model, tokens.shape[0], mtp=mtp)
    return _compiled_extend(model, params, tokens, cache, lengths)


def prefill(
    model: DecoderLM,
    params: Any,
    prompt: jax.typing.ArrayLike,
    lengths: jax.typing.ArrayLike | None = None,
    *,
    max_new_tokens: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    mtp: bool = False,
) -> tuple[jax.Array, kv_cache.DecodeCache]:
    """Runs a prompt once: the next-token logits and the filled cache.

    Only each row's last real position goes through the head, so the head
    costs ``[B, V]``, not ``[B, T, V]``.

    Args:
        model: the :class:`DecoderLM`.
        params: its ``"params"`` collection.
        prompt: ``int [B, T]``, ``1 <= T <= max_len``, right-padded when
            ``lengths`` is given.
        lengths: ``int [B]`` in ``[1, T]``, the real length of each row (each
            row then continues from its own length); None means all ``T``.
        max_new_tokens: if given, checks that ``max(lengths) +
            max_new_tokens <= max_len``, so that every generated token fits in
            the cache.
        mesh: if given (:func:`rows_mesh`), the rows are split over its
            devices, and the logits and cache are left there, as a step of
            :func:`make_step_fn` with the same mesh reads them; ``B`` must be
            a multiple of its size.
        mtp: True fills the MTP depths' layers too (``kv_cache.init_cache``'s
            ``mtp``), for speculative decoding from them (:class:`MTPProposer`);
            not with ``mesh``.

    Returns:
        ``float32 [B, V]`` logits of the token after each prompt, and a
        :class:`~lmhead.lm.kv_cache.DecodeCache` with ``index == lengths``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = DecoderLM(vocab_size=17, num_layers=1, num_heads=2,
        ...                   d_model=8, mlp_dim=16, max_len=8)
        >>> prompt = jnp.array([[1, 2, 3], [4, 5, 0]])
        >>> params = jax.jit(model.init)(jax.random.key(0), prompt)["params"]
        >>> logits, cache = prefill(model, params, prompt, jnp.array([3, 2]))
        >>> logits.shape, cache.index
        ((2, 17), Array([3, 2], dtype=int32))
        >>> full = jax.jit(model.apply)({"params": params}, prompt[1:, :2])
        >>> bool(jnp.allclose(logits[1], full[0, -1], atol=1e-6))
        True
        >>> prefill(model, params, prompt, max_new_tokens=6)
        Traceback (most recent call last):
        ...
        ValueError: prompt length 3 + max_new_tokens 6 = 9 exceeds the model's max_len 8.
    """
    _checks.check_integer("prompt", prompt)
    _checks.check_rank("prompt", prompt, 2, "[B, T]")
    _checks.check_in_range("prompt", prompt, low=0, high=model.vocab_size - 1)
    batch, time = jnp.shape(prompt)
    if not 1 <= time <= model.max_len:
        raise ValueError(
            f"prompt must have 1 to max_len={model.max_len} positions; "
            f"got shape {jnp.shape(prompt)}."
        )
    if lengths is None:
        lengths = jnp.full((batch,), time, jnp.int32)
    _checks.check_integer("lengths", lengths)
    if jnp.shape(lengths) != (batch,):
        raise ValueError(
            f"lengths must have shape [B] = ({batch},); got {jnp.shape(lengths)}."
        )
    _checks.check_in_range("lengths", lengths, low=1, high=time)
    if max_new_tokens is not None:
        longest = time if _checks.is_traced(lengths) else int(np.max(lengths))
        if longest + max_new_tokens > model.max_len:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {max_new_tokens} = "
                f"{longest + max_new_tokens} exceeds the model's max_len "
                f"{model.max_len}."
            )
    _check_rows_mesh(mesh)
    _check_split(mesh, "prompt", batch)
    if mtp and mesh is not None:
        raise ValueError(
            "mtp=True (speculative decoding) splits no rows: pass mesh=None."
        )
    return _compiled_prefill(
        model,
        mesh,
        params,
        jnp.asarray(prompt, jnp.int32),
        jnp.asarray(lengths, jnp.int32),
        bool(mtp),
    )


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """The decoders' ``step_fn`` for a :class:`DecoderLM`; see :func:`make_step_fn`."""

    model: DecoderLM
    mesh: jax.sharding.Mesh | None = None

    def __call__(
        self, params: Any, tokens: jax.Array, cache: kv_cache.DecodeCache
    ) -> tuple[jax.Array, kv_cache.DecodeCache]:
        _checks.check_integer("tokens", tokens)
        _checks.check_rank("tokens", tokens, 1, "[B]")
        tokens = jnp.asarray(tokens, jnp.int32)
        # One new position per row.
        column, lengths = tokens[:, None], jnp.ones_like(tokens)
        _check_split(self.mesh, "tokens", tokens.shape[0])
        return _compiled_extend(self.model, params, column, cache, lengths)

    def per_device(self) -> "DecodeStep":
        """The step of one device's block of rows, for a decoder that runs
        its whole loop inside a ``shard_map`` over ``mesh``
        (``lmhead/decoding/split.py``); slot pointers made inside that loop
        name rows of the device's own block."""
        if self.mesh is None:
            raise ValueError("per_device needs a step made with a mesh.")
        return DecodeStep(self.model)

    def reorder(
        self, cache: kv_cache.DecodeCache, rows: jax.Array
    ) -> kv_cache.DecodeCache:
        return kv_cache.reorder_cache(cache, rows)

    def repeat(self, cache: kv_cache.DecodeCache, repeats: int) -> kv_cache.DecodeCache:
        return kv_cache.repeat_cache(cache, repeats)

    def trim(self, cache: kv_cache.DecodeCache, num_steps: int) -> kv_cache.DecodeCache:
        return kv_cache.trim_cache(cache, num_steps)

    def reset_rows(
        self, cache: kv_cache.DecodeCache, rows: jax.Array
    ) -> kv_cache.DecodeCache:
        return kv_cache.reset_rows(cache, rows)

    def verify(
        self, params: Any, tokens: jax.Array, cache: kv_cache.DecodeCache
    ) -> tuple[jax.Array, kv_cache.DecodeCache]:
        """Speculative decoding's one call: ``tokens: int [B, T]`` fed at
        once, the logits after each ``float32 [B, T, V]``."""
        _checks.check_integer("tokens", tokens)
        _checks.check_rank("tokens", tokens, 2, "[B, T]")
        tokens = jnp.asarray(tokens, jnp.int32)
        lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
        return _compiled_extend(self.model, params, tokens, cache, lengths, True)

    def rewind(
        self, cache: kv_cache.DecodeCache, num_positions: jax.Array
    ) -> kv_cache.DecodeCache:
        return kv_cache.rewind_cache(cache, num_positions)


@dataclasses.dataclass(frozen=True)
class MTPProposer:
    """Speculative decoding's proposals from a run's MTP heads
    (``lmhead.decoding``'s proposer interface): draft ``i`` is depth ``i``'s
    argmax (:meth:`DecoderLM.propose`). The state is a cache made with
    ``prefill(..., mtp=True)``.

    Attributes:
        model: a :class:`DecoderLM` with ``mtp_heads >= num_tokens``.
        num_tokens: ``k``, the tokens proposed per step.
    """

    model: DecoderLM
    num_tokens: int
    reads_history = False

    def __post_init__(self):
        _checks.check_count("num_tokens", self.num_tokens)
        if self.num_tokens > self.model.mtp_heads:
            raise ValueError(
                f"num_speculative_tokens={self.num_tokens} is more proposals than "
                f"the run's MTP heads (mtp_heads={self.model.mtp_heads}); it must "
                f"be in [1, {self.model.mtp_heads}]."
                if self.model.mtp_heads
                else "speculative='mtp' needs a run trained with MTP heads "
                "(model.mtp_heads >= 1); this one has none: use 'ngram'."
            )

    def propose(
        self, params: Any, cache: kv_cache.DecodeCache, context: Any
    ) -> tuple[jax.Array, kv_cache.DecodeCache]:
        """``(drafts int32 [B, k], cache)`` after ``context.last``."""
        if cache.hidden is None:
            raise ValueError(
                "MTP proposals need a cache of the MTP depths: prefill(..., mtp=True)."
            )
        return _compiled_propose(
            self.model, params, context.last, cache, self.num_tokens
        )


def _check_rows_mesh(mesh: jax.sharding.Mesh | None) -> None:
    if mesh is not None and len(mesh.axis_names) != 1:
        raise ValueError(
            "mesh must have one axis, over which the rows are split (as "
            f"rows_mesh(B) makes); got axes {mesh.axis_names}."
        )


def _check_split(mesh: jax.sharding.Mesh | None, name: str, batch: int) -> None:
    if mesh is not None and batch % mesh.size:
        raise ValueError(
            f"{name} has {batch} rows, which the mesh's {mesh.size} devices do "
            "not divide; rows_mesh(B) makes a mesh that does."
        )


def rows_mesh(batch: int, devices: Any = None) -> jax.sharding.Mesh | None:
    """A one-axis mesh (``"rows"``) over the most of ``devices`` (default:
    this process's) that divide ``batch``, for :func:`make_step_fn`; None
    where that is one device.

    Examples:
        >>> rows_mesh(32, jax.local_devices()[:1]) is None
        True
    """
    _checks.check_count("batch", batch)
    devices = jax.local_devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("devices must hold at least one device; got none.")
    count = sharding.dividing_devices(batch, len(devices))
    if count == 1:
        return None
    return jax.sharding.Mesh(np.array(devices[:count]), ("rows",))


def make_step_fn(model: DecoderLM, mesh: jax.sharding.Mesh | None = None) -> DecodeStep:
    """The decoders' ``step_fn(params, tokens: int [B], cache) -> (float32 [B, V], cache)``.

    Feeds one token per row at position ``cache.index`` and sends that one
    position through the head. ``params`` is an argument, so one compiled
    decoding loop serves every parameter set; steps of equal models are equal
    (a frozen dataclass), so they share compilations too. The step's
    ``repeat``, ``reorder``, ``trim`` and ``reset_rows`` are
    :mod:`lmhead.lm.kv_cache`'s, for beam search and continuous batching. A
    row must not step past ``max_len`` (:func:`prefill`'s ``max_new_tokens``
    checks it).

    With ``mesh``, a one-axis mesh (:func:`rows_mesh`), the decoders run a
    whole loop per device on its own block of rows, each stepping it with
    :meth:`DecodeStep.per_device` (``lmhead/decoding/split.py``); the logits
    are those without it to float32 rounding. The number of rows (and of a
    beam search's prompts) must be a multiple of the mesh's size.
    docs/decoding.md describes the split and measures it.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = DecoderLM(vocab_size=17, num_layers=1, num_heads=2,
        ...                   d_model=8, mlp_dim=16, max_len=8)
        >>> tokens = jnp.array([[1, 2, 3, 4]])
        >>> params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
        >>> logits, cache = prefill(model, params, tokens[:, :3])
        >>> logits, cache = make_step_fn(model)(params, tokens[:, 3], cache)
        >>> full = jax.jit(model.apply)({"params": params}, tokens)
        >>> bool(jnp.allclose(logits, full[:, -1], atol=1e-6)), cache.index
        (True, Array([4], dtype=int32))
    """
    _check_rows_mesh(mesh)
    return DecodeStep(model, mesh)
