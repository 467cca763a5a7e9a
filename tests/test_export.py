"""GPU and TPU readiness, checked on a CPU: every jitted entry point lowers
for ``cuda`` and ``tpu`` with ``jax.export``.

``jax.export.export(jitted, platforms=(platform,))(*structs)`` traces and
lowers a program for a platform this machine does not have, from
``jax.ShapeDtypeStruct`` inputs, computing and compiling nothing. It fails
when an operation has no lowering rule for the platform (a host callback, a
CPU-only custom call) or is a custom call without a compatibility guarantee.
Each entry point is built once, so that its second platform reuses the
trace, and each export is checked against ``jax.eval_shape`` of the same
program. Lowering is all it checks (docs/scale_out.md, "GPU and TPU
lowering, checked on a CPU"); the fused loss's default blocks are the CPU's
here, which at these shapes are every platform's.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from configs import default
from lmhead import decoding, distillation, fused, vocab_parallel
from lmhead.lm import configuration, inference, kv_cache, sharding, train
from lmhead.lm import model as model_lib
from lmhead.lm import state as state_lib

PLATFORMS = ("cuda", "tpu")
VOCAB = 64  # divisible by the model axis of MESH_SHAPE
# Eight devices this machine does not have: an abstract mesh lowers the
# vocabulary split as on one GPU host (docs/scale_out.md's data=4, model=2).
MESH_SHAPE = {sharding.DATA_AXIS: 4, sharding.MODEL_AXIS: 2}
MEMBERS = 2
BATCH, PROMPT, NEW_TOKENS, BEAMS = 2, 4, 4, 2

S = jax.ShapeDtypeStruct
KEY = jax.eval_shape(jax.random.key, 0)


def lowered(fn, args, platform: str, mesh: AbstractMesh | None = None):
    """``jax.export`` of the jitted ``fn`` at ``args`` (structs) for
    ``platform``, checked against ``jax.eval_shape``: the output tree,
    shapes and dtypes, and the number of devices (``mesh``'s, or 1)."""
    with jax.sharding.use_abstract_mesh(mesh) if mesh else contextlib.nullcontext():
        exported = export.export(fn, platforms=(platform,))(*args)
        expected = jax.eval_shape(fn, *args)
    assert exported.platforms == (platform,)
    assert exported.out_tree == jax.tree.structure(expected)
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(expected)
    ]
    assert exported.nr_devices == (mesh.size if mesh else 1)
    assert "func.func public @main" in exported.mlir_module()
    return exported


# --- The programs and their input structs, built once per test session -------


@functools.cache
def tiny_config():
    return default.get_config("tiny")


@functools.cache
def tiny_model() -> model_lib.DecoderLM:
    return configuration.make_model(tiny_config(), VOCAB)


def batch_structs(leading=(), weights=False):
    shape = (*leading, tiny_config().train.batch_size, tiny_config().data.block_size)
    names = ("inputs", "labels", "weights") if weights else ("inputs", "labels")
    return {n: S(shape, jnp.float32 if n == "weights" else jnp.int32) for n in names}


@functools.cache
def state_structs() -> state_lib.TrainState:
    create = functools.partial(
        state_lib.create_train_state, tiny_model(), tiny_config()
    )
    return jax.eval_shape(create, KEY)


def stacked(tree, count: int = MEMBERS):
    return jax.tree.map(lambda x: S((count, *x.shape), x.dtype), tree)


def train_step_of(config):
    """``train.train_step`` as ``train.compile_steps`` builds it for ``config``."""
    return functools.partial(
        train.train_step,
        model=tiny_model(),
        loss_kwargs=train.loss_keywords(config.loss),
        learning_rate_fn=state_lib.learning_rate_schedule(config),
        microbatches=config.train.microbatches,
        untie_step=config.model.untie_step,
    )


@functools.cache
def train_step():
    step = jax.jit(train_step_of(tiny_config()), donate_argnums=0)
    return step, (state_structs(), batch_structs(), KEY)


@functools.cache
def sharded_train_step():
    """The train step of docs/scale_out.md's eight-GPU run on ``MESH_SHAPE``:
    the vocabulary-parallel loss, the state split by ``sharding``'s rules."""
    config = tiny_config().copy_and_resolve_references()
    config.loss.loss_impl = "vocab_parallel"
    mesh = abstract_mesh()
    state = sharding.tree_shardings(state_structs(), mesh)
    replicated = sharding.replicated(mesh)
    step = jax.jit(
        train_step_of(config),
        donate_argnums=0,
        in_shardings=(state, sharding.batch_sharding(mesh), replicated),
        out_shardings=(state, replicated),
    )
    return step, (state_structs(), batch_structs(), KEY)


@functools.cache
def eval_step():
    step = functools.partial(train.eval_step, model=tiny_model())
    return jax.jit(step), (state_structs().params, batch_structs(weights=True))


@functools.cache
def ensemble_train_step():
    # One vmap of the members, the default off a CPU, and patience's lax.cond.
    step = functools.partial(
        train.program_train_step,
        model=tiny_model(),
        config=tiny_config(),
        vmap_size=MEMBERS,
        freeze="cond",
    )
    values = {"optim.lr": S((MEMBERS,), jnp.float32)}
    values["loss.label_smoothing"] = S((MEMBERS,), jnp.float32)
    args = (
        stacked(state_structs()),
        batch_structs((MEMBERS,)),
        stacked(KEY),
        values,
        S((MEMBERS,), jnp.bool_),
    )
    return jax.jit(step, donate_argnums=0), args


@functools.cache
def ensemble_eval_step():
    step = functools.partial(
        train.program_eval_step, model=tiny_model(), vmap_size=MEMBERS, stacked=True
    )
    args = (stacked(state_structs().params), batch_structs((MEMBERS,), weights=True))
    return jax.jit(step), args


def loss_structs(mesh: AbstractMesh | None = None):
    """``h [B, T, D]``, ``w [V, D]``, ``bias [V]``, ``labels`` and
    ``weights [B, T]``; on ``mesh``, split as ``sharding`` splits them."""

    def on(*spec):
        return None if mesh is None else NamedSharding(mesh, P(*spec))

    data, model = sharding.DATA_AXIS, sharding.MODEL_AXIS
    tokens = (BATCH * MESH_SHAPE[data], 3)
    return (
        S((*tokens, 16), jnp.float32, sharding=on(data)),
        S((VOCAB, 16), jnp.float32, sharding=on(model)),
        S((VOCAB,), jnp.float32, sharding=on(model)),
        S(tokens, jnp.int32, sharding=on(data)),
        S(tokens, jnp.float32, sharding=on(data)),
    )


LOSS_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0, chunk_size=4)


@functools.cache
def fused_loss_and_grad(filtered=False):
    """The fused loss, exact or with its gradient filtered (a ``lax.cond``
    per vocabulary block), ``dw`` Kahan-compensated and the vocabulary swept
    in the batch's mean-logit order (an argsort, a gather and a scatter)."""
    filtering = dict(
        filter_eps="auto", dw_accumulation="kahan", vocab_order="mean_logit"
    )
    options = LOSS_OPTIONS | (filtering if filtered else {})

    def objective(h, w, bias, labels, weights):
        return fused.fused_cross_entropy(
            h, w, labels, bias=bias, weights=weights, **options
        )

    grad = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(grad), loss_structs()


@functools.cache
def fused_distillation_and_grad():
    """The fused distillation loss, the teacher as its own ``(h_t, w_t)``,
    with the hard labels mixed in."""

    def objective(h, w, bias, labels, weights, h_t, w_t):
        return distillation.fused_distillation_loss(
            h,
            w,
            (h_t, w_t),
            labels=labels,
            bias=bias,
            weights=weights,
            divergence="jsd",
            temperature=2.0,
            hard_weight=0.5,
            chunk_size=4,
        )

    grad = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)
    h, w, *rest = loss_structs()
    return jax.jit(grad), (
        h,
        w,
        *rest,
        S(h.shape[:-1] + (8,), h.dtype),
        S((VOCAB, 8), w.dtype),
    )


@functools.cache
def abstract_mesh() -> AbstractMesh:
    return AbstractMesh(tuple(MESH_SHAPE.values()), tuple(MESH_SHAPE))


@functools.cache
def vocab_parallel_loss_and_grad():
    def objective(h, w, bias, labels, weights):
        return vocab_parallel.vocab_parallel_cross_entropy(
            h, w, labels, bias=bias, weights=weights, **LOSS_OPTIONS
        )

    grad = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(grad), loss_structs(abstract_mesh())


def decoding_structs(rows: int = BATCH):
    """The params, next-token logits and cache structs of ``rows`` prompts."""
    params = state_structs().params
    cache = jax.eval_shape(lambda: kv_cache.init_cache(tiny_model(), rows))
    return params, S((rows, VOCAB), jnp.float32), cache


@functools.cache
def generate():
    step_fn = inference.make_step_fn(tiny_model())

    # The whole return, whatever its fields: a pytree like any other output.
    def sample(params, logits, cache, key):
        return decoding.generate(
            step_fn, params, logits, cache, key=key, max_new_tokens=NEW_TOKENS,
            temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, eos_id=1,
        )  # fmt: skip

    return jax.jit(sample), (*decoding_structs(), KEY)


@functools.cache
def beam_search():
    step_fn = inference.make_step_fn(tiny_model())

    def search(params, logits, cache):
        return decoding.beam_search(
            step_fn, params, logits, cache, num_beams=BEAMS,
            max_new_tokens=NEW_TOKENS, eos_id=1, num_return_sequences=BEAMS,
        )  # fmt: skip

    return jax.jit(search), decoding_structs()


@functools.cache
def prefill():
    fill = functools.partial(inference.prefill, tiny_model())
    prompt = S((BATCH, PROMPT), jnp.int32)
    return jax.jit(fill), (state_structs().params, prompt, S((BATCH,), jnp.int32))


# --- One test per entry point -------------------------------------------------

platforms = pytest.mark.parametrize("platform", PLATFORMS)


def _same_state(exported, args):
    # The new state has the old one's structure (what the donation aliases).
    assert exported.out_tree.children()[0] == jax.tree.structure(args[0])


def _all_reduced(exported, args):
    assert "all_reduce" in exported.mlir_module()


def _members_first(exported, args):
    assert all(a.shape[0] == MEMBERS for a in exported.out_avals)


def _reduced_not_gathered(exported, args):
    # The statistics are combined across devices, not gathered on one.
    text = exported.mlir_module()
    assert "all_reduce" in text and "all_gather" not in text


def _grads_like_inputs(exported, args):
    (_, _), grads = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    assert [g.shape for g in grads] == [a.shape for a in args[:3]]


def _has_shape(shape):
    def check(exported, args):
        assert shape in [a.shape for a in exported.out_avals]

    return check


def _prefill_outputs(exported, args):
    logits, cache = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    assert logits.shape == (BATCH, VOCAB)
    assert jax.tree.structure(cache) == jax.tree.structure(decoding_structs()[2])


# name: (the program and its structs, lowered on the abstract mesh, a check)
ENTRY_POINTS = {
    "train_step": (train_step, False, _same_state),
    "sharded_train_step": (sharded_train_step, True, _all_reduced),
    "eval_step": (eval_step, False, None),
    "ensemble_train_step": (ensemble_train_step, False, _members_first),
    "ensemble_eval_step": (ensemble_eval_step, False, None),
    "fused": (lambda: fused_loss_and_grad(False), False, _grads_like_inputs),
    "fused_filtered": (lambda: fused_loss_and_grad(True), False, _grads_like_inputs),
    "distillation": (fused_distillation_and_grad, False, _grads_like_inputs),
    "vocab_parallel": (vocab_parallel_loss_and_grad, True, _reduced_not_gathered),
    "generate": (generate, False, _has_shape((BATCH, NEW_TOKENS))),
    "beam_search": (beam_search, False, _has_shape((BATCH, BEAMS, NEW_TOKENS))),
    "prefill": (prefill, False, _prefill_outputs),
}


@platforms
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_point_lowers(platform, entry):
    build, on_mesh, check = ENTRY_POINTS[entry]
    fn, args = build()
    exported = lowered(fn, args, platform, mesh=abstract_mesh() if on_mesh else None)
    if check is not None:
        check(exported, args)


# --- The check itself can fail ------------------------------------------------


def _through_the_host(x):
    """``x + 1`` computed by numpy on the host: a CPU-only program."""
    out = S(x.shape, x.dtype)
    return jax.pure_callback(lambda a: np.asarray(a + 1, a.dtype), out, x)


def _cpu_only_kernel(x):
    """A custom call to a kernel that nothing registers for GPU or TPU."""
    return jax.ffi.ffi_call("lmhead_cpu_only_kernel", S(x.shape, x.dtype))(x)


@platforms
def test_a_host_callback_does_not_lower(platform):
    x = S((BATCH, VOCAB), jnp.float32)
    with pytest.raises(ValueError, match=f"lowering platform {platform}"):
        lowered(jax.jit(_through_the_host), (x,), platform)


@platforms
def test_a_custom_call_without_guarantees_does_not_lower(platform):
    x = S((BATCH, VOCAB), jnp.float32)
    with pytest.raises(ValueError, match="no compatibility guarantees"):
        lowered(jax.jit(_cpu_only_kernel), (x,), platform)
