"""The experts of an expert-parallel mixture-of-experts layer (Mixtral / DeepSeek style SwiGLU experts): dispatch
all_to_all, the expert GEMMs, combine all_to_all. The program lives in cocoweave.workloads.

    cocoweave show examples/moe.py:experts
    cocoweave schedules examples/moe.py:experts              # the overlapped dispatch/experts/combine schedules
    cocoweave check examples/moe.py:experts --world-size 2 --backend torch
"""

import cocoweave as cw
from cocoweave import workloads


def experts(R: int = 2, E: int = 4, C: int = 8, D: int = 16, F: int = 32) -> cw.Program:
    return workloads.moe_experts(R, E, C, D, F)
