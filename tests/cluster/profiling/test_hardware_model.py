"""MODELLED steps on catalog hardware: per-operation rooflines for compute, alpha-beta rings on the slowest
link for communication, work scaled to the target world as it scaled on the measured ones."""

from __future__ import annotations

import pytest

from cocoweave.cluster.catalog import Catalog, GPUSpec, MachineType, NetworkSpec
from cocoweave.cluster.profiling.hardware_model import WorkCounts, comm_ms, compute_ms, link_of, modelled_step
from cocoweave.cluster.profiling.host_scaling import Traffic
from cocoweave.errors import PlanningError

GPU = GPUSpec("G", "test GPU", {"float32": 10.0, "bfloat16": 100.0}, hbm_gb_s=1000.0, memory_gb=80, source="s")
NVL = NetworkSpec("nvl", 100.0, 2.0, "s")
IB = NetworkSpec("ib", 10.0, 5.0, "s")
NODE = MachineType("node", "G", 10.0, None, 0.0, 60.0, gpus_per_node=8, intra_node="nvl", inter_node="ib")


def catalog(launch_us: float = 0.0) -> Catalog:
    return Catalog((NODE,), None, None, {"G": GPU}, {"nvl": NVL, "ib": IB},
                   {"compute": 1.0, "memory": 1.0, "network": 1.0}, launch_us, "test")


def test_each_operation_is_priced_by_its_roofline():
    work = WorkCounts(((1e12, 1e6, "float32", 1),  # compute-bound: 1e12 / 1e13 = 0.1 s
                       (0.0, 1e9, "float32", 2),  # memory-bound: 1 GB / 1 TB/s = 1 ms, twice
                       (1e12, 1e6, "bfloat16", 1)),  # ten times the float32 peak
                      1, (0.0, 0.0), (0.0, 0.0))
    assert compute_ms(work, GPU, 1, catalog()) == pytest.approx(100.0 + 2.0 + 10.0)
    tiny = WorkCounts(((1.0, 1.0, "float32", 50),), 1, (0.0, 0.0), (0.0, 0.0))
    assert compute_ms(tiny, GPU, 1, catalog(launch_us=10.0)) == pytest.approx(0.5)  # 50 launches of 10 us


def test_work_scales_to_the_target_world_as_measured():
    strong = WorkCounts(((4e12, 0.0, "float32", 1),), reference_world=2, flops_fit=(0.0, 8e12), bytes_fit=(0.0, 0.0))
    assert compute_ms(strong, GPU, 8, catalog()) == pytest.approx(400.0 * 2 / 8)  # a global batch split 8 ways


def test_rings_use_the_slowest_link_the_world_spans():
    traffic = Traffic({"all_reduce": (1.0, 1e9)})
    assert link_of(NODE, 1, catalog()) is None and link_of(NODE, 8, catalog()).key == "nvl"
    assert link_of(NODE, 16, catalog()).key == "ib"
    inside = comm_ms(traffic, NVL, 8, catalog())
    assert inside == pytest.approx(1e3 * (14 * 2e-6 + 2 * 7 / 8 * 1e9 / 100e9))
    assert comm_ms(traffic, IB, 16, catalog()) > 9 * inside
    step = modelled_step(WorkCounts((), 1, (0.0, 0.0), (0.0, 0.0)), traffic, NODE, 4, catalog())
    assert step.link == "nvl" and step.total_ms == pytest.approx(step.comm_ms)


def test_a_machine_without_gpu_figures_is_a_sentence():
    other = MachineType("x", "UNKNOWN", 1.0, None, 0.0, 60.0, inter_node="ib")
    with pytest.raises(PlanningError, match="no spec-sheet entry for GPU UNKNOWN"):
        modelled_step(WorkCounts((), 1, (0.0, 0.0), (0.0, 0.0)), Traffic({}), other, 2, catalog())
