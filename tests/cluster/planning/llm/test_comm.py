"""Collectives priced on their own group and link, computed by hand."""

from __future__ import annotations

import pytest

from cocoweave.cluster.catalog import GPUSpec, MachineType, NetworkSpec
from cocoweave.cluster.planning.llm.comm import Link, collective_s, group_link, priced
from cocoweave.cluster.planning.llm.system import Efficiency, System

GPU = GPUSpec("G", "g", {"float32": 10.0, "bfloat16": 100.0}, 1000.0, 80.0, "s")
NODE = MachineType("node", "G", 10.0, None, 0.0, 60.0, 8, "nvl", "ib")
SYSTEM = System(NODE, GPU, NetworkSpec("nvl", 100.0, 2.0, "s"), NetworkSpec("ib", 10.0, 5.0, "s"),
                Efficiency(intra=1.0, inter=1.0))


def test_ring_all_reduce_by_hand():
    link = Link("l", 1e11, 1e-6)
    # 2 (g-1) alpha + 2 (g-1)/g n / B with g = 8, n = 1 GB
    assert collective_s("all_reduce", 1e9, 8, link) == pytest.approx(14e-6 + 2 * 7 / 8 * 1e9 / 1e11)
    assert collective_s("all_gather", 1e9, 8, link) == pytest.approx(7e-6 + 7 / 8 * 1e9 / 1e11)
    assert collective_s("p2p", 1e6, 2, link) == pytest.approx(1e-6 + 1e6 / 1e11)
    assert collective_s("all_reduce", 1e9, 1, link) == 0.0


def test_tree_wins_small_messages_on_many_ranks():
    link = Link("l", 1e10, 10e-6)
    assert priced("all_reduce", 1e3, 1024, link)[1] == "tree"  # latency bound: 2 log2(g) steps, not 2 (g - 1)
    assert priced("all_reduce", 1e10, 8, link)[1] == "ring"  # bandwidth bound: ring moves 2 (g-1)/g n, tree 2 n


def test_group_link_follows_the_layout():
    assert group_link(SYSTEM, 8, 1).name == "nvl"  # a tp group of 8 inside a node
    assert group_link(SYSTEM, 2, 4).name == "nvl"  # dp 2 strided by tp 4 still inside a node
    dp = group_link(SYSTEM, 16, 8)  # dp across nodes, one member per node: one 10 GB/s rail
    assert (dp.name, dp.bandwidth) == ("ib", pytest.approx(10e9))
    wide = group_link(SYSTEM, 64, 2)  # four members per node drive four rails
    assert wide.bandwidth == pytest.approx(40e9)
    assert group_link(SYSTEM, 64, 1).bandwidth == pytest.approx(80e9)  # eight rails, under NVLink's 100
    assert group_link(SYSTEM, 1, 1) is None


def test_all_to_all_by_hand():
    """Each rank sends 1/g of its n bytes to each of the g - 1 others: peers on its node over NVLink, the rest
    through its own NIC, both at once; one latency per peer."""
    from cocoweave.cluster.planning.llm.comm import all_to_all_s

    n = 8e9
    # 4 ranks one apart: all on one node: 3/4 n over NVLink (100 GB/s), 3 steps of 2 us
    assert all_to_all_s(n, 4, 1, SYSTEM) == pytest.approx(3 * 2e-6 + 3 / 4 * n / 100e9)
    # 16 ranks one apart: 8 per node; 7/16 n over NVLink, 8/16 n over InfiniBand (10 GB/s), 15 steps of 5 us
    assert all_to_all_s(n, 16, 1, SYSTEM) == pytest.approx(15 * 5e-6 + max(7 / 16 * n / 100e9, 8 / 16 * n / 10e9))
    # 4 ranks 8 apart: one per node, everything but the own share crosses the NIC
    assert all_to_all_s(n, 4, 8, SYSTEM) == pytest.approx(3 * 5e-6 + 3 / 4 * n / 10e9)
    assert all_to_all_s(n, 1, 1, SYSTEM) == 0.0
