"""Profiles derived from the CM-DARE models: close to the measurements, and bending where the PS saturates."""

from __future__ import annotations

import pytest

from cocoweave.cluster.cmdare import tables as data
from cocoweave.cluster.planning.step_times import profile_for_model
from cocoweave.errors import CocoweaveError, PlanningError

try:
    DATA = data.find_data_dir()
except CocoweaveError:
    pytest.skip("CM-DARE data (shared/data/cmdare) not available", allow_module_level=True)


@pytest.fixture(scope="module")
def res32():
    return profile_for_model("ResNet-32", DATA, max_workers=8, max_ps=2)


def step(profile, gpu, ps, workers):
    [point] = [p for p in profile.points if (p.gpu, p.ps, p.workers) == (gpu, ps, workers)]
    return point.step_time_s


def test_single_worker_step_time_is_close_to_the_measurement(res32):
    speed = data.load_speed(DATA)
    for gpu in ("K80", "P100"):
        measured = speed[(speed["model"] == "res32") & (speed["gpu"] == gpu)]["step_time_s"].mean()
        assert step(res32, gpu, 1, 1) == pytest.approx(measured, rel=0.1)
    assert step(res32, "V100", 1, 1) < step(res32, "P100", 1, 1)  # V100 derived from measured ratios


def test_p100_saturates_with_one_ps_and_a_second_ps_helps(res32):
    speedup_8 = step(res32, "P100", 1, 1) / step(res32, "P100", 1, 8)
    assert speedup_8 < 6  # far from linear: the parameter server is the bottleneck
    assert step(res32, "P100", 2, 8) < step(res32, "P100", 1, 8)
    assert step(res32, "K80", 1, 1) / step(res32, "K80", 1, 8) > 7  # K80 still scales
    assert 1.0 < res32.checkpoint_s < 10.0


def test_unknown_model_is_a_planning_error():
    with pytest.raises(PlanningError, match="unknown model 'resnet-999'"):
        profile_for_model("resnet-999", DATA)
