"""3-D tensor parallelism (Bian et al. 2021, Colossal-AI) of a transformer MLP block on a 2 x 2 x 2 cube
(world 8): every activation and weight element lives on one rank; each matmul gathers its operands over two
axes and reduces over the third, and the axes trade roles from one matmul to the next. The program lives in
cocoweave.workloads.

    cocoweave show examples/tp3d.py:mlp
    cocoweave check examples/tp3d.py:mlp --world-size 8
"""

import cocoweave as cw
from cocoweave import workloads


def mlp(B: int = 8, S: int = 8, H: int = 16, q: int = 2) -> cw.Program:
    return workloads.mlp_3d(B, S, H, q)
