"""Drop-in tensor- and pipeline-parallel PyTorch modules built on cocoweave's collectives and dropout hash.

Every module takes a `group` (a torch.distributed ProcessGroup, None for the world, or a DeviceMesh: its "tp" dim)
and computes what a single-process model with the same full weights and the same dropout seed computes, forward and
backward. State dicts load whole or at another tensor-parallel size (nn/state.py).
"""

from .functional import (
    bias_dropout_residual,
    copy_to_parallel,
    gather_from_parallel,
    mix_seed,
    reduce_from_parallel,
    scatter_to_parallel,
)
from .groups import mesh_coords, new_group, parallel_groups, parallel_mesh
from .layers import ColumnParallelLinear, RowParallelLinear, full_linear_weights, resolve_group
from .llama import Llama, LlamaBlock, LlamaConfig, llama_plan
from .moe import MoE, expert_parameters, full_experts
from .moe_block import MoEBlock, MoEConfig, MoEModel
from .parallelize import parallelize
from .pipeline import Pipeline, PipelineBoundary, StageModule
from .state import full_state_dict, sharded_optimizer_state_dict, sharded_state_dict, unshard
from .transformer import ReferenceBlock, TransformerBlock, block_seeds, sequence_gather, sequence_slice
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear", "Pipeline", "PipelineBoundary", "ReferenceBlock", "RowParallelLinear", "StageModule",
    "TransformerBlock",
    "bias_dropout_residual", "block_seeds", "copy_to_parallel", "full_linear_weights", "gather_from_parallel",
    "mesh_coords", "mix_seed", "new_group", "parallel_groups", "parallel_mesh", "reduce_from_parallel",
    "scatter_to_parallel", "sequence_gather", "sequence_slice",
]
__all__ += ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
__all__ += ["Llama", "LlamaBlock", "LlamaConfig", "llama_plan", "parallelize"]
__all__ += ["full_state_dict", "resolve_group", "sharded_optimizer_state_dict", "sharded_state_dict", "unshard"]
__all__ += ["MoE", "MoEBlock", "MoEConfig", "MoEModel", "expert_parameters", "full_experts"]
