"""The flags that several commands share are defined once, in
experiments/cli.py, and each command still lists, requires and defaults
them as its own."""

import ast
import collections
import glob
import os

from tests import ROOT, run_experiment

SHARED = ("workdir", "quick", "matmul_size")


def flag_definitions() -> dict[str, list[str]]:
    """Each flag name that a ``DEFINE_*`` call of experiments/ spells out,
    with the files that define it."""
    found = collections.defaultdict(list)
    pattern = os.path.join(ROOT, "experiments", "**", "*.py")
    for path in sorted(glob.glob(pattern, recursive=True)):
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr.startswith("DEFINE")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found[node.args[0].value].append(os.path.relpath(path, ROOT))
    return found


def test_shared_flags_are_defined_in_cli_only():
    found = flag_definitions()
    for name in SHARED:
        assert set(found[name]) == {"experiments/cli.py"}, (name, found[name])
    # One help text each: the workdir's two forms (one value, a list) share it.
    cli = open(os.path.join(ROOT, "experiments", "cli.py"), encoding="utf-8").read()
    assert cli.count('"workdir", None, help_text') == 1
    assert cli.count('"workdir", [], help_text') == 1


def test_a_command_lists_requires_and_defaults_the_shared_flags():
    result = run_experiment("bench/bench_head.py", "--helpshort", timeout=120)
    assert "Try --helpfull" in result.stdout, result.stderr[-3000:]
    for name in SHARED:  # the command's own flags, not cli.py's
        assert f"--{name}:" in result.stdout or f"--[no]{name}:" in result.stdout
    assert "(default: '4096')" in result.stdout.split("--matmul_size:")[1]
    result = run_experiment("score.py", "--text=x", timeout=120)
    assert result.returncode != 0
    assert "--workdir must have a value other than None" in result.stderr
