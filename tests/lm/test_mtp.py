"""Tests of the multi-token prediction heads of DecoderLM (lmhead/lm/mtp.py).

References: a float64 numpy loss written here on the model's materialized
logits (main head and ``depth_logits``), whose gradient with respect to the
logits (written in numpy) is pulled back through the model's forward pass to
every parameter; the model's full forward pass for the cached decoding paths;
and the compiled programs' memory for the fused loss's temporary memory.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from configs import default
from lmhead import decoding, fused, head, losses
from lmhead.lm import configuration, inference, kv_cache
from lmhead.lm import model as model_lib
from lmhead.lm.model import DecoderLM

VOCAB, TIME = 11, 9


def mtp_model(design="sequential", unembedding="shared", tied=True, heads=3, **kw):
    values = dict(
        vocab_size=VOCAB, num_layers=1, num_heads=2, d_model=8, mlp_dim=16,
        max_len=16, tied=tied, mtp_heads=heads, mtp_design=design,
        mtp_unembedding=unembedding,
    )  # fmt: skip
    return DecoderLM(**{**values, **kw})


def init(model, seed=0):
    tokens = jnp.zeros((1, TIME), jnp.int32)
    return jax.jit(model.init)(jax.random.key(seed), tokens)["params"]


def batch(seed=1, rows=3):
    tokens = jax.random.randint(jax.random.key(seed), (rows, TIME + 1), 0, VOCAB)
    # Ragged ends: each row's last positions are padding (weight 0).
    lengths = np.array([TIME, TIME - 2, TIME - 5])[:rows]
    weights = (np.arange(TIME) < lengths[:, None]).astype(np.float32)
    return tokens[:, :-1], tokens[:, 1:], weights


def reference_loss_and_dlogits(logits, labels, weights, lam, eps, z_loss):
    """float64 numpy: ``L = CE_0 + lam / k sum_i CE_i`` of the main logits
    ``logits[0]`` and the depths' ``logits[i]`` (``[k + 1, B, T, V]``; depth
    ``i`` at ``t`` has target ``labels[t + i]``, weight ``weights[t + i]``),
    uniform label smoothing ``eps`` and z-loss; and ``dL/dlogits``."""
    logits = np.asarray(logits, np.float64)
    depths, _, time, vocab = logits.shape
    k = depths - 1
    total, grads = 0.0, np.zeros_like(logits)
    for d in range(depths):
        z = logits[d, :, : time - d]
        y = np.asarray(labels)[:, d:]
        w = np.asarray(weights, np.float64)[:, d:]
        lse = special.logsumexp(z, axis=-1)
        nll = lse - np.take_along_axis(z, y[..., None], -1)[..., 0]
        smooth = (lse[..., None] - z).sum(-1) / vocab
        token = (1 - eps) * nll + eps * smooth + z_loss * lse**2
        scale = 1.0 if d == 0 else lam / k
        total += scale * (w * token).sum() / w.sum()
        p = special.softmax(z, axis=-1)
        onehot = np.eye(vocab)[y]
        dz = p * (1 + 2 * z_loss * lse[..., None]) - (1 - eps) * onehot - eps / vocab
        grads[d, :, : time - d] = scale * (w / w.sum())[..., None] * dz
    return total, grads


def depth_logits(model, params, tokens):
    """``[k, B, T, V]``: each depth's logits over the whole sequence (jitted)."""
    apply = functools.partial(model.apply, method=DecoderLM.depth_logits)
    return jax.jit(apply)({"params": params}, tokens)


def proposals(model, num_tokens, params, cache, last):
    """The MTP heads' ``[B, num_tokens]`` drafts after the token ``last
    [B]``, from ``cache`` (one jitted program)."""

    def propose(params, cache, last):
        context = decoding.ProposalContext(last, jnp.ones(last.shape, bool), None)
        return inference.MTPProposer(model, num_tokens).propose(params, cache, context)

    return jax.jit(propose)(params, cache, last)[0]


def all_logits(model, params, tokens):
    """``[k + 1, B, T, V]``: the main head's logits, then each depth's."""
    main = model.apply({"params": params}, tokens)
    return jnp.concatenate([main[None], depth_logits(model, params, tokens)])


# The fused loss with each design and unembedding, tied and untied between
# them; the materialized one twice: every pair of two options' values is
# tested (each case compiles its own programs).
LOSS_CASES = [
    ("fused", "sequential", "shared", True),
    ("fused", "sequential", "own", False),
    ("fused", "parallel", "shared", False),
    ("fused", "parallel", "own", True),
    ("materialized", "sequential", "shared", False),
    ("materialized", "parallel", "own", True),
]


@pytest.mark.parametrize("loss_impl, design, unembedding, tied", LOSS_CASES)
def test_loss_and_gradients_match_numpy_on_materialized_logits(
    loss_impl, design, unembedding, tied
):
    model = mtp_model(design, unembedding, tied)
    params = init(model)
    tokens, labels, weights = batch()
    options = dict(mtp_weight=0.3, label_smoothing=0.1, z_loss=1e-3)
    if loss_impl == "fused":
        options["chunk_size"] = 8  # several chunks, the last one ragged

    def loss_fn(params):
        return model.apply(
            {"params": params}, tokens, labels, weights,
            method=DecoderLM.loss, loss_impl=loss_impl, **options,
        )  # fmt: skip

    logits_fn = functools.partial(all_logits, model, tokens=tokens)

    def loss_and_logits(params):
        return jax.value_and_grad(loss_fn, has_aux=True)(params), logits_fn(params)

    ((loss, metrics), grads), logits = jax.jit(loss_and_logits)(params)
    expected, dlogits = reference_loss_and_dlogits(
        logits, labels, weights, 0.3, 0.1, 1e-3
    )
    pull_back = lambda p, dz: jax.vjp(logits_fn, p)[1](dz)[0]
    expected_grads = jax.jit(pull_back)(params, jnp.asarray(dlogits, jnp.float32))
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    assert float(metrics["loss"]) == pytest.approx(float(loss))
    for path, got in jax.tree_util.tree_flatten_with_path(grads)[0]:
        want = functools.reduce(lambda t, k: t[k.key], path, expected_grads)
        assert float(jnp.max(jnp.abs(want))) > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(
            got, want, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path)
        )


def test_per_depth_metrics_match_each_depth_on_its_own():
    model = mtp_model(heads=2)
    params = init(model)
    tokens, labels, weights = batch()
    loss = functools.partial(model.apply, method=DecoderLM.loss)
    _, metrics = jax.jit(loss)({"params": params}, tokens, labels, weights)

    @jax.jit
    def each_depth_on_its_own(params):
        logits = all_logits(model, params, tokens)
        metrics = []
        for d in range(3):
            depth_labels, depth_weights = losses.depth_targets(
                labels, weights, (d,), jnp.ones(1)
            )
            _, expected = losses.cross_entropy(
                logits[d], depth_labels[0], weights=depth_weights[0]
            )
            metrics.append(expected)
        return metrics

    for d, expected in enumerate(each_depth_on_its_own(params)):
        prefix = "" if d == 0 else f"depth{d}_"
        for name in ("nll", "accuracy"):
            np.testing.assert_allclose(
                metrics[prefix + name], expected[name], rtol=1e-5, atol=1e-7
            )
    assert float(metrics["weight_sum"]) == weights.sum()


def test_mtp_keeps_the_trunk_and_main_head_of_the_same_seed():
    """Adding depths adds parameters only: the trunk, the head and the main
    logits of a seed are the plain model's, bitwise (runs pair by seed)."""
    plain = mtp_model(heads=0, tied=False)
    deeper = mtp_model(heads=2, unembedding="own", tied=False)
    plain_params, mtp_params = init(plain), init(deeper)
    assert set(mtp_params) - set(plain_params) == {"mtp_0", "mtp_1", "mtp_head"}
    shared = {k: mtp_params[k] for k in plain_params}
    assert jax.tree.all(jax.tree.map(np.array_equal, shared, plain_params))
    tokens = batch()[0]
    np.testing.assert_array_equal(
        plain.apply({"params": plain_params}, tokens),
        deeper.apply({"params": mtp_params}, tokens),
    )


def test_depth_targets_shift_labels_and_normalize_each_depth():
    labels = jnp.array([[1, 2, 3, 4], [5, 6, -100, 7]])
    weights = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 2.0, 1.0, 1.0]])
    stacked, scaled = losses.depth_targets(
        labels, weights, (0, 2), jnp.array([1.0, 0.5])
    )
    np.testing.assert_array_equal(
        stacked[1], [[3, 4, -100, -100], [-100, 7, -100, -100]]
    )
    # Depth 0: weights over the labels kept (the ignored one weighs 0), sum 1.
    np.testing.assert_allclose(scaled[0], np.array([[1, 1, 1, 0], [1, 2, 0, 1]]) / 7)
    np.testing.assert_allclose(scaled[1], [[0.25, 0, 0, 0], [0, 0.25, 0, 0]])


def test_mtp_loss_memory_is_a_small_fraction_of_the_materialized_one():
    """N = 8192 tokens, D = 512, V = 32768, k = 3 depths sharing the
    unembedding: the compiled step's temporary memory (nothing is run)."""
    n, d, v, k = 8192, 512, 32768, 3
    hs = jax.ShapeDtypeStruct((k + 1, n, d), jnp.float32)
    w = jax.ShapeDtypeStruct((v, d), jnp.float32)
    labels = jax.ShapeDtypeStruct((n,), jnp.int32)

    def mtp_loss(loss_fn, hs, w, labels):
        scales = jnp.concatenate([jnp.ones(1), jnp.full(k, 0.3 / k)])
        stacked, weights = losses.depth_targets(
            labels[None], None, tuple(range(k + 1)), scales
        )
        return loss_fn(
            hs[:, None], w, stacked, weights=weights, reduction="sum",
            grouped_metrics=True,
        )  # fmt: skip

    def materialized(h, w, labels, **options):
        return losses.cross_entropy(head.unembed(h, w), labels, **options)

    def temp_bytes(loss_fn):
        step = jax.jit(
            jax.value_and_grad(
                functools.partial(mtp_loss, loss_fn), (0, 1), has_aux=True
            )
        )
        compiled = step.lower(hs, w, labels).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    fused_bytes = temp_bytes(fused.fused_cross_entropy)
    materialized_bytes = temp_bytes(materialized)
    assert materialized_bytes > (k + 1) * n * v * 4  # the logits alone
    assert fused_bytes < materialized_bytes / 16


@pytest.mark.parametrize("design", ["sequential", "parallel"])
def test_cached_decoding_runs_the_depths_as_the_full_pass(design):
    """Verification feeds several tokens at once and gives the full pass's
    logits; the depths' proposals equal their argmax on the full sequence
    that holds the proposals before them (the sequential staircase)."""
    model = mtp_model(design, heads=3)
    params = init(model)
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, VOCAB)
    _, cache = inference.prefill(model, params, tokens[:, :5], mtp=True)
    step = inference.make_step_fn(model)
    logits, cache = step.verify(params, tokens[:, 5:8], cache)
    full = jax.jit(model.apply)({"params": params}, tokens)
    np.testing.assert_allclose(logits, full[:, 5:8], atol=1e-5)
    drafts = proposals(model, 3, params, cache, tokens[:, 8])
    sequence = jnp.concatenate([tokens[:, :9], drafts[:, :2]], axis=1)
    np.testing.assert_array_equal(
        drafts, jnp.argmax(depth_logits(model, params, sequence)[:, :, 7], -1).T
    )


def test_rewound_positions_leave_nothing_that_attention_reads():
    """Feed three tokens, keep one: the next step's logits are those of the
    sequence with the kept token only (and the depths' proposals too)."""
    model = mtp_model("sequential", heads=2)
    params = init(model)
    tokens = jax.random.randint(jax.random.key(4), (2, 10), 0, VOCAB)
    step = inference.make_step_fn(model)
    _, cache = inference.prefill(model, params, tokens[:, :4], mtp=True)
    wrong = (tokens[:, 4:7] + 1) % VOCAB
    _, cache = step.verify(params, wrong.at[:, 0].set(tokens[:, 4]), cache)
    cache = step.rewind(cache, jnp.array([2, 2]))
    logits, cache = step(params, tokens[:, 5], cache)
    full = jax.jit(model.apply)({"params": params}, tokens[:, :6])
    np.testing.assert_allclose(logits, full[:, -1], atol=1e-5)
    drafts = proposals(model, 2, params, cache, tokens[:, 6])
    sequence = jnp.concatenate([tokens[:, :7], drafts[:, :1]], axis=1)
    np.testing.assert_array_equal(
        drafts, jnp.argmax(depth_logits(model, params, sequence)[:, :, 5], -1).T
    )


def test_config_builds_the_heads_and_counts_their_flops():
    config = default.get_config("tiny")
    config.model.mtp_heads = 2
    config.model.mtp_design = "parallel"
    configuration.validate_config(config)
    model = configuration.make_model(config, vocab_size=VOCAB)
    assert (model.mtp_heads, model.mtp_design) == (2, "parallel")
    plain = configuration.make_model(default.get_config("tiny"), vocab_size=VOCAB)
    d, f, t = 32, 64, 16
    per_depth = 6 * (4 * d * d + 2 * d * f + VOCAB * d) + 6 * t * d
    assert (
        model_lib.training_flops_per_token(model)
        - model_lib.training_flops_per_token(plain)
        == 2 * per_depth
    )


@pytest.mark.parametrize(
    "key, value, error, words",
    [
        ("model.mtp_heads", -1, ValueError, "config.model.mtp_heads"),
        ("model.mtp_design", "tree", ValueError, "config.model.mtp_design"),
        ("model.mtp_unembedding", "tied", ValueError, "config.model.mtp_unembedding"),
        ("loss.mtp_weight", -0.1, ValueError, "config.loss.mtp_weight"),
    ],
)
def test_bad_config_values_are_refused_by_name(key, value, error, words):
    config = default.get_config("tiny")
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(error, match=words):
        configuration.validate_config(config)


def test_bad_model_arguments_name_the_field():
    with pytest.raises(ValueError, match="mtp_design"):
        init(mtp_model(design="tree"))
    with pytest.raises(ValueError, match="mtp_heads"):
        init(mtp_model(heads=-2))
    with pytest.raises(ValueError, match="mtp_heads >= 1"):
        kv_cache.init_cache(mtp_model(heads=0), 2, mtp=True)
    model = mtp_model(heads=1)
    params, (tokens, labels, weights) = init(model), batch()
    for keywords, words in (
        (dict(reduction="sum"), "reduction is not a keyword of a model with MTP"),
        (dict(mtp_weight=-0.3), "mtp_weight must be a finite number >= 0; got -0.3"),
        (dict(mtp_weight=float("nan")), "mtp_weight must be a finite number >= 0"),
    ):
        with pytest.raises(ValueError, match=words):
            model.apply(
                {"params": params}, tokens, labels, weights, method=DecoderLM.loss,
                **keywords,
            )  # fmt: skip
