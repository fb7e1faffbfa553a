"""Pipeline-parallel boundary (CoCoNet's third workload): the last layer of a stage ends in an
AllReduce of partial sums, dropout and a residual; the result is sent to the next stage. Its
schedule RS-C-P2P-AG sends only slices and all-gathers on the receiving stage. The dropout seed is a runtime
scalar `seed`: pass a new one every step for a fresh mask."""

import cocoweave as cw
from cocoweave import workloads


def boundary(B: int = 8, S: int = 128, H: int = 512) -> cw.Program:
    return workloads.boundary(B, S, H)
