"""The README's API tour runs as written and agrees with itself."""

import pathlib
import re

import numpy as np

from tests import ROOT

README = pathlib.Path(ROOT) / "README.md"


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
