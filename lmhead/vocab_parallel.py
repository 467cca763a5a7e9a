r"""The vocabulary-parallel losses: the unembedding split over a mesh axis.

The one chunked sweep (:mod:`lmhead._fused_sweep`) on each device's slice of
the vocabulary, each rule's statistics combined over ``"model"`` by its
``combine`` (the accumulators', :class:`lmhead._fused_rule.Rule`), as
Megatron does for the cross-entropy. :func:`vocab_shards` is the split, for
the ``vocab_shards`` argument of every fused loss (the cross-entropy, the
token log-probs, the distillation); :func:`vocab_parallel_cross_entropy` is
the training loss's. The mesh itself is the experiment's:
``lmhead.lm.sharding``.
"""

import functools
from typing import Any

import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lmhead import _fused_rule, fused

DATA_AXIS = "data"
MODEL_AXIS = "model"


def vocab_shards(mesh: Mesh | None = None) -> _fused_rule.VocabShards:
    """The rows of ``w`` split over the ``"model"`` axis of ``mesh`` (default:
    the mesh set by ``jax.set_mesh``), tokens over ``"data"`` when it
    divides their number: the ``vocab_shards`` argument of the fused losses.

    Raises:
        ValueError: no mesh, or one without a ``"model"`` axis.

    Examples:
        >>> mesh = jax.make_mesh((1, 1), (DATA_AXIS, MODEL_AXIS),
        ...                      (jax.sharding.AxisType.Auto,) * 2)
        >>> vocab_shards(mesh).axis, vocab_shards(mesh).count
        ('model', 1)
    """
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or MODEL_AXIS not in mesh.axis_names:
        raise ValueError(
            "the vocabulary-parallel losses need a mesh with a 'model' axis: "
            "pass mesh=, or trace them under `with jax.set_mesh(mesh):`."
        )
    return _fused_rule.VocabShards(
        MODEL_AXIS, mesh.shape[MODEL_AXIS], functools.partial(_on_mesh, mesh)
    )


def _on_mesh(mesh, core, h, w, bias, loss_scalars, loss_weights, inputs):
    """``core`` on every device of ``mesh``: its tokens (split over
    ``"data"`` when that divides their number, replicated otherwise) against
    its rows of ``w`` and ``bias``, and the replicated ``loss_scalars``; see
    ``_fused_rule.VocabShards``."""
    tokens = (
        DATA_AXIS
        if DATA_AXIS in mesh.axis_names and h.shape[0] % mesh.shape[DATA_AXIS] == 0
        else None
    )

    def per_device(h, w, bias, loss_scalars, loss_weights, inputs):
        # The fused gradient of each of h, w, bias is a product with the
        # others, so all three vary over both axes; the transposes of these
        # casts then sum dh over "model" and dw, dbias over "data". That of
        # loss_scalars is a sum over a device's tokens (whose statistics are
        # already combined over "model"), so it varies as the tokens do.
        h = lax.pcast(h, MODEL_AXIS, to="varying")
        if tokens is not None:
            w, bias, loss_scalars = lax.pcast(
                (w, bias, loss_scalars), tokens, to="varying"
            )
        objective, stats = core(h, w, bias, loss_scalars, loss_weights, inputs)
        if tokens is not None:
            objective = lax.psum(objective, tokens)
        return objective, stats

    by_token, by_row = P(tokens), P(MODEL_AXIS)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(by_token, by_row, by_row, P(), by_token, (by_token, by_row)),
        out_specs=(P(), by_token),
    )(h, w, bias, loss_scalars, loss_weights, inputs)


def vocab_parallel_cross_entropy(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    *,
    mesh: Mesh | None = None,
    **options: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""``fused.fused_cross_entropy`` with ``w`` split over the vocabulary on
    the mesh's ``"model"`` axis.

    Device :math:`s` holds rows :math:`V_s` of ``w`` (and of ``bias``) and
    reduces its logits to :math:`m_s = \max_{i \in V_s} z_i`,
    :math:`e_s = \sum_{i \in V_s} e^{z_i - m_s}`, :math:`\sum_{i \in V_s}
    z_i`, :math:`z_y [y \in V_s]` and its local argmax, as the fused loss
    does on one device; then

    .. math::
        \mathrm{lse}(z) = M + \log \sum_s e_s\, e^{m_s - M}, \quad
        M = \max_s m_s, \qquad
        z_y = \sum_s z_y [y \in V_s], \qquad
        \sum_i z_i = \sum_s \sum_{i \in V_s} z_i,

    with ``pmax``/``psum`` over ``"model"`` and the argmax of the shard with
    the largest logit; the rest (every option, the gradient in the forward
    sweep) is :func:`lmhead.fused.fused_cross_entropy`'s. Tokens are split
    over ``"data"`` when it divides their number (replicated otherwise).

    Args:
        h: ``[..., D]`` hidden states.
        w: ``[V, D]`` unembedding; ``V`` divisible by the ``"model"`` size.
        labels: ``[...]`` integer targets.
        mesh: a mesh with a ``"model"`` axis; default the one set by
            ``jax.set_mesh``.
        **options: the keywords of ``fused.fused_cross_entropy`` (``bias``,
            ``weights``, ``label_smoothing``, ``smoothing``, ``z_loss``,
            ``scale``, ``softcap``, ``chunk_size``, ``vocab_chunk_size``,
            ``precision``, ``reduction``, ``ignore_index``, ...).

    Returns:
        ``(loss, metrics)`` as ``losses.cross_entropy`` returns them.

    Raises:
        ValueError: no mesh, or a vocabulary not divisible by ``"model"``.

    Examples:
        Under ``jax.set_mesh`` (as ``train.py`` traces its steps), on the
        one-device mesh that a doctest has:

        >>> import numpy as np
        >>> from lmhead import head, losses
        >>> rng = np.random.default_rng(0)
        >>> h = rng.normal(size=(2, 3, 4)).astype(np.float32)
        >>> w = rng.normal(size=(10, 4)).astype(np.float32)
        >>> labels = rng.integers(0, 10, (2, 3))
        >>> mesh = jax.make_mesh((1, 1), (DATA_AXIS, MODEL_AXIS),
        ...                      (jax.sharding.AxisType.Auto,) * 2)
        >>> with jax.set_mesh(mesh):
        ...     loss, metrics = jax.jit(lambda h, w: vocab_parallel_cross_entropy(
        ...         h, w, labels, label_smoothing=0.1))(h, w)
        >>> reference, _ = losses.cross_entropy(head.unembed(h, w), labels,
        ...                                     label_smoothing=0.1)
        >>> print(f"{loss:.5f} {reference:.5f}")
        3.80212 3.80212

    References:
        Shoeybi et al., `Megatron-LM: Training Multi-Billion Parameter Language
        Models Using Model Parallelism <https://arxiv.org/abs/1909.08053>`_,
        2019 (section 3, the parallel embedding and cross-entropy).
    """
    return fused.fused_cross_entropy(
        h, w, labels, vocab_shards=vocab_shards(mesh), **options
    )
