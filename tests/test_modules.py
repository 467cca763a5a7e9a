"""Tests for lmhead/modules.py: which array the head uses, and its gradients."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmhead import modules, vocab_parallel
from tests import loss_scalars, references
from tests.errors import bad_input_test, keyword_rows

V, D = 11, 6


def count_params(variables):
    return sum(x.size for x in jax.tree.leaves(variables.get("params", {})))


def random_inputs(seed, batch_shape=(2, 3)):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal(batch_shape + (D,)).astype(np.float32)
    table = rng.standard_normal((V, D)).astype(np.float32)
    return h, table


class TiedLM(nn.Module):
    """Embedding and tied head sharing one table, passed as module or array."""

    pass_module: bool = True
    scale: float | None = None

    def setup(self):
        self.embed = nn.Embed(V, D)
        self.head = modules.LMHead(V, tied=True, scale=self.scale)

    def _table(self):
        return self.embed if self.pass_module else self.embed.embedding

    def __call__(self, tokens):
        return self.head(self.embed(tokens), self._table())

    def loss(self, tokens, labels):
        return self.head.loss(
            self.embed(tokens), labels, self._table(), loss_impl="materialized"
        )


class ParametersTest(chex.TestCase):
    def test_tied_owns_no_unembedding_untied_owns_v_by_d(self):
        h, table = random_inputs(0)
        key = jax.random.key(0)
        for use_bias in (False, True):
            tied = modules.LMHead(V, tied=True, use_bias=use_bias).init(key, h, table)
            untied = modules.LMHead(V, tied=False, use_bias=use_bias).init(key, h)
            tied_shapes = jax.tree.map(jnp.shape, tied.get("params", {}))
            untied_shapes = jax.tree.map(jnp.shape, untied["params"])
            bias = {"bias": (V,)} if use_bias else {}
            self.assertEqual(tied_shapes, bias)
            self.assertEqual(untied_shapes, {"unembedding": (V, D), **bias})
            self.assertEqual(count_params(untied) - count_params(tied), V * D)
        bf16 = modules.LMHead(V, tied=False, use_bias=True, param_dtype=jnp.bfloat16)
        for leaf in jax.tree.leaves(bf16.init(key, h)):
            self.assertEqual(leaf.dtype, jnp.bfloat16)


class LogitsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_tied_logits_are_h_times_table_transposed(self):
        h, table = random_inputs(2)
        head = modules.LMHead(V, tied=True, scale=0.5, softcap=1.5)
        variables = jax.jit(head.init)(jax.random.key(0), h, table)
        got = self.variant(head.apply)(variables, h, table)
        want = references.unembed(h, table, scale=0.5, softcap=1.5)
        self.assertEqual(got.shape, (2, 3, V))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # The nn.Embed module or its table: the same logits.
        tokens = jnp.array([[1, 4, 7], [0, 10, 3]])
        variables = TiedLM().init(jax.random.key(1), tokens)
        table = np.asarray(variables["params"]["embed"]["embedding"])
        self.assertEqual(count_params(variables), V * D)
        want = table[np.asarray(tokens)].astype(np.float64) @ table.T
        for pass_module in (True, False):
            got = self.variant(TiedLM(pass_module=pass_module).apply)(variables, tokens)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_untied_logits_use_the_own_matrix_and_bias(self):
        h, table = random_inputs(3)
        head = modules.LMHead(V, tied=False, use_bias=True)
        bias = np.linspace(-1.0, 1.0, V).astype(np.float32)
        variables = {"params": {"unembedding": table, "bias": bias}}
        chex.assert_trees_all_equal_shapes(
            variables, jax.jit(head.init)(jax.random.key(0), h)
        )
        got = self.variant(head.apply)(variables, h)
        np.testing.assert_allclose(
            got, references.unembed(h, table, bias), rtol=1e-5, atol=1e-6
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_bf16_dtype_returns_float32_logits(self):
        h, table = random_inputs(4)
        for tied in (True, False):
            head = modules.LMHead(V, tied=tied, dtype=jnp.bfloat16)
            embedding = table if tied else None
            variables = {} if tied else {"params": {"unembedding": table}}
            got = self.variant(head.apply)(variables, h, embedding)
            self.assertEqual(got.dtype, jnp.float32)
            rounded = [
                np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (h, table)
            ]
            np.testing.assert_allclose(
                got, rounded[0] @ rounded[1].T, rtol=1e-4, atol=1e-4
            )


class TiedGradientTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_gradient_is_the_sum_of_the_embedding_and_head_paths(self):
        tokens = np.array([[1, 4, 1], [0, 10, 3]])
        labels = np.array([[4, 1, 0], [10, 3, 2]])
        scale = D**-0.5
        model = TiedLM(pass_module=True, scale=scale)
        variables = jax.jit(model.init)(jax.random.key(2), tokens)

        def objective(params):
            return model.apply({"params": params}, tokens, labels, method=TiedLM.loss)[
                0
            ]

        grad = self.variant(jax.grad(objective))(variables["params"])
        self.assertEqual(
            jax.tree.map(jnp.shape, grad), {"embed": {"embedding": (V, D)}}
        )

        # By hand: x = E[tokens], z = s x E^T, L = mean_t CE(z_t, y_t).
        table = np.asarray(variables["params"]["embed"]["embedding"], np.float64)
        x = table[tokens.reshape(-1)]
        z = scale * x @ table.T
        dz = references.cross_entropy_gradient(z, labels.reshape(-1))
        through_head = scale * dz.T @ x
        through_embedding = np.zeros_like(table)
        np.add.at(through_embedding, tokens.reshape(-1), scale * dz @ table)
        self.assertGreater(np.abs(through_head).max(), 1e-3)
        self.assertGreater(np.abs(through_embedding).max(), 1e-3)
        np.testing.assert_allclose(
            grad["embed"]["embedding"],
            through_head + through_embedding,
            rtol=1e-4,
            atol=1e-7,
        )


class LossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_loss_equals_cross_entropy_of_the_logits(self):
        h, table = random_inputs(5)
        rng = np.random.default_rng(5)
        labels = rng.integers(0, V, (2, 3)).astype(np.int32)
        weights = np.array([[1.0, 0.0, 2.0], [1.0, 1.0, 0.5]], np.float32)
        options = dict(label_smoothing=0.1, smoothing="normalized", z_loss=1e-3)
        for tied in (True, False):
            head = modules.LMHead(V, tied=tied, use_bias=True, scale=0.8)
            embedding = table if tied else None
            variables = jax.jit(head.init)(jax.random.key(0), h, embedding)
            loss, metrics = self.variant(
                functools.partial(
                    head.apply,
                    method=modules.LMHead.loss,
                    loss_impl="materialized",
                    **options,
                )
            )(variables, h, labels, embedding, weights=weights)
            w = variables["params"].get("unembedding", table)
            z = references.unembed(h, w, variables["params"]["bias"], scale=0.8)
            _, want = references.cross_entropy(
                z, labels, weights, 0.1, "normalized", 1e-3
            )
            np.testing.assert_allclose(loss, want["loss"], rtol=1e-5)
            for name in ("nll", "z_loss", "accuracy", "weight_sum"):
                np.testing.assert_allclose(metrics[name], want[name], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_every_loss_impl_drops_a_token_of_ignored_label(self):
        h, table = random_inputs(7)
        labels = np.random.default_rng(7).integers(0, V, (2, 3)).astype(np.int32)
        marked = labels.copy()
        marked[0, 1] = marked[1, 2] = -100
        kept = marked != -100
        _, want = references.cross_entropy(
            references.unembed(h[kept], table), labels[kept], None, 0.1
        )
        head = modules.LMHead(V, tied=True)
        mesh = jax.make_mesh(
            (1, 1),
            (vocab_parallel.DATA_AXIS, vocab_parallel.MODEL_AXIS),
            (jax.sharding.AxisType.Auto,) * 2,
            devices=jax.devices()[:1],
        )
        for impl in modules.LOSS_IMPLS:
            loss_fn = functools.partial(
                head.apply, loss_impl=impl, label_smoothing=0.1, method="loss"
            )
            with jax.set_mesh(mesh):
                loss, metrics = self.variant(loss_fn)({}, h, marked, table)
            np.testing.assert_allclose(loss, want["loss"], rtol=1e-5, err_msg=impl)
            self.assertEqual(float(metrics["weight_sum"]), kept.sum())


class TracedLossScalarsTest(chex.TestCase):
    def test_every_loss_impl_takes_the_values_of_members_traced(self):
        # What an ensemble's step does: one value per member, under vmap.
        h, table = random_inputs(6)
        labels = np.random.default_rng(6).integers(0, V, (2, 3)).astype(np.int32)
        head = modules.LMHead(V, tied=True)
        mesh = jax.make_mesh(
            (1, 1),
            (vocab_parallel.DATA_AXIS, vocab_parallel.MODEL_AXIS),
            (jax.sharding.AxisType.Auto,) * 2,
            devices=jax.devices()[:1],
        )

        def losses_of_every_impl(label_smoothing, z_loss):
            return {
                impl: head.apply(
                    {},
                    h,
                    labels,
                    table,
                    loss_impl=impl,
                    label_smoothing=label_smoothing,
                    smoothing="normalized",
                    z_loss=z_loss,
                    method="loss",
                )
                for impl in modules.LOSS_IMPLS
            }

        with jax.set_mesh(mesh):
            loss_scalars.assert_members_match_static_calls(losses_of_every_impl)


# Bad input raises exactly its error, naming the argument (tests/errors.py).

H = jnp.ones((2, 3, 4))
W = jnp.ones((5, 4))
KEY = jax.random.key(0)


def tied_logits(embedding=None, h=H):
    return modules.LMHead(5, tied=True).apply({}, h, embedding)


def lm_head_loss(loss_impl="fused", h=H, **kwargs):
    return modules.LMHead(5, tied=True).apply(
        {}, h, jnp.zeros((2, 3), int), W, loss_impl=loss_impl, method="loss", **kwargs
    )


class WrongSizeEmbed(nn.Module):
    """A tied head handed an ``nn.Embed`` of one token too many."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(6, 4)
        return modules.LMHead(5, tied=True)(embed(tokens), embed)


# Fields are checked when the module is built.
FIELDS = [
    ("vocab_size 0", dict(vocab_size=0), ValueError, "vocab_size"),
    ("vocab_size < 0", dict(vocab_size=-1), ValueError, "vocab_size"),
    ("vocab_size float", dict(vocab_size=5.0), TypeError, "vocab_size"),
    ("vocab_size bool", dict(vocab_size=True), TypeError, "vocab_size"),
    ("tied string", dict(vocab_size=5, tied="no"), TypeError, "tied"),
    ("use_bias int", dict(vocab_size=5, use_bias=1), TypeError, "use_bias"),
    ("scale 0", dict(vocab_size=5, scale=0.0), ValueError, "scale"),
    ("softcap inf", dict(vocab_size=5, softcap=float("inf")), ValueError, "softcap"),
]
TIED = [
    ("without embedding", dict(), ValueError, ("embedding", "tied")),
    ("table [V, D - 1]", dict(embedding=jnp.ones((5, 3))), ValueError, "embedding"),
    ("table [V + 1, D]", dict(embedding=jnp.ones((6, 4))), ValueError, "embedding"),
    ("table [D, V]", dict(embedding=jnp.ones((4, 5))), ValueError, "embedding"),
    ("table flat", dict(embedding=jnp.ones(20)), ValueError, "embedding"),
]
LOSS = [
    ("integer h", dict(h=H.astype(int)), TypeError, "h"),
    ("loss_impl", dict(loss_impl="chunked"), ValueError, "loss_impl"),
    (
        "chunk_size with materialized",
        dict(loss_impl="materialized", chunk_size=4),
        ValueError,
        ("chunk_size", "loss_impl"),
    ),
]
UNTIED = modules.LMHead(5, tied=False)
BAD_INPUTS = [
    *keyword_rows("LMHead", modules.LMHead, FIELDS),
    *keyword_rows("LMHead tied", tied_logits, TIED),
    *keyword_rows("LMHead loss", lm_head_loss, LOSS),
    (
        "LMHead tied nn.Embed of V + 1",
        lambda: WrongSizeEmbed().init(KEY, jnp.zeros(2, int)),
        ValueError,
        "embedding",
    ),
    (
        "LMHead untied with embedding",
        lambda: UNTIED.init(KEY, H, W),
        ValueError,
        ("embedding", "tied"),
    ),
    ("LMHead integer h", lambda: UNTIED.init(KEY, H.astype(int)), TypeError, "h"),
    ("LMHead untied D = 0", lambda: UNTIED.init(KEY, H[..., :0]), ValueError, "w"),
]


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
