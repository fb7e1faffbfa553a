"""Triton kernels at the memory floor: fused optimizer steps (flat and multi-tensor) and the dropout epilogue.

Each wrapper takes torch tensors and launches one kernel (LAMB: two phases). On CPU the kernels run under
TRITON_INTERPRET=1 (the tests do this); the torch backend calls them on CUDA.
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
