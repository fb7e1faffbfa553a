"""Triton kernels: the dropout epilogue written by hand at the memory floor (and the random bits it draws),
the multi-tensor tables, and `codegen`, which generates one kernel per fused elementwise stage of a plan.

The torch backend runs the generated kernels on CUDA; the hand-written epilogue backs `cocoweave.nn`'s CUDA
epilogue. The hand-written optimizer steps the generated kernels are measured against (Adam/AdamW, SGD, LAMB) live
beside the benchmarks that use them, benchmarks/baselines/. On CPU the kernels run under TRITON_INTERPRET=1 (the
tests do this). Every launch disables FMA contraction (enable_fp_fusion=False): each operation rounds once, as
torch's CPU kernels and the reference backend compute, whatever Triton's default.
"""

from cocoweave.kernels.epilogue import bias_dropout_residual
from cocoweave.kernels.rng import random_bits

__all__ = [
    "bias_dropout_residual",
    "random_bits",
]
