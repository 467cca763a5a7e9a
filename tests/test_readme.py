"""The README's API tour runs as written and agrees with itself, and the README
and the pages under docs/ point only at files and headings that exist."""

import pathlib
import re

import numpy as np
import pytest

from tests import ROOT

README = pathlib.Path(ROOT) / "README.md"
PAGES = [README, *sorted((pathlib.Path(ROOT) / "docs").rglob("*.md"))]
# Markdown links and images: [text](target), ![text](target).
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Paths of the repository: in code spans (`lmhead/lm/model.py`, `configs/sweeps/`),
# and any file path of a top-level folder (`python experiments/train.py ...`).
REPO_PATH = re.compile(
    r"`((?:lmhead|experiments|configs|tests|docs)/[\w./-]*)`"
    r"|(?<![\w/])((?:lmhead|experiments|configs|tests)/[\w/.-]+\.(?:py|ipynb))"
)
# Written by `make study` / `make compare`: a record of the tree the runs ran on.
WRITTEN = [p for p in PAGES if p.name != "REPORT.md"]


def test_api_tour_runs():
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no python block"
    namespace = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    np.testing.assert_allclose(namespace["fused_loss"], namespace["loss"], rtol=1e-5)
    assert namespace["tokens"].shape == (2, 8)
    assert namespace["beams"].shape == (2, 2, 8)
    scores = np.asarray(namespace["scores"])
    assert np.all(scores[:, 0] >= scores[:, 1])  # n-best, best first
    assert len(namespace["maps"]) == 2 and namespace["maps"][0].shape == (2, 2, 5, 5)
    assert namespace["lm_tokens"].shape == (2, 8)


def anchors(page: pathlib.Path) -> set[str]:
    """The heading anchors of a page, as GitHub spells them: lower case, spaces
    to hyphens, punctuation other than hyphens and underscores dropped."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_anchors_follow_github():
    (page,) = [p for p in PAGES if p.name == "scale_out.md"]
    assert "several-runs-on-one-cpu" in anchors(page)
    assert "scale-out-gpus-tpus-and-several-hosts" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


@pytest.mark.parametrize("page", WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(page):
    text = page.read_text(encoding="utf-8")
    root = pathlib.Path(ROOT)
    named = {span or path for span, path in REPO_PATH.findall(text)}
    missing = sorted(p for p in named if not (root / p).exists())
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_layout_lists_the_package_folders():
    """The README's layout tree names existing folders, and every folder of
    ``lmhead/`` that holds a module."""
    text = README.read_text(encoding="utf-8")
    tree = re.search(r"## Layout\n\n```\n(.*?)```", text, re.S).group(1)
    listed = {line.split()[0] for line in tree.splitlines() if line.strip()}
    assert all((pathlib.Path(ROOT) / folder).is_dir() for folder in listed), listed
    package = pathlib.Path(ROOT) / "lmhead"
    folders = {
        f"{path.parent.relative_to(ROOT)}/"
        for path in package.rglob("*.py")
        if path.name != "__init__.py"
    }
    assert folders <= listed, sorted(folders - listed)


def test_the_docs_index_links_every_page():
    index = pathlib.Path(ROOT) / "docs" / "README.md"
    linked = {
        (index.parent / target.partition("#")[0]).resolve()
        for target in LINK.findall(index.read_text(encoding="utf-8"))
    }
    pages = {p.resolve() for p in (pathlib.Path(ROOT) / "docs").rglob("*.md")}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked - {index})
    assert not missing, f"docs/README.md does not link {missing}"


def test_design_names_every_module_command_and_sweep_file():
    """docs/design.md names each module of the package and the studies, each
    command of experiments/ and experiments/bench/, and each sweep file."""
    text = (pathlib.Path(ROOT) / "docs" / "design.md").read_text(encoding="utf-8")
    root = pathlib.Path(ROOT)
    files = [
        *root.glob("lmhead/**/*.py"),
        *root.glob("studies/**/*.py"),
        *root.glob("experiments/**/*.py"),
        *root.glob("configs/sweeps/*.py"),
    ]
    named = set(re.findall(r"[\w.]+\.py\b", text))
    missing = sorted(
        str(p.relative_to(root))
        for p in files
        if p.name != "__init__.py" and p.name not in named
    )
    assert not missing, f"docs/design.md does not name {missing}"
