"""The core-sharing measurement: synchronised processes burning a known CPU time per step, timed between barriers."""

from __future__ import annotations

import pytest

from cocoweave.cluster.profiling.core_sharing import CoreSharingError, sharing_factor


def test_one_process_per_core_shares_nothing():
    factor = sharing_factor(1, 2, busy_ms=15.0, steps=3)
    assert 1.0 <= factor < 2.0  # one process of 15 ms a step takes about 15 ms (barrier and start-up aside)


def test_bad_input_is_one_sentence():
    with pytest.raises(CoreSharingError, match="busy time above 0"):
        sharing_factor(3, 2, busy_ms=0.0)
