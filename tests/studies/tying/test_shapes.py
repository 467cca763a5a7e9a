"""Tests for studies/tying/shapes.py: the closed-form parameter count
against the model's own init."""

import jax
import jax.numpy as jnp
import pytest

from lmhead.lm import model
from studies.tying import shapes


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
    """c matches a's count within the tolerance at every vocabulary size; d
    adds the whole blocks b's extra V * D pays for, and exists only where it
    pays for one; e is b's shape; a target no shape can reach is refused."""
    base = shapes.Shape(True, 32, 2, 128)
    block = shapes.count_params(
        1, shapes.Shape(True, 32, 3, 128)
    ) - shapes.count_params(1, base)
    assert shapes.block_params(base) == block
    for vocab_size in (84, 300, 2048):
        arms = shapes.arm_shapes(vocab_size, base)
        count = {arm: shapes.count_params(vocab_size, s) for arm, s in arms.items()}
        assert count["b"] - count["a"] == vocab_size * 32
        assert abs(count["c"] - count["a"]) <= shapes.MATCH_TOLERANCE * count["a"]
        assert not arms["c"].tied and arms["c"].d_model <= 32
        assert arms["e"] == arms["b"]
        blocks = vocab_size * 32 // block
        if blocks == 0:
            assert "d" not in arms
        else:
            assert arms["d"] == shapes.Shape(True, 32, 2 + blocks, 128)
            assert count["b"] - block < count["d"] <= count["b"]
    with pytest.raises(ValueError, match="No shape matches 10 parameters"):
        shapes.narrower_untied(2048, base, 10)


def test_flops_per_token_is_six_times_the_matmul_weights_plus_attention():
    """6 (L (4 D^2 + 2 D F) + V D) + 6 L T D, written out for one shape."""
    shape, arch = shapes.Shape(False, 16, 3, 40), shapes.Architecture(2, 8)
    matmul = 3 * (4 * 16 * 16 + 2 * 16 * 40) + 50 * 16
    assert shapes.flops_per_token(50, shape, arch) == 6 * matmul + 6 * 3 * 8 * 16
