r"""DPO on Shakespeare pairs through the fused head: a tiny runnable example.

    python experiments/dpo_shakespeare.py                 # 300 steps, seconds
    python experiments/dpo_shakespeare.py --steps=30 --log_every=10

A pair is a prompt (the end of a line of the embedded Shakespeare and its
newline), the chosen response (the next line's start) and the rejected one
(another line's start), in characters. The policy is a tiny character
model (an embedding, an MLP over the last ``--context`` characters, and a
tied ``modules.LMHead``); its copy at initialization is the frozen
reference, given to ``LMHead.preference_loss`` as ``reference_head``, so
its log-probs come from a fused sweep that gets no gradient. Each step is
``jax.value_and_grad`` of the sigmoid DPO loss, fused (no ``[N, V]``
logits), with Adam on a fixed set of ``--pairs`` pairs; the log prints the
loss, the reward margin and the reward accuracy, which rise from 0 as the
policy learns to prefer the true continuations. docs/post_training.md shows
a run.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from lmhead import modules
from lmhead.lm.data import corpus

flags.DEFINE_integer("steps", 300, "Adam steps.", lower_bound=1)
flags.DEFINE_integer("pairs", 64, "Pairs, all in every step's batch.", lower_bound=1)
flags.DEFINE_integer("prompt_chars", 16, "Characters of a prompt.", lower_bound=1)
flags.DEFINE_integer("response_chars", 24, "Characters of a response.", lower_bound=1)
flags.DEFINE_integer("context", 8, "Characters the model sees.", lower_bound=1)
flags.DEFINE_integer("width", 64, "The model's D.", lower_bound=1)
flags.DEFINE_float("beta", 0.1, "DPO's beta.")
flags.DEFINE_float("learning_rate", 1e-3, "Adam's learning rate.")
flags.DEFINE_integer("log_every", 50, "Steps between log lines.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the pairs and the parameters.")
FLAGS = flags.FLAGS


class CharModel(nn.Module):
    """Hidden states ``[B, L, D]`` of a window of the last ``context``
    characters, and the embedding table the tied head unembeds with."""

    vocab_size: int
    width: int
    context: int

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab_size, self.width)
        x = embed(tokens)
        length = x.shape[1]
        window = jnp.concatenate(
            [
                jnp.pad(x, ((0, 0), (k, 0), (0, 0)))[:, :length]
                for k in range(self.context)
            ],
            axis=-1,
        )
        h = nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(window)))
        return nn.LayerNorm()(h), embed.embedding


def make_pairs(num_pairs, prompt_chars, response_chars, seed):
    """``(chosen [P, L], rejected [P, L], response mask [L], vocab)``: each row
    is prompt + response in character ids, ``L = prompt + 1 + response``."""
    lines = [line.strip() for line in corpus.load_text().splitlines()]
    starts = [i for i in range(len(lines) - 1) if min(map(len, lines[i : i + 2])) >= 32]
    rng = np.random.default_rng(seed)
    picked = rng.choice(starts, num_pairs, replace=False)
    others = rng.choice(starts, num_pairs, replace=False) + 1
    prompts = [lines[i][-prompt_chars:] + "\n" for i in picked]
    chosen = [p + lines[i + 1][:response_chars] for p, i in zip(prompts, picked)]
    rejected = [p + lines[j][:response_chars] for p, j in zip(prompts, others)]
    vocab = sorted(set("".join(chosen + rejected)))
    index = {c: i for i, c in enumerate(vocab)}

    def encode(rows):
        return np.array([[index[c] for c in row] for row in rows], np.int32)

    mask = np.arange(prompt_chars + 1 + response_chars) > prompt_chars
    return encode(chosen), encode(rejected), mask, vocab


def main(argv):
    del argv
    chosen, rejected, mask, vocab = make_pairs(
        FLAGS.pairs, FLAGS.prompt_chars, FLAGS.response_chars, FLAGS.seed
    )
    model = CharModel(len(vocab), FLAGS.width, FLAGS.context)
    lm_head = modules.LMHead(vocab_size=len(vocab), tied=True)
    params = model.init(jax.random.key(FLAGS.seed), chosen)
    reference = params
    # Position t predicts character t + 1: the mask marks the responses'.
    response = np.broadcast_to(mask[1:], (FLAGS.pairs, mask.size - 1)).astype(
        np.float32
    )

    def loss(params):
        (h_c, table), (h_r, _) = (
            model.apply(params, chosen),
            model.apply(params, rejected),
        )
        (h_rc, table_ref), (h_rr, _) = (
            model.apply(reference, chosen),
            model.apply(reference, rejected),
        )
        return lm_head.apply(
            {},
            h_c[:, :-1],
            h_r[:, :-1],
            chosen[:, 1:],
            rejected[:, 1:],
            response,
            response,
            table,
            method=modules.LMHead.preference_loss,
            reference_head=(h_rc[:, :-1], h_rr[:, :-1], table_ref),
            beta=FLAGS.beta,
        )

    optimizer = optax.adam(FLAGS.learning_rate)

    @jax.jit
    def step(params, opt_state):
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, metrics

    opt_state = optimizer.init(params)
    print(
        f"{FLAGS.pairs} pairs, {len(vocab)} characters, "
        f"{int(mask.sum())}-character responses"
    )
    for i in range(FLAGS.steps + 1):
        new_params, new_opt_state, metrics = step(params, opt_state)
        if i % FLAGS.log_every == 0 or i == FLAGS.steps:
            print(
                f"step {i}: loss {float(metrics['preference_loss']):.4f} "
                f"margin {float(metrics['reward_margin']):.4f} "
                f"accuracy {float(metrics['reward_accuracy']):.2f}",
                flush=True,
            )
        params, opt_state = new_params, new_opt_state


if __name__ == "__main__":
    app.run(main)
