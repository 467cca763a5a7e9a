r"""The options of the fused sweep's gradient: filtering small tiles and the
sum of ``dw`` over chunks (:class:`lmhead._fused_sweep.Plan`'s fields).

docs/fused_loss.md ("Gradient filtering and dw's accumulation") derives the
filter's bound and compares the accumulations.
"""

import jax.numpy as jnp

from lmhead import _checks

# The gradients a filtered tile leaves out; how dw is summed over chunks.
FILTER_TARGETS = ("both", "dh", "dw")
DW_ACCUMULATIONS = ("float32", "kahan", "input_dtype")
# filter_eps="auto": finfo(dtype).eps / AUTO_FILTER_DIVISOR, as CCE.
AUTO_FILTER_DIVISOR = 32


def gradient_options(filter_eps, filter_target, dw_accumulation, dtype) -> dict:
    r"""The :class:`lmhead._fused_sweep.Plan` fields of the gradient's options, checked.

    ``filter_eps``: None (exact), a number ``>= 0``, or ``"auto"``,
    ``finfo(dtype).eps / 32`` of the inputs' dtype. A tile (a chunk's tokens
    x a vocabulary block) is skipped when each entry of its coefficient
    :math:`g = \partial L / \partial u` (the rule's ``dlogits`` after the
    softcap's derivative) is 0 or :math:`|g_{ti}| < \epsilon \sigma_t`, with
    :math:`\sigma_t = \max_k |c_{tk}|` the token's largest coefficient: for
    the cross-entropy :math:`g_{ti} / \sigma_t = p_{ti} - [i = y_t]`, whatever
    the token's weight or the reduction. A skipped tile adds nothing to
    ``dh`` (``filter_target`` ``"both"`` or ``"dh"``) and ``dw`` (``"both"``
    or ``"dw"``); ``dbias`` and the outputs stay exact. With the scale
    :math:`s` and the objective's cotangent :math:`c` (``1 / sum(weights)``
    for a mean), :math:`S_t` (:math:`S_i`) the rows (tokens) of token
    ``t``'s (row ``i``'s) skipped tiles, or all of them:

    .. math::
        |\Delta dh_{td}| \le |s| c \epsilon \sigma_t \sum_{i \in S_t} |w_{id}|,
        \qquad |\Delta dw_{id}| \le |s| c \epsilon \sum_{t \in S_i}
        \sigma_t |h_{td}|.

    ``dw_accumulation``: ``"float32"`` (default) sums the chunks' ``dw`` in
    float32; ``"kahan"`` adds a float32 Kahan compensation (a second
    ``[V, D]`` array), so the sum's error does not grow with the chunks;
    ``"input_dtype"`` sums in the inputs' dtype (bf16: half the memory).

    Examples:
        >>> gradient_options("auto", "dh", "float32", jnp.bfloat16)
        {'filter_eps': 0.000244140625, 'filter_target': 'dh', 'dw_accumulation': 'float32'}

    References:
        Wijmans et al., `Cut Your Losses in Large-Vocabulary Language Models
        <https://arxiv.org/abs/2411.09009>`_, 2024 (gradient filtering);
        Kahan, `Further remarks on reducing truncation errors
        <https://doi.org/10.1145/363707.363723>`_, 1965.
    """
    if isinstance(filter_eps, str):
        if filter_eps != "auto":
            raise ValueError(
                f"filter_eps must be None, a number >= 0 or 'auto'; got {filter_eps!r}."
            )
        filter_eps = float(jnp.finfo(dtype).eps) / AUTO_FILTER_DIVISOR
    elif filter_eps is not None:
        if isinstance(filter_eps, bool) or _checks.is_traced(filter_eps):
            raise TypeError(
                "filter_eps must be None, a concrete number >= 0 or 'auto'; "
                f"got {filter_eps!r}."
            )
        _checks.check_in_range("filter_eps", filter_eps, low=0.0)
        filter_eps = float(filter_eps)
    _checks.check_choice("filter_target", filter_target, FILTER_TARGETS)
    _checks.check_choice("dw_accumulation", dw_accumulation, DW_ACCUMULATIONS)
    return dict(
        filter_eps=filter_eps,
        filter_target=filter_target,
        dw_accumulation=dw_accumulation,
    )
