"""The paper's workloads as DSL programs: data-parallel optimizers (SGD with momentum, Adam, AdamW,
LAMB), the Megatron-style model-parallel block, the pipeline-parallel stage boundary, a transformer
MLP block in 1-D, 2-D and 3-D tensor parallelism (meshes.py), and the experts of an expert-parallel MoE layer
(experts.py).

Every optimizer program takes the same options, so that `cocoweave.optim` can build the variant it
needs and a user can print, check or tune any of them:
- `grad="local"`: the program averages the per-rank gradients itself (its all_reduce is what the
  schedules split, reorder and fuse); `grad="reduced"`: the gradient is given already reduced
  (Replicated), as after clipping by global norm or on a single rank.
- `reduction`: the all_reduce's op ("avg", "sum" or "adasum"); `weights` (Adam, AdamW: one positive int per
  rank, e.g. its batch size, HetSeq's per-rank batch) make "avg" the weighted average sum(w_r g_r) / sum(w_r).
- `param_dtype`: "float32", or "bfloat16"/"float16" for low-precision parameters `p` with float32
  master weights `w`: the update runs on the masters and writes `p = cast(w)`, so sliced schedules
  can keep the masters sliced and all-gather only the half-size parameters.
"""

from .experts import moe_dropless, moe_dropless_backward, moe_experts
from .meshes import mlp_1d, mlp_2d, mlp_3d, mlp_torch
from .optimizers import GRADS, adam, adamw, lamb, reduce_gradient, sgd
from .parallel import boundary, layer

__all__ = ["GRADS", "adam", "adamw", "boundary", "lamb", "layer", "mlp_1d", "mlp_2d", "mlp_3d", "mlp_torch",
           "moe_dropless", "moe_dropless_backward", "moe_experts", "reduce_gradient", "sgd"]
