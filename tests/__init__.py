"""The test suite; its folders mirror ``lmhead/`` and ``experiments/``."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository's root, where the commands of ``experiments/`` are run."""
