"""Bad inputs, one table per layer: each case must raise exactly the expected
exception type (not a subclass, not an error from deeper down) with a message
that names the argument or config key (as a whole word). The wording around
the name is free to improve, so it is not pinned; where the message must say
more -- the allowed choices, the closest key to a misspelled one -- those
words are pinned too. Error cases live here, not in the per-module tests.

Bad values that cannot be refused inside ``jit`` follow a documented rule
instead (``RULES``), checked with and without ``jit``: never a NaN.

Layers: the pure functions (head, losses, fused, decoding) and the Flax
modules. The experiment's cases live with the modules they test: the config
in tests/lm/test_configuration.py, the data in tests/lm/data/, workdirs and
checkpoints in tests/lm/test_checkpoints.py, the matmul-rate probe in
tests/lm/test_monitoring.py, the command lines in tests/experiments/.

Sweeps with a failing run are tested in tests/lab/test_runner.py (the others
finish, the run is marked FAILED) and tests/lab/test_report.py (the report
lists it).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding, fused, head, losses, modules
from tests.errors import assert_raises_exactly

H = jnp.ones((2, 3, 4))
W = jnp.ones((5, 4))
LOGITS = jnp.zeros((2, 5))
LABELS = jnp.zeros((2,), jnp.int32)
LOGITS_3D = jnp.zeros((2, 3, 5))
LABELS_2D = jnp.zeros((2, 3), jnp.int32)
NAN, INF = float("nan"), float("inf")
TABLE = jnp.log(jnp.full((5, 5), 0.2))
KEY = jax.random.key(0)


def markov(table, tokens, state):
    return table[tokens], state


def generate(**kwargs):
    return decoding.generate(
        markov, TABLE, LOGITS, (), key=KEY, **{"max_new_tokens": 2, **kwargs}
    )


def beam(**kwargs):
    return decoding.beam_search(
        markov,
        TABLE,
        LOGITS,
        (),
        **{"num_beams": 2, "max_new_tokens": 2, "eos_id": None, **kwargs},
    )


def fused_ce(**kwargs):
    return fused.fused_cross_entropy(
        kwargs.pop("h", H[0]),
        kwargs.pop("w", W),
        kwargs.pop("labels", jnp.zeros((3,), jnp.int32)),
        **kwargs,
    )


class Letters:
    def decode(self, ids):
        return "".join("abcde"[i] for i in ids)


PURE = [
    # head.py
    ("unembed integer h", lambda: head.unembed(H.astype(jnp.int32), W), TypeError, "h"),
    ("unembed integer w", lambda: head.unembed(H, W.astype(jnp.int32)), TypeError, "w"),
    (
        "unembed integer bias",
        lambda: head.unembed(H, W, jnp.ones(5, jnp.int32)),
        TypeError,
        "bias",
    ),
    ("unembed scalar h", lambda: head.unembed(jnp.float32(1.0), W), ValueError, "h"),
    ("unembed w rank 1", lambda: head.unembed(H, W[0]), ValueError, "w"),
    ("unembed w rank 3", lambda: head.unembed(H, W[..., None]), ValueError, "w"),
    ("unembed V = 0", lambda: head.unembed(H, W[:0]), ValueError, "w"),
    ("unembed D = 0", lambda: head.unembed(H[..., :0], W[:, :0]), ValueError, "w"),
    ("unembed D mismatch", lambda: head.unembed(jnp.ones((2, 3)), W), ValueError, "h"),
    (
        "unembed bias shape",
        lambda: head.unembed(H, W, jnp.zeros(4)),
        ValueError,
        "bias",
    ),
    (
        "unembed bias [1, V]",
        lambda: head.unembed(H, W, jnp.zeros((1, 5))),
        ValueError,
        "bias",
    ),
    (
        "unembed scalar bias",
        lambda: head.unembed(H, W, jnp.float32(0.0)),
        ValueError,
        "bias",
    ),
    ("unembed scale 0", lambda: head.unembed(H, W, scale=0.0), ValueError, "scale"),
    ("unembed scale < 0", lambda: head.unembed(H, W, scale=-1.0), ValueError, "scale"),
    ("unembed scale inf", lambda: head.unembed(H, W, scale=INF), ValueError, "scale"),
    (
        "unembed softcap 0",
        lambda: head.unembed(H, W, softcap=0.0),
        ValueError,
        "softcap",
    ),
    (
        "unembed softcap < 0",
        lambda: head.unembed(H, W, softcap=-1.0),
        ValueError,
        "softcap",
    ),
    # c * tanh(z / c) would be inf * 0 = NaN.
    (
        "unembed softcap inf",
        lambda: head.unembed(H, W, softcap=INF),
        ValueError,
        "softcap",
    ),
    ("log_probs integer logits", lambda: head.log_probs(LABELS), TypeError, "logits"),
    ("probs integer logits", lambda: head.probs(LABELS), TypeError, "logits"),
    (
        "log_probs scalar logits",
        lambda: head.log_probs(jnp.float32(1.0)),
        ValueError,
        "logits",
    ),
    ("probs scalar logits", lambda: head.probs(jnp.float32(1.0)), ValueError, "logits"),
    ("probs V = 0", lambda: head.probs(LOGITS[:, :0]), ValueError, "logits"),
    # Temperature 0 is greedy decoding, which the message points to.
    (
        "probs temperature 0",
        lambda: head.probs(LOGITS, 0.0),
        ValueError,
        ("temperature", "greedy"),
    ),
    (
        "log_probs temperature int 0",
        lambda: head.log_probs(LOGITS, 0),
        ValueError,
        ("temperature", "greedy"),
    ),
    (
        "probs temperature np.float32 0",
        lambda: head.probs(LOGITS, np.float32(0.0)),
        ValueError,
        ("temperature", "greedy"),
    ),
    (
        "log_probs temperature array 0",
        lambda: head.log_probs(LOGITS, jnp.array(0.0)),
        ValueError,
        ("temperature", "greedy"),
    ),
    (
        "probs temperature < 0",
        lambda: head.probs(LOGITS, -1.0),
        ValueError,
        "temperature",
    ),
    (
        "log_probs temperature < 0",
        lambda: head.log_probs(LOGITS, -0.5),
        ValueError,
        "temperature",
    ),
    # The message lists what is allowed.
    (
        "output_distribution output",
        lambda: head.output_distribution(H, W, output="softmax"),
        ValueError,
        ("output", "'logits'", "'log_probs'", "'probs'"),
    ),
    (
        "last_positions h rank",
        lambda: head.last_positions(H[0], LABELS),
        ValueError,
        "h",
    ),
    (
        "last_positions T = 0",
        lambda: head.last_positions(H[:, :0], jnp.array([1, 1])),
        ValueError,
        "h",
    ),
    (
        "last_positions float lengths",
        lambda: head.last_positions(H, jnp.ones(2)),
        TypeError,
        "lengths",
    ),
    (
        "last_positions lengths shape",
        lambda: head.last_positions(H, jnp.ones(3, jnp.int32)),
        ValueError,
        "lengths",
    ),
    (
        "last_positions length 0",
        lambda: head.last_positions(H, jnp.array([0, 1])),
        ValueError,
        "lengths",
    ),
    (
        "last_positions length < 0",
        lambda: head.last_positions(H, jnp.array([-1, 1])),
        ValueError,
        "lengths",
    ),
    (
        "last_positions length > T",
        lambda: head.last_positions(H, jnp.array([1, 4])),
        ValueError,
        "lengths",
    ),
    # losses.py
    (
        "cross_entropy float labels",
        lambda: losses.cross_entropy(LOGITS, jnp.zeros(2)),
        TypeError,
        "labels",
    ),
    (
        "cross_entropy labels shape",
        lambda: losses.cross_entropy(LOGITS, jnp.zeros(3, jnp.int32)),
        ValueError,
        "labels",
    ),
    (
        "cross_entropy labels extra axis",
        lambda: losses.cross_entropy(LOGITS, LABELS[:, None]),
        ValueError,
        "labels",
    ),
    (
        "cross_entropy scalar labels",
        lambda: losses.cross_entropy(LOGITS, LABELS[0]),
        ValueError,
        "labels",
    ),
    (
        "cross_entropy weights shape",
        lambda: losses.cross_entropy(LOGITS, LABELS, weights=jnp.ones(3)),
        ValueError,
        "weights",
    ),
    (
        "cross_entropy weights transposed",
        lambda: losses.cross_entropy(LOGITS_3D, LABELS_2D, weights=jnp.ones((3, 2))),
        ValueError,
        "weights",
    ),
    (
        "cross_entropy negative weight",
        lambda: losses.cross_entropy(LOGITS, LABELS, weights=jnp.array([1.0, -1.0])),
        ValueError,
        "weights",
    ),
    (
        "cross_entropy NaN weight",
        lambda: losses.cross_entropy(LOGITS, LABELS, weights=jnp.array([1.0, NAN])),
        ValueError,
        "weights",
    ),
    (
        "cross_entropy label = V",
        lambda: losses.cross_entropy(LOGITS, jnp.array([0, 5])),
        ValueError,
        "labels",
    ),
    (
        "cross_entropy label < 0",
        lambda: losses.cross_entropy(LOGITS, jnp.array([-1, 0])),
        ValueError,
        "labels",
    ),
    (
        "cross_entropy label_smoothing 1",
        lambda: losses.cross_entropy(LOGITS, LABELS, label_smoothing=1.0),
        ValueError,
        "label_smoothing",
    ),
    (
        "cross_entropy label_smoothing < 0",
        lambda: losses.cross_entropy(LOGITS, LABELS, label_smoothing=-0.1),
        ValueError,
        "label_smoothing",
    ),
    (
        "cross_entropy smoothing",
        lambda: losses.cross_entropy(LOGITS, LABELS, smoothing="soft"),
        ValueError,
        "smoothing",
    ),
    (
        "cross_entropy z_loss < 0",
        lambda: losses.cross_entropy(LOGITS, LABELS, z_loss=-1e-4),
        ValueError,
        "z_loss",
    ),
    (
        "cross_entropy reduction",
        lambda: losses.cross_entropy(LOGITS, LABELS, reduction="avg"),
        ValueError,
        "reduction",
    ),
    (
        "cross_entropy integer logits",
        lambda: losses.cross_entropy(LABELS[:, None], LABELS),
        TypeError,
        "logits",
    ),
    (
        "cross_entropy V = 0",
        lambda: losses.cross_entropy(LOGITS[:, :0], LABELS),
        ValueError,
        "logits",
    ),
    (
        "cross_entropy V = 0 in jit",
        lambda: jax.jit(losses.cross_entropy)(LOGITS[:, :0], LABELS),
        ValueError,
        "logits",
    ),
    (
        "ece num_bins 0",
        lambda: losses.expected_calibration_error(LOGITS, LABELS, num_bins=0),
        ValueError,
        "num_bins",
    ),
    (
        "ece num_bins < 0",
        lambda: losses.expected_calibration_error(LOGITS, LABELS, num_bins=-2),
        ValueError,
        "num_bins",
    ),
    (
        "ece num_bins float",
        lambda: losses.expected_calibration_error(LOGITS, LABELS, num_bins=2.5),
        TypeError,
        "num_bins",
    ),
    (
        "ece num_bins bool",
        lambda: losses.expected_calibration_error(LOGITS, LABELS, num_bins=True),
        TypeError,
        "num_bins",
    ),
    (
        "ece bins [M, 2]",
        lambda: losses.calibration_error_from_bins(jnp.ones((3, 2))),
        ValueError,
        "bins",
    ),
    (
        "ece negative bins",
        lambda: losses.calibration_error_from_bins(jnp.array([[-1.0, 0.5, 0.0]])),
        ValueError,
        "bins",
    ),
    (
        "bits_per_character 0 chars",
        lambda: losses.bits_per_character(1.0, 0.0),
        ValueError,
        "chars_per_token",
    ),
    (
        "bits_per_character inf chars",
        lambda: losses.bits_per_character(1.0, INF),
        ValueError,
        "chars_per_token",
    ),
    # fused.py
    ("fused chunk_size 0", lambda: fused_ce(chunk_size=0), ValueError, "chunk_size"),
    ("fused chunk_size < 0", lambda: fused_ce(chunk_size=-3), ValueError, "chunk_size"),
    (
        "fused chunk_size float",
        lambda: fused_ce(chunk_size=2.5),
        TypeError,
        "chunk_size",
    ),
    (
        "fused chunk_size bool",
        lambda: fused_ce(chunk_size=True),
        TypeError,
        "chunk_size",
    ),
    (
        "fused vocab_chunk_size 0",
        lambda: fused_ce(vocab_chunk_size=0),
        ValueError,
        "vocab_chunk_size",
    ),
    (
        "fused vocab_chunk_size float",
        lambda: fused_ce(vocab_chunk_size=2.5),
        TypeError,
        "vocab_chunk_size",
    ),
    ("fused smoothing", lambda: fused_ce(smoothing="label"), ValueError, "smoothing"),
    (
        "fused label_smoothing 1",
        lambda: fused_ce(label_smoothing=1.0),
        ValueError,
        "label_smoothing",
    ),
    ("fused z_loss < 0", lambda: fused_ce(z_loss=-1.0), ValueError, "z_loss"),
    ("fused reduction", lambda: fused_ce(reduction="max"), ValueError, "reduction"),
    ("fused scale 0", lambda: fused_ce(scale=0.0), ValueError, "scale"),
    ("fused softcap 0", lambda: fused_ce(softcap=0.0), ValueError, "softcap"),
    ("fused softcap < 0", lambda: fused_ce(softcap=-1.0), ValueError, "softcap"),
    ("fused D mismatch", lambda: fused_ce(w=jnp.ones((5, 3))), ValueError, "h"),
    ("fused w rank 1", lambda: fused_ce(w=W[0]), ValueError, "w"),
    ("fused V = 0", lambda: fused_ce(w=W[:0]), ValueError, "w"),
    ("fused integer h", lambda: fused_ce(h=H[0].astype(jnp.int32)), TypeError, "h"),
    ("fused integer w", lambda: fused_ce(w=W.astype(jnp.int32)), TypeError, "w"),
    ("fused bias shape", lambda: fused_ce(bias=jnp.zeros(4)), ValueError, "bias"),
    ("fused float labels", lambda: fused_ce(labels=jnp.zeros(3)), TypeError, "labels"),
    ("fused labels shape", lambda: fused_ce(labels=LABELS), ValueError, "labels"),
    (
        "fused label = V",
        lambda: fused_ce(labels=jnp.array([0, 1, 5])),
        ValueError,
        "labels",
    ),
    (
        "fused weights shape",
        lambda: fused_ce(weights=jnp.ones(2)),
        ValueError,
        "weights",
    ),
    (
        "fused traced label_smoothing",
        lambda: jax.jit(lambda eps: fused_ce(label_smoothing=eps))(0.1),
        TypeError,
        "label_smoothing",
    ),
    # decoding.py
    (
        "generate logits rank",
        lambda: decoding.generate(
            markov, TABLE, LOGITS[None], (), key=KEY, max_new_tokens=2
        ),
        ValueError,
        "logits",
    ),
    (
        "generate max_new_tokens 0",
        lambda: generate(max_new_tokens=0),
        ValueError,
        "max_new_tokens",
    ),
    (
        "generate max_new_tokens float",
        lambda: generate(max_new_tokens=2.0),
        TypeError,
        "max_new_tokens",
    ),
    (
        "generate num_samples 0",
        lambda: generate(num_samples=0),
        ValueError,
        "num_samples",
    ),
    (
        "generate temperature < 0",
        lambda: generate(temperature=-0.5),
        ValueError,
        "temperature",
    ),
    ("generate top_k < 0", lambda: generate(top_k=-1), ValueError, "top_k"),
    (
        "generate top_p per row, wrong shape",
        lambda: generate(top_p=jnp.full(3, 0.9)),
        ValueError,
        "top_p",
    ),
    (
        "generate temperature per row < 0",
        lambda: generate(temperature=jnp.array([0.0, -1.0])),
        ValueError,
        "temperature",
    ),
    ("generate top_k float", lambda: generate(top_k=2.0), TypeError, "top_k"),
    ("generate top_p 0", lambda: generate(top_p=0.0), ValueError, "top_p"),
    ("generate top_p > 1", lambda: generate(top_p=1.5), ValueError, "top_p"),
    ("generate min_p > 1", lambda: generate(min_p=1.5), ValueError, "min_p"),
    (
        "generate repetition_penalty 0",
        lambda: generate(repetition_penalty=0.0),
        ValueError,
        "repetition_penalty",
    ),
    (
        "generate no_repeat_ngram_size 0",
        lambda: generate(no_repeat_ngram_size=0),
        ValueError,
        "no_repeat_ngram_size",
    ),
    (
        "generate min_new_tokens < 0",
        lambda: generate(min_new_tokens=-1),
        ValueError,
        "min_new_tokens",
    ),
    ("generate eos_id = V", lambda: generate(eos_id=5), ValueError, "eos_id"),
    (
        "generate suppress_tokens",
        lambda: generate(suppress_tokens=[7]),
        ValueError,
        "suppress_tokens",
    ),
    (
        "generate state batch axis",
        lambda: decoding.generate(
            markov,
            TABLE,
            LOGITS,
            {"cache": jnp.zeros((3, 4))},
            key=KEY,
            max_new_tokens=2,
        ),
        ValueError,
        "state",
    ),
    (
        "generate prompt_tokens batch",
        lambda: generate(
            repetition_penalty=1.2, prompt_tokens=jnp.zeros((3, 2), jnp.int32)
        ),
        ValueError,
        "prompt_tokens",
    ),
    (
        "process_logits history missing",
        lambda: decoding.process_logits(LOGITS, repetition_penalty=1.2),
        ValueError,
        "history",
    ),
    ("beam num_beams 0", lambda: beam(num_beams=0), ValueError, "num_beams"),
    (
        "beam num_return_sequences > K",
        lambda: beam(num_return_sequences=3),
        ValueError,
        "num_return_sequences",
    ),
    ("beam penalty", lambda: beam(penalty="wu"), ValueError, "penalty"),
    (
        "beam length_penalty inf",
        lambda: beam(length_penalty=float("inf")),
        ValueError,
        "length_penalty",
    ),
    ("beam eos_id < 0", lambda: beam(eos_id=-1), ValueError, "eos_id"),
    (
        "detokenize no decode",
        lambda: decoding.detokenize([[0, 1]], object()),
        TypeError,
        ("tokenizer", "decode"),
    ),
    (
        "detokenize float ids",
        lambda: decoding.detokenize([0.5], Letters()),
        TypeError,
        "ids",
    ),
    (
        "detokenize scalar ids",
        lambda: decoding.detokenize(3, Letters()),
        ValueError,
        "ids",
    ),
]


def lm_head_loss(loss_impl="fused", **kwargs):
    return modules.LMHead(5, tied=True).apply(
        {},
        H,
        jnp.zeros((2, 3), jnp.int32),
        W,
        loss_impl=loss_impl,
        method="loss",
        **kwargs,
    )


class WrongSizeEmbed(nn.Module):
    """A tied head handed an ``nn.Embed`` of one token too many."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(6, 4)
        return modules.LMHead(5, tied=True)(embed(tokens), embed)


MODULES = [
    # Fields are checked when the module is built.
    ("LMHead vocab_size 0", lambda: modules.LMHead(0), ValueError, "vocab_size"),
    ("LMHead vocab_size < 0", lambda: modules.LMHead(-1), ValueError, "vocab_size"),
    ("LMHead vocab_size float", lambda: modules.LMHead(5.0), TypeError, "vocab_size"),
    ("LMHead vocab_size bool", lambda: modules.LMHead(True), TypeError, "vocab_size"),
    ("LMHead tied string", lambda: modules.LMHead(5, tied="no"), TypeError, "tied"),
    (
        "LMHead use_bias int",
        lambda: modules.LMHead(5, use_bias=1),
        TypeError,
        "use_bias",
    ),
    ("LMHead scale 0", lambda: modules.LMHead(5, scale=0.0), ValueError, "scale"),
    (
        "LMHead softcap inf",
        lambda: modules.LMHead(5, softcap=INF),
        ValueError,
        "softcap",
    ),
    (
        "LMHead tied without embedding",
        lambda: modules.LMHead(5, tied=True).apply({}, H),
        ValueError,
        ("embedding", "tied"),
    ),
    (
        "LMHead tied table [V, D - 1]",
        lambda: modules.LMHead(5, tied=True).apply({}, H, jnp.ones((5, 3))),
        ValueError,
        "embedding",
    ),
    (
        "LMHead tied table [V + 1, D]",
        lambda: modules.LMHead(5, tied=True).apply({}, H, jnp.ones((6, 4))),
        ValueError,
        "embedding",
    ),
    (
        "LMHead tied table [D, V]",
        lambda: modules.LMHead(5, tied=True).apply({}, H, jnp.ones((4, 5))),
        ValueError,
        "embedding",
    ),
    (
        "LMHead tied table flat",
        lambda: modules.LMHead(5, tied=True).apply({}, H, jnp.ones(20)),
        ValueError,
        "embedding",
    ),
    (
        "LMHead tied nn.Embed of V + 1",
        lambda: WrongSizeEmbed().init(KEY, LABELS),
        ValueError,
        "embedding",
    ),
    (
        "LMHead untied with embedding",
        lambda: modules.LMHead(5, tied=False).init(KEY, H, W),
        ValueError,
        ("embedding", "tied"),
    ),
    (
        "LMHead integer h",
        lambda: modules.LMHead(5, tied=False).init(KEY, H.astype(jnp.int32)),
        TypeError,
        "h",
    ),
    (
        "LMHead loss integer h",
        lambda: modules.LMHead(5, tied=True).apply(
            {}, H.astype(jnp.int32), jnp.zeros((2, 3), jnp.int32), W, method="loss"
        ),
        TypeError,
        "h",
    ),
    (
        "LMHead untied D = 0",
        lambda: modules.LMHead(5, tied=False).init(KEY, H[..., :0]),
        ValueError,
        "w",
    ),
    ("LMHead loss_impl", lambda: lm_head_loss("chunked"), ValueError, "loss_impl"),
    (
        "LMHead chunk_size with materialized",
        lambda: lm_head_loss("materialized", chunk_size=4),
        ValueError,
        ("chunk_size", "loss_impl"),
    ),
]


@pytest.mark.parametrize(
    "call,error,named", [pytest.param(*case[1:], id=case[0]) for case in PURE]
)
def test_pure_functions(call, error, named):
    assert_raises_exactly(call, error, named)


def test_generate_on_nonfinite_logits_ends_the_row_and_flags_it():
    """No error can be raised inside the loop: the documented rule ends a row
    whose logits are not finite, with pad_id and log-prob -inf."""
    bad_table = TABLE.at[1].set(jnp.nan)
    tokens, log_probs, lengths = decoding.generate(
        markov,
        bad_table,
        LOGITS.at[1, 1].set(9.0),
        (),
        key=KEY,
        max_new_tokens=3,
        temperature=0.0,
        pad_id=4,
    )
    assert jnp.isneginf(log_probs).any(-1).tolist() == [False, True]
    assert tokens[1].tolist() == [1, 4, 4] and lengths.tolist() == [3, 1]


@pytest.mark.parametrize(
    "call,error,named", [pytest.param(*case[1:], id=case[0]) for case in MODULES]
)
def test_modules(call, error, named):
    assert_raises_exactly(call, error, named)


NEG = -INF
# Values that cannot be refused inside jit get a documented rule instead of
# an error; never NaN. Each call is checked with and without jit.
RULES = [
    # head.log_probs: a -inf logit has probability 0; a row of -inf has no
    # distribution (all 0); +inf logits share the mass.
    ("probs of a row of -inf", head.probs, (jnp.full((2, 3), NEG),), np.zeros((2, 3))),
    (
        "log_probs of a row of -inf",
        head.log_probs,
        (jnp.array([[NEG, NEG], [0.0, NEG]]),),
        np.array([[NEG, NEG], [0.0, NEG]]),
    ),
    (
        "probs with +inf logits",
        head.probs,
        (jnp.array([[INF, 0.0, INF, NEG]]),),
        np.array([[0.5, 0.0, 0.5, 0.0]]),
    ),
    (
        "log_probs with +inf logits",
        head.log_probs,
        (jnp.array([[INF, 1.0]]),),
        np.array([[0.0, NEG]]),
    ),
    # losses.cross_entropy: a label of logit -inf has probability 0.
    (
        "cross_entropy of a row of -inf",
        lambda z, y: losses.cross_entropy(z, y, reduction="none")[0],
        (jnp.array([[NEG, NEG], [0.0, 0.0]]), jnp.array([0, 1])),
        np.array([INF, np.log(2.0)]),
    ),
    (
        "cross_entropy of a label of logit -inf",
        lambda z, y: losses.cross_entropy(z, y, reduction="none")[0],
        (jnp.array([[NEG, 0.0]]), jnp.array([0])),
        np.array([INF]),
    ),
    # A -inf logit off the label (a banned token) is no concern of the loss:
    # log 2 of the two live tokens, also where the z-loss and smoothing
    # coefficients are 0 (0 * inf used to give NaN).
    (
        "cross_entropy with a banned token",
        lambda z, y: losses.cross_entropy(z, y)[0],
        (jnp.array([[0.0, NEG, 0.0]]), jnp.array([0])),
        np.log(2.0),
    ),
    (
        "fused with a banned token (bias -inf)",
        lambda b: fused_ce(h=jnp.zeros((3, 4)), bias=b, labels=jnp.array([0, 2, 3]))[0],
        (jnp.array([0.0, NEG, 0.0, 0.0, 0.0]),),
        np.log(4.0),
    ),
    (
        "cross_entropy padding row of -inf",
        lambda z, y, w: losses.cross_entropy(
            z, y, weights=w, label_smoothing=0.1, z_loss=1e-4
        )[0],
        (jnp.array([[NEG, NEG], [0.0, 0.0]]), jnp.array([0, 1]), jnp.array([0.0, 1.0])),
        np.log(2.0) + 1e-4 * np.log(2.0) ** 2,
    ),
    # A row of -inf has confidence 0 and is never correct: bin 0, weight 1.
    (
        "calibration_bins of a row of -inf",
        lambda z, y: losses.calibration_bins(z, y, num_bins=2),
        (jnp.full((1, 3), NEG), jnp.array([0])),
        np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
    ),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "fn,args,expected", [pytest.param(*case[1:], id=case[0]) for case in RULES]
)
def test_documented_rules(fn, args, expected, jit):
    got = np.asarray((jax.jit(fn) if jit else fn)(*args))
    assert not np.any(np.isnan(got)), got
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_padding_row_of_neg_inf_has_zero_gradient():
    def loss(z):
        return losses.cross_entropy(
            z,
            jnp.array([0, 1]),
            weights=jnp.array([0.0, 1.0]),
            label_smoothing=0.1,
            z_loss=1e-4,
        )[0]

    grad = np.asarray(jax.grad(loss)(jnp.array([[NEG, NEG], [0.0, 1.0]])))
    assert np.all(np.isfinite(grad)), grad
    np.testing.assert_array_equal(grad[0], 0.0)
