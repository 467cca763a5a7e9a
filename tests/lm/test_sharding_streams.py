"""Split decoding's slower checks, in a third 8-device subprocess (slow:
about 40 s on 2 cores, beside the checks that ``make test`` runs): one
sampling key for a batch whose rows are split over two devices, and streamed
chunks there against one call."""

import pytest

from tests.lm.test_sharding import TOLERANCE, run_checks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_checks(tmp_path_factory.mktemp("sharding"), ["split_streams"])


@pytest.mark.parametrize(
    "decoder", ["one key", "one key, mixed stream", "stream", "stream top"]
)
def test_split_decoding_matches_one_device(results, decoder):
    """A single key's draws do not depend on how the rows are placed (nor
    on a device whose rows are all greedy, which makes no draws); the
    streamed chunks' tokens and log-probs (top ones too) match one device's
    to float32 rounding."""
    check = results["split_streams"][decoder]
    assert check["same tokens"]
    assert check["log-prob difference"] < TOLERANCE


def test_split_streams_are_one_call_bitwise(results):
    """On one device and split over two, the streamed chunks (top log-probs
    too) concatenated are that placement's one call, bit for bit; split, one
    key for the batch, the stream and its one call each run a loop per
    device."""
    assert results["split_streams"]["stream is one call"] == [True, True]
    own = dict.fromkeys(("one key", "one key, mixed stream", "stream", "whole"), True)
    assert results["split_streams"]["own loops"] == own
