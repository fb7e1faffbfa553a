"""The hand-written Triton optimizer steps at the memory floor (Adam/AdamW, SGD, LAMB; flat and multi-tensor): the
yardstick the generated kernels are measured against (benchmarks/kernels.py, benchmarks/codegen.py) and checked
against torch in tests/kernels. No optimizer of cocoweave runs them (optim/ runs generated code), so they live beside
the benchmarks that use them. Importable as `baselines` with benchmarks/ on the path (a benchmark script's own
folder; tests/kernels/conftest.py adds it)."""

from baselines.adam import adam_step, adam_step_multi
from baselines.lamb import lamb_apply, lamb_apply_multi, lamb_norms, lamb_norms_multi, lamb_step, lamb_step_multi
from baselines.sgd import sgd_step, sgd_step_multi

__all__ = ["adam_step", "adam_step_multi", "lamb_apply", "lamb_apply_multi", "lamb_norms", "lamb_norms_multi",
           "lamb_step", "lamb_step_multi", "sgd_step", "sgd_step_multi"]
