"""Tests of the decoder-only Transformer and its decoding API (prefill, the step).

References: a float64 numpy forward pass written here, the model's own full
forward pass (for decoding), and the numpy cross-entropy of tests/references.py
on its logits. The cache's own contract (spans, pieces, pointers) is tested in
test_kv_cache.py; the tied table's gradient, the sum of its two uses, in
test_modules.py against numpy and in test_untie.py through training steps.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from scipy import special

from lmhead import decoding
from lmhead.lm import inference
from lmhead.lm import model as model_lib
from lmhead.lm.model import DecoderLM
from tests import references
from tests.errors import bad_input_test, keyword_rows
from tests.lm.tiny_decoder import (
    HEADS,
    LAYERS,
    MAX_LEN,
    VOCAB,
    WIDTH,
    forward,
    init_params,
    random_tokens,
    small_model,
)


def num_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def reference_logits(params, tokens, *, num_heads, rope, tied=True, epsilon=1e-5):
    """float64 numpy forward pass of DecoderLM (RoPE written with complex
    numbers); a missing ``bias`` entry is a zero bias."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    tokens = np.asarray(tokens)
    batch, time = tokens.shape

    def layer_norm(x, norm):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + epsilon) * norm["scale"] + norm.get("bias", 0)

    def dense(x, layer):
        return x @ layer["kernel"] + layer.get("bias", 0)

    def rotary(x):  # x: [B, T, H, Dh]; pairs (i, i + Dh/2) as complex numbers
        half = x.shape[-1] // 2
        theta = 10000.0 ** (-np.arange(half) / half)
        turn = np.exp(1j * np.arange(time)[:, None] * theta)[None, :, None, :]
        z = (x[..., :half] + 1j * x[..., half:]) * turn
        return np.concatenate([z.real, z.imag], axis=-1)

    x = p["embed"]["embedding"][tokens]
    if not rope:
        x = x + p["position_embedding"][:time]
    future = np.triu(np.ones((time, time), bool), k=1)
    for i in range(sum(name.startswith("blocks_") for name in p)):
        block = p[f"blocks_{i}"]
        q, k, v = np.split(
            dense(layer_norm(x, block["attention_norm"]), block["attention"]["qkv"]),
            3,
            axis=-1,
        )
        q, k, v = (a.reshape(batch, time, num_heads, -1) for a in (q, k, v))
        if rope:
            q, k = rotary(q), rotary(k)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        weights = special.softmax(np.where(future, -np.inf, scores), axis=-1)
        attended = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, time, -1)
        x = x + dense(attended, block["attention"]["out"])
        y = dense(layer_norm(x, block["mlp_norm"]), block["mlp_in"])
        y = 0.5 * y * (1 + special.erf(y / np.sqrt(2)))
        x = x + dense(y, block["mlp_out"])
    h = layer_norm(x, p["final_norm"])
    table = p["embed"]["embedding"] if tied else p["head"]["unembedding"]
    return h @ table.T


@pytest.mark.parametrize("positions,tied", [("learned", True), ("rope", False)])
def test_forward_matches_numpy_reference(positions, tied):
    model = small_model(positions=positions, tied=tied)
    params = init_params(model, noise=0.2)
    tokens = random_tokens((2, 9))
    logits = forward(model, params, tokens)
    assert logits.shape == (2, 9, VOCAB) and logits.dtype == jnp.float32
    expected = reference_logits(
        params, tokens, num_heads=HEADS, rope=positions == "rope", tied=tied
    )
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    # The head is the final hidden state times the (tied or untied) table.
    h = jax.jit(functools.partial(model.apply, method=DecoderLM.hidden))(
        {"params": params}, tokens
    )
    table = params["embed"]["embedding"] if tied else params["head"]["unembedding"]
    expected = np.asarray(h, np.float64) @ np.asarray(table, np.float64).T
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_without_bias_has_no_biases_and_matches_numpy_reference():
    model = small_model(use_bias=False, tied=False)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    names = traverse_util.flatten_dict(shapes["params"], sep="/")
    assert not [name for name in names if name.endswith("bias")]
    with_bias = jax.eval_shape(
        small_model(tied=False).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)
    )
    # Per block: qkv 3D, out D, mlp_in F, mlp_out D, two norms 2D; final norm D.
    per_block = 3 * WIDTH + WIDTH + 64 + WIDTH + 2 * WIDTH
    assert (
        num_params(with_bias["params"]) - num_params(shapes["params"])
        == LAYERS * per_block + WIDTH
    )
    params = init_params(model, noise=0.2)
    # Tiny embeddings: the first LayerNorm's input variance (~1e-6) is below
    # epsilon, so the result depends on epsilon's value.
    for table in ("embed", "position_embedding"):
        params[table] = jax.tree.map(lambda x: x * 1e-3, params[table])
    tokens = random_tokens((2, 9))
    logits = forward(model, params, tokens)
    expected = reference_logits(params, tokens, num_heads=HEADS, rope=False, tied=False)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    flax_epsilon = reference_logits(
        params, tokens, num_heads=HEADS, rope=False, tied=False, epsilon=1e-6
    )
    assert np.abs(flax_epsilon - expected).max() > 1e-2


def test_tied_has_exactly_vocab_times_width_fewer_params():
    def shapes(model):
        return jax.eval_shape(
            model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)
        )["params"]

    tied, untied = shapes(small_model(tied=True)), shapes(small_model(tied=False))
    assert num_params(untied) - num_params(tied) == VOCAB * WIDTH
    assert "head" not in tied
    assert untied["head"]["unembedding"].shape == (VOCAB, WIDTH)
    assert "position_embedding" not in shapes(small_model(positions="rope"))


@pytest.mark.parametrize("donate", [False, True])
def test_greedy_generate_through_the_cache_matches_full_recompute_argmax(donate):
    """Ragged rows decode the argmax of the full model's recomputation; with
    ``donate_state=True`` the loop writes the prefilled cache in place and
    the caller's cache is consumed."""
    model = small_model()
    params = init_params(model, noise=0.2)
    lengths = np.array([5, 2, 3])
    num_steps = MAX_LEN - lengths.max()
    prompt = random_tokens((3, 5), seed=4)
    logits, cache = inference.prefill(
        model, params, prompt, jnp.asarray(lengths), max_new_tokens=num_steps
    )
    tokens, *_ = decoding.generate(
        inference.make_step_fn(model),
        params,
        logits,
        cache,
        key=jax.random.key(0),
        max_new_tokens=num_steps,
        temperature=0.0,
        donate_state=donate,
    )
    consumed = [leaf.is_deleted() for leaf in jax.tree.leaves(cache)]
    assert all(consumed) if donate else not any(consumed)
    padded = np.zeros((3, MAX_LEN), np.int32)
    padded[:, :5] = np.asarray(prompt)
    for step in range(num_steps):
        full = forward(model, params, jnp.asarray(padded))
        last = lengths + step - 1
        padded[np.arange(3), last + 1] = np.argmax(full[np.arange(3), last], axis=-1)
    expected = np.stack([padded[b, n : n + num_steps] for b, n in enumerate(lengths)])
    np.testing.assert_array_equal(tokens, expected)


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    model = small_model(positions="rope", tied=False)
    params = init_params(model, noise=0.2)
    tokens = random_tokens((1, 10))
    changed = tokens.at[0, 6].set((tokens[0, 6] + 1) % VOCAB)
    before, after = forward(model, params, tokens), forward(model, params, changed)
    np.testing.assert_array_equal(before[:, :6], after[:, :6])
    assert np.abs(before[:, 6:] - after[:, 6:]).min(axis=-1).max() > 1e-3


def test_bfloat16_compute_is_close_to_float32():
    model32, model16 = small_model(), small_model(dtype=jnp.bfloat16)
    params = init_params(model32, noise=0.05)
    tokens = random_tokens((2, 12))
    logits32 = forward(model32, params, tokens)
    logits16 = forward(model16, params, tokens)
    assert logits16.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(init_params(model16)))
    scale = np.abs(logits32).max()
    assert np.abs(logits16 - logits32).max() < 0.05 * scale
    assert np.abs(logits16 - logits32).max() > 0  # bf16 really ran
    logits, cache = inference.prefill(model16, params, tokens)
    assert cache.keys[0][0].dtype == jnp.bfloat16
    assert np.abs(logits - logits32[:, -1]).max() < 0.05 * scale


def test_residual_projections_init_std_is_scaled_by_depth():
    params = init_params(small_model(tied=False))
    flat = traverse_util.flatten_dict(params, sep="/")

    def entries(*suffixes):
        return np.concatenate(
            [np.ravel(x) for name, x in flat.items() if name.endswith(suffixes)]
        )

    residual = entries("attention/out/kernel", "mlp_out/kernel")
    # embed/embedding, position_embedding and head/unembedding.
    others = entries("qkv/kernel", "mlp_in/kernel", "embedding")
    # 6k and 11k samples: the sample std is within 5% at more than 5 sigma.
    np.testing.assert_allclose(residual.std(), 0.02 / np.sqrt(2 * LAYERS), rtol=0.05)
    np.testing.assert_allclose(others.std(), 0.02, rtol=0.05)
    assert abs(residual.mean()) < 1e-3
    np.testing.assert_array_equal(entries("bias"), 0.0)
    np.testing.assert_array_equal(params["final_norm"]["scale"], 1.0)


def test_loss_equals_cross_entropy_of_the_logits():
    model = small_model(positions="rope", tied=False)
    params = init_params(model, noise=0.1)
    tokens = random_tokens((2, 9))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    weights = jnp.asarray(
        np.random.default_rng(3).integers(0, 2, labels.shape), jnp.float32
    )
    options = dict(label_smoothing=0.1, z_loss=1e-3)
    loss, metrics = jax.jit(
        functools.partial(model.apply, method=DecoderLM.loss, **options)
    )({"params": params}, inputs, labels, weights)
    _, expected = references.cross_entropy(
        forward(model, params, inputs), labels, weights, eps=0.1, z_loss=1e-3
    )
    np.testing.assert_allclose(loss, expected["loss"], rtol=1e-5)
    for name in ("nll", "z_loss", "accuracy"):
        np.testing.assert_allclose(metrics[name], expected[name], rtol=1e-5)


def test_dropout_needs_train_and_an_rng():
    model = small_model(num_layers=1, dropout_rate=0.5)
    params = init_params(model)
    tokens = random_tokens((1, 6))
    train = jax.jit(
        lambda key: model.apply(
            {"params": params}, tokens, train=True, rngs={"dropout": key}
        )
    )
    evaluation = forward(model, params, tokens)
    first, again = train(jax.random.key(1)), train(jax.random.key(1))
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - evaluation).max() > 1e-3


def decoder(**overrides):
    return DecoderLM(
        **{
            "vocab_size": 17,
            "num_layers": 1,
            "num_heads": 2,
            "d_model": 8,
            "mlp_dim": 16,
            "max_len": 8,
            **overrides,
        }
    )


def decoder_init(tokens=None, **overrides):
    tokens = jnp.ones((1, 4), jnp.int32) if tokens is None else tokens
    return decoder(**overrides).init(jax.random.key(0), tokens)


PROMPTS = jnp.zeros((3, 5), jnp.int32)


def prefill(prompt=PROMPTS, lengths=None, **kwargs):
    """The prefill's checks come before the parameters are used."""
    return inference.prefill(decoder(), None, prompt, lengths, **kwargs)


MAX_LEN_TOO = ("max_new_tokens", "max_len")
# Each raises exactly this type, with a message that names the argument.
BAD_INPUTS = [
    *keyword_rows("DecoderLM", decoder_init, [
        ("num_heads", dict(num_heads=3), ValueError, ("num_heads", "d_model")),
        ("positions", dict(positions="alibi"), ValueError),
        ("rope odd head", dict(positions="rope", num_heads=8), ValueError,
         "positions"),
        ("dropout_rate 1", dict(dropout_rate=1.0), ValueError),
        ("float tokens", dict(tokens=jnp.ones((1, 4))), TypeError),
        ("token = V", dict(tokens=jnp.full((1, 4), 17)), ValueError),
        ("tokens past max_len", dict(tokens=jnp.ones((1, 9), jnp.int32)), ValueError,
         ("tokens", "max_len")),
        ("num_layers 0", dict(num_layers=0), ValueError),
    ]),
    *keyword_rows("prefill", prefill, [
        ("prompt + max_new_tokens",
         dict(prompt=jnp.ones((1, 4), jnp.int32), max_new_tokens=5), ValueError,
         MAX_LEN_TOO),
        ("the longest real row + max_new_tokens",
         dict(lengths=jnp.array([3, 2, 4]), max_new_tokens=5), ValueError,
         MAX_LEN_TOO),
        ("lengths 0", dict(lengths=jnp.array([0, 2, 5])), ValueError),
        ("lengths shape", dict(lengths=jnp.array([1, 2])), ValueError,
         ("lengths", "[B]")),
        ("prompt past max_len", dict(prompt=jnp.zeros((1, 9), jnp.int32)), ValueError,
         ("prompt", "max_len")),
    ]),
    ("step tokens [B]",
     lambda: inference.make_step_fn(decoder())(None, PROMPTS, None),
     ValueError, "tokens"),
]  # fmt: skip


test_bad_input_raises_exactly_and_names_the_argument = bad_input_test(BAD_INPUTS)


def test_decoding_embeds_no_parameter_as_a_constant():
    """params is an argument of the decoding loop: no parameter appears as a
    constant in the lowered program (test_generation counts the compiled
    loops of two parameter sets)."""
    model = small_model()
    step_fn = inference.make_step_fn(model)
    prompt = random_tokens((2, 3), seed=5)

    params = init_params(model)
    logits, cache = inference.prefill(model, params, prompt, max_new_tokens=6)
    text = (
        jax.jit(
            lambda params, logits, cache: decoding.generate(
                step_fn,
                params,
                logits,
                cache,
                key=jax.random.key(0),
                max_new_tokens=6,
                temperature=0.0,
            )
        )
        .lower(params, logits, cache)
        .as_text()
    )
    sizes = [
        int(np.prod([int(d) for d in shape.split("x")[:-1]] or [1]))
        for shape in re.findall(
            r"stablehlo\.constant dense<.*?> : tensor<([^>]*)>", text
        )
    ]
    assert sizes and max(sizes) < WIDTH, sorted(sizes)[-5:]


def test_sown_attention_weights_match_numpy_from_the_layers_queries_and_keys():
    """Each layer's sown weights are the causal softmax of q k^T / sqrt(Dh)
    computed here from that layer's qkv output (captured by Flax, not sown),
    and the attention's output projection is applied to weights @ v."""
    model = small_model()
    params = init_params(model, noise=0.3)
    tokens = random_tokens((2, 7), seed=3)
    maps = model_lib.attention_weights(model, params, tokens)
    _, state = model.apply(
        {"params": params},
        tokens,
        capture_intermediates=True,
        mutable=["intermediates"],
    )
    captured = state["intermediates"]
    assert len(maps) == LAYERS
    future = np.triu(np.ones((7, 7), bool), k=1)
    for i, weights in enumerate(maps):
        weights = np.asarray(weights, np.float64)
        assert weights.shape == (2, HEADS, 7, 7)
        layer = captured[f"blocks_{i}"]["attention"]
        qkv = np.asarray(layer["qkv"]["__call__"][0], np.float64)
        q, k, v = (a.reshape(2, 7, HEADS, -1) for a in np.split(qkv, 3, axis=-1))
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        expected = special.softmax(np.where(future, -np.inf, scores), axis=-1)
        np.testing.assert_allclose(weights, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
        assert np.all(weights[..., future] == 0.0)
        out = params[f"blocks_{i}"]["attention"]["out"]
        attended = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(2, 7, WIDTH)
        np.testing.assert_allclose(
            layer["out"]["__call__"][0],
            attended @ out["kernel"] + out["bias"],
            rtol=1e-4,
            atol=1e-5,
        )
        # The same sown array, from an apply outside jit.
        np.testing.assert_allclose(
            weights, layer["attention_weights"][0], rtol=1e-5, atol=1e-6
        )


def test_a_plain_apply_sows_nothing():
    model = small_model()
    params = init_params(model)
    tokens = random_tokens((1, 5))
    logits = jax.jit(model.apply)({"params": params}, tokens)
    assert logits.shape == (1, 5, VOCAB)  # an array, not (logits, state)
    _, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
    assert set(state["intermediates"]) == {f"blocks_{i}" for i in range(LAYERS)}


def test_prefill_checks_the_longest_real_row_not_the_padding():
    params = decoder_init()["params"]
    # 4 + 4 fits max_len 8 where the padded 5 + 4 would not.
    logits, cache = inference.prefill(
        decoder(), params, PROMPTS, jnp.array([3, 2, 4]), max_new_tokens=4
    )
    assert logits.shape == (3, 17) and cache.index.tolist() == [3, 2, 4]
