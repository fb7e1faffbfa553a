"""The cost model on meshes and uneven shares: a collective moves its bytes along its axis only, a rank's part is
its nested part (the largest one with shares), and the communication per rank of 1-D, 2-D and 3-D tensor
parallelism scales as Megatron, SUMMA and the 3-D algorithm say."""

from __future__ import annotations

import pytest

from cocoweave import workloads
from cocoweave.ir.loader import load_example
from cocoweave.perf.costmodel import AlphaBeta, Calibration, predict_plan
from cocoweave.plan import lower
from cocoweave.schedule.schedule import Schedule

FREE = AlphaBeta(0.0, 0.0)
NET = AlphaBeta(0.0, 1.0)  # 1 ms per MB moved per rank: the predicted comm time is the volume in MB


def _cal() -> Calibration:
    lines = {f"{op}/library": NET for op in ("all_reduce", "reduce_scatter", "all_gather")}
    return Calibration("torch", "cpu", 4, lines, {"float32": FREE}, {"float32": FREE})


def comm_mb(program, world) -> float:
    return predict_plan(lower(program), {}, world, _cal()).features["comm_mb"]


def test_a_collective_moves_bytes_along_its_axis_only():
    B, S, H = 8, 4, 16
    p = workloads.mlp_2d(B, S, H, q=2)  # the final all_reduce runs over y (2 ranks) on a [B/2, S, H] part
    pred = predict_plan(lower(p), {}, 4, _cal())
    ar = [ms for name, ms in pred.stage_ms.items() if name.endswith(":AR")]
    assert ar == [pytest.approx(2 * (1 / 2) * (B // 2) * S * H * 4 / 1e6)]


def test_uneven_shares_are_priced_at_the_largest_part():
    s = Schedule(load_example("adam.py:adam", N=1000))
    s.reorder(s.split(s.find("all_reduce")[0], 0, shares=(3, 1))[1])
    even = Schedule(load_example("adam.py:adam", N=1000))
    even.reorder(even.split(even.find("all_reduce")[0], 0)[1])
    cal = Calibration("torch", "cpu", 2, {}, {"float32": AlphaBeta(0.0, 1.0)}, {})
    uneven_c, even_c = (predict_plan(lower(x), {}, 2, cal).features["kernel_ms"] for x in (s, even))
    # the update runs on 750 of 1000 elements instead of 500 (slicing the whole w costs the same on both)
    assert even_c * 1.3 < uneven_c <= even_c * 750 / 500


def test_communication_per_rank_falls_with_2d_and_3d_tensor_parallelism():
    B, S, H = 64, 64, 64
    one = [comm_mb(workloads.mlp_1d(B, S, H), p) for p in (8, 64)]
    two = [comm_mb(workloads.mlp_2d(B, S, H, q=q), q * q) for q in (2, 8)]
    three = [comm_mb(workloads.mlp_3d(B, S, H, q=q), q ** 3) for q in (2, 4)]
    assert one[1] / one[0] == pytest.approx((63 / 64) / (7 / 8))  # Megatron: 2 (p-1)/p of the activations
    assert two[1] / two[0] == pytest.approx((7 / 8 / 8) / (1 / 2 / 2))  # SUMMA: (q-1)/q of 1/q of each operand
    assert three[1] / three[0] == pytest.approx((3 / 4 / 16) / (1 / 2 / 4))  # 3-D: (q-1)/q of 1/q^2
    assert two[1] < one[1] / 4 and three[1] < one[1] / 3
