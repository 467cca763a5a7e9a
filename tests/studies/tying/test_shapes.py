"""Tests for lmhead/studies/tying/shapes.py: the closed-form parameter count
against the model's own init."""

import jax
import jax.numpy as jnp
import pytest

from lmhead.lm import model
from lmhead.studies.tying import shapes


@pytest.mark.parametrize(
    "arch",
    [
        shapes.Architecture(4, 64, use_bias=False),
        shapes.Architecture(2, 16, positions="rope", use_bias=True, head_bias=True),
    ],
)
@pytest.mark.parametrize(
    "shape", [shapes.Shape(True, 24, 2, 40), shapes.Shape(False, 16, 3, 7)]
)
def test_count_params_matches_the_models_init(arch, shape):
    decoder = model.DecoderLM(
        vocab_size=37,
        num_heads=arch.num_heads,
        max_len=arch.max_len,
        positions=arch.positions,
        use_bias=arch.use_bias,
        head_bias=arch.head_bias,
        tied=shape.tied,
        d_model=shape.d_model,
        num_layers=shape.num_layers,
        mlp_dim=shape.mlp_dim,
    )
    abstract = jax.eval_shape(
        decoder.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)
    )
    assert shapes.count_params(37, shape, arch) == sum(
        x.size for x in jax.tree.leaves(abstract)
    )


def test_arm_shapes_match_the_counts_and_refuse_an_impossible_match():
    """c matches a's count and d matches b's, within the tolerance, at every
    vocabulary size; a target no shape can reach is refused."""
    base = shapes.Shape(True, 32, 2, 128)
    for vocab_size in (84, 300, 2048):
        arms = shapes.arm_shapes(vocab_size, base)
        count = {arm: shapes.count_params(vocab_size, s) for arm, s in arms.items()}
        assert count["b"] - count["a"] == vocab_size * 32
        assert abs(count["c"] - count["a"]) <= shapes.MATCH_TOLERANCE * count["a"]
        assert abs(count["d"] - count["b"]) <= shapes.MATCH_TOLERANCE * count["b"]
        assert not arms["c"].tied and arms["c"].d_model <= 32
        assert arms["d"].tied and arms["d"].num_layers >= 2
    with pytest.raises(ValueError, match="No shape matches 10 parameters"):
        shapes.narrower_untied(2048, base, 10)
