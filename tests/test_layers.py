"""The package's layers, read from the import statements of every module.

The head library (``lmhead/*.py``, ``lmhead/decoding/``) is at the bottom and
imports jax, flax, chex, numpy, the standard library and itself only; above
it the experiment (``lmhead/lm/``), then the service (``lmhead/serve/``) and
the sweep tooling (``lmhead/lab/``), which do not import each other, and the
studies (``studies/``) on top. Nothing imports a layer above its own,
and no module imports itself through a cycle.
"""

import ast
import pathlib
import sys

import pytest

from tests import ROOT

# The package, and the studies: a project beside it that imports it.
TREES = (pathlib.Path(ROOT) / "lmhead", pathlib.Path(ROOT) / "studies")
# layer -> the layers its modules may import (its own included)
ALLOWED = {
    "head": {"head"},
    "lm": {"head", "lm"},
    "serve": {"head", "lm", "serve"},
    "lab": {"head", "lm", "lab"},
    "studies": {"head", "lm", "lab", "studies"},
}
HEAD_THIRD_PARTY = {"jax", "flax", "chex", "numpy"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "studies":
        return "studies"
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "head"


def imports(path: pathlib.Path) -> set[str]:
    """The absolute names that ``path`` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                # `from lmhead.lm import data` imports the module lmhead.lm.data;
                # `from lmhead.head import unembed`, the module lmhead.head
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in MODULES else node.module)
    return names


MODULES = {module_name(p): p for tree in TREES for p in sorted(tree.rglob("*.py"))}
GRAPH = {
    name: {i for i in imports(path) if i in MODULES and i != name}
    for name, path in MODULES.items()
}


def test_the_tree_has_every_layer():
    assert {layer(m) for m in MODULES} == set(ALLOWED)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_nothing_imports_a_layer_above_its_own(name):
    above = {i for i in GRAPH[name] if layer(i) not in ALLOWED[layer(name)]}
    assert not above, f"{name} ({layer(name)}) imports {sorted(above)}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if layer(m) == "head"))
def test_the_head_library_imports_only_jax_flax_chex_numpy(name):
    outside = {
        i.split(".")[0]
        for i in imports(MODULES[name])
        if i.split(".")[0] not in HEAD_THIRD_PARTY | {"lmhead"}
        and i.split(".")[0] not in sys.stdlib_module_names
    }
    assert not outside, f"{name} imports {sorted(outside)}"


def test_no_import_cycles():
    done, path = set(), []

    def visit(name):
        if name in path:
            cycle = path[path.index(name) :] + [name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        path.append(name)
        for other in sorted(GRAPH[name]):
            # a package's __init__ importing its own modules is no cycle
            if not other.startswith(name + "."):
                visit(other)
        path.pop()
        done.add(name)

    for name in sorted(GRAPH):
        visit(name)


def test_the_checks_can_fail():
    """The cycle check finds a planted cycle, and the layer rule a planted
    upward import."""
    saved = {k: set(v) for k, v in GRAPH.items()}
    try:
        GRAPH["lmhead.head"].add("lmhead.lm.train")
        with pytest.raises(AssertionError, match="import cycle"):
            test_no_import_cycles()
        with pytest.raises(AssertionError, match="imports"):
            test_nothing_imports_a_layer_above_its_own("lmhead.head")
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
