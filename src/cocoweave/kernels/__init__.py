"""Triton kernels: hand-written ones at the memory floor (fused optimizer steps, flat and multi-tensor, and the
dropout epilogue), and `codegen`, which generates one kernel per fused elementwise stage of a plan.

The torch backend runs the generated kernels on CUDA; the hand-written ones are the yardstick the generated
ones are measured against (benchmarks/kernels.py, benchmarks/codegen.py) and back `cocoweave.nn`'s CUDA epilogue.
Each wrapper takes torch tensors and launches one kernel (LAMB: two phases). On CPU the kernels run under
TRITON_INTERPRET=1 (the tests do this). Every launch disables FMA contraction (enable_fp_fusion=False): each
operation rounds once, as torch's CPU kernels and the reference backend compute, whatever Triton's default.
"""

from cocoweave.kernels.adam import adam_step, adam_step_multi
from cocoweave.kernels.epilogue import bias_dropout_residual
from cocoweave.kernels.lamb import (
    lamb_apply,
    lamb_apply_multi,
    lamb_norms,
    lamb_norms_multi,
    lamb_step,
    lamb_step_multi,
)
from cocoweave.kernels.rng import random_bits
from cocoweave.kernels.sgd import sgd_step, sgd_step_multi

__all__ = [
    "adam_step",
    "adam_step_multi",
    "bias_dropout_residual",
    "lamb_apply",
    "lamb_apply_multi",
    "lamb_norms",
    "lamb_norms_multi",
    "lamb_step",
    "lamb_step_multi",
    "random_bits",
    "sgd_step",
    "sgd_step_multi",
]
