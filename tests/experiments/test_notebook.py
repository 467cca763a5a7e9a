"""The tour notebook runs top to bottom and still shows what its text claims."""

import json
import os
import re
import sys

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from tests import ROOT

NOTEBOOK = os.path.join(ROOT, "experiments", "notebooks", "tour.ipynb")


def python3_kernel(kernel_dir: str) -> KernelManager:
    """A "python3" kernel that runs this interpreter, whatever is on PATH.

    The kernelspec installed in a virtualenv says ``"python"``, which resolves
    to whichever interpreter PATH finds first; this one names the test's own.
    """
    spec_dir = os.path.join(kernel_dir, "python3")
    os.makedirs(spec_dir)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump(
            {
                "argv": [
                    sys.executable,
                    "-m",
                    "ipykernel_launcher",
                    "-f",
                    "{connection_file}",
                ],
                "display_name": "Python 3",
                "language": "python",
            },
            f,
        )
    return KernelManager(
        kernel_name="python3",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernel_dir]),
    )


def stdout_of(cell) -> str:
    return "".join(
        o.get("text", "")
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )


def test_tour_executes(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    notebook.cells.append(
        nbformat.v4.new_code_cell("import sys; print(sys.executable)")
    )
    client = NotebookClient(
        notebook,
        km=python3_kernel(str(tmp_path / "kernels")),
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert not [o for c in code_cells for o in c.outputs if o.output_type == "error"]
    assert stdout_of(code_cells[-1]).strip() == sys.executable
    printed = "".join(stdout_of(c) for c in code_cells)

    # Fused and materialized losses agree, the fused one with less memory.
    differences = dict(re.findall(r"max \|(\w+) difference\|\s+(\S+)", printed))
    assert set(differences) == {"loss", "nll", "dh", "dw"}, printed
    assert all(float(value) < 1e-5 for value in differences.values()), differences
    memory = re.search(
        r"temporary memory: materialized (\S+) MiB, fused (\S+) MiB", printed
    )
    assert float(memory[2]) < float(memory[1]) / 2, memory[0]

    # The normalized smoothing loss is 0 at its target; PyTorch's formula matches.
    assert re.search(r"normalized: smallest loss 0\.0000\d at q = 0\.900", printed)
    torch_like = re.search(r"uniform: loss (\S+)", printed)[1]
    assert re.search(rf"PyTorch's formula by hand: {re.escape(torch_like)}", printed)

    # Beam search finds the likelier sentence that greedy misses.
    greedy = float(re.search(r"greedy\s+(\S+)\s+the cat sat", printed)[1])
    best = float(re.search(r"beam 1\s+(\S+)\s+a cat sat", printed)[1])
    assert best > greedy

    # Text sampled from the trained run continues the prompt.
    assert printed.count("'ROMEO:\\n") == 4, printed[-1000:]

    # Attention maps: causal rows that sum to 1, one image per figure.
    maps = re.search(
        r"(\d+) layers x (\d+) heads over \d+ tokens; max \|row sum - 1\| "
        r"(\S+), max weight above the diagonal (\S+)",
        printed,
    )
    assert maps and float(maps[3]) < 1e-5 and float(maps[4]) == 0.0, printed[-1500:]
    images = [
        o for c in code_cells for o in c.outputs if "image/png" in o.get("data", {})
    ]
    assert len(images) == 2
    # Temperature flattens the next-token distribution: entropy grows with it.
    entropies = [
        float(e)
        for e in re.findall(
            r"temperature (?:0\.5|1\.0|2\.0): p\(top token .*\) = \S+, entropy (\S+) nats",
            printed,
        )
    ]
    assert len(entropies) == 3 and entropies == sorted(entropies), entropies
