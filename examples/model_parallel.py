"""Megatron-style row-parallel block (CoCoNet's second workload): a matmul on sliced weights gives
per-rank partial sums; AllReduce them, add the bias, dropout, add the residual. The dropout seed is a runtime
scalar `seed`: pass a new one every step for a fresh mask."""

import cocoweave as cw
from cocoweave import workloads


def layer(B: int = 8, S: int = 128, H: int = 512) -> cw.Program:
    return workloads.layer(B, S, H)
