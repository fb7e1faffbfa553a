"""2-D tensor parallelism (SUMMA / Optimus style) of a transformer MLP block on a 2 x 2 mesh (world 4):
activations and weights are 2 x 2 blocks; each matmul gathers a row or column panel over one axis and the
second reduces its partial sums over the other. The program lives in cocoweave.workloads.

    cocoweave show examples/tp2d.py:mlp
    cocoweave check examples/tp2d.py:mlp --world-size 4 [--backend torch]
"""

import cocoweave as cw
from cocoweave import workloads


def mlp(B: int = 8, S: int = 16, H: int = 32, q: int = 2) -> cw.Program:
    return workloads.mlp_2d(B, S, H, q)
