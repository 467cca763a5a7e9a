"""Tests for lmhead/lm/sharding.py that run in a second 8-device subprocess:
an ensemble split over the devices, decoding with its rows split over them,
and the vocabulary-parallel loss's options against numpy.

The subprocess is ``test_sharding.py`` run as a script (its docstring says
how); these checks have a file of their own so that the suite's workers run
the two subprocesses side by side.
"""

import numpy as np
import pytest

from tests.lm.test_sharding import TOLERANCE, run_checks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_checks(
        tmp_path_factory.mktemp("sharding"),
        ["loss_options", "ensemble", "split_decoding"],
    )


def test_ensemble_members_split_over_devices(results):
    """The members split over the devices train as when each member's batch
    is split over them: the same losses to float32 rounding, member by member."""
    split_members, split_batches = (results["ensemble"][k] for k in ("members", "data"))
    assert len(split_members) == 8 and len(split_members[0]) >= 2
    np.testing.assert_allclose(split_members, split_batches, rtol=1e-5)
    # The default config splits the members as mesh.members=8 does (the same
    # mesh, so the same program and bits); the batch split gives other bits.
    assert results["ensemble"]["default is members"]
    assert split_members != split_batches
    assert results["ensemble"]["meshes"] == {
        "6": [{"members": 6}, 6],
        "8": [{"members": 8}, 8],
        "11": [{"data": 1, "model": 1}, 1],
    }
    # The members differ (seeds and rates): the comparison is member by member.
    assert len({tuple(losses) for losses in split_members}) == 8


def test_loss_options_match_numpy(results):
    checks = results["loss_options"]
    differences = {k: v for k, v in checks.items() if k.startswith("case")}
    invalid = {k: v for k, v in checks.items() if k.startswith("invalid")}
    assert len(differences) == len(invalid) == 5
    assert max(differences.values()) < TOLERANCE, differences
    assert invalid.pop("invalid 4 (2, 4)") == 0  # without jit: none passed
    assert set(invalid.values()) == {2}


@pytest.mark.parametrize("decoder", ["greedy", "row keys", "beam", "hook"])
def test_split_decoding_matches_one_device(results, decoder):
    """Rows split over two devices decode the tokens of one device, with the
    same log-probs to float32 rounding (one sampling key for the batch and
    streamed chunks: ``test_sharding_streams.py``, slow)."""
    check = results["split_decoding"][decoder]
    assert check["same tokens"]
    assert check["log-prob difference"] < TOLERANCE


def test_split_decoding_errors_and_mesh_sizes(results):
    errors = results["split_decoding"]["errors"]
    assert "prompt has 6 rows" in errors["prefill"]
    assert "tokens has 6 rows" in errors["step"] == errors["generate"]
    assert "mesh must have one axis" in errors["two axes"]
    assert results["split_decoding"]["mesh sizes"] == {
        "1": None, "6": 6, "7": 7, "32": 8
    }  # fmt: skip


def test_split_decoding_runs_a_loop_per_device_but_with_a_hook(results):
    """Greedy and a key per row run a loop per device (one key for the batch
    too: test_sharding_streams.py); a processor hook, which sees every row,
    keeps the batch's loop."""
    assert results["split_decoding"]["own loops"] == {
        "greedy": True, "row keys": True, "hook": False
    }  # fmt: skip
