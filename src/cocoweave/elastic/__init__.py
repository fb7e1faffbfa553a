"""Elastic training: what a data-parallel job trains when its world grows or shrinks, chosen explicitly.

    policy = BatchPolicy.keep_global(12, micro_batch=4)          # or BatchPolicy.scale(16, 4, lr_rule="sqrt")
    sampler = ElasticSampler(len(dataset), seed=0)               # sampler.state_dict() goes into the checkpoint
    plan = policy.plan(world_size)                               # again after every restart at a new size
    batch = sampler.next_batch(plan.global_batch)                # every step; the same on every rank
    for part in plan.micro_batches(rank):                        # no_sync() for all but the last
        (mean_loss(batch[part.start:part.stop]) * plan.weight(len(part))).backward()
    optimizer.param_groups[0]["lr"] = base_lr * plan.lr_scale    # (x AdaScale's gain for lr_rule="adascale")

Policies:
- `keep_global`: the global batch B stays fixed. Rank r of W takes B // W samples, one more for r < B % W
  (12 on 5 ranks: 3, 3, 2, 2, 2), in micro-batches of at most `micro_batch` samples with gradient accumulation;
  each micro-batch's mean loss is weighted so that the gradient averaged over the ranks is the mean over all B
  samples. The optimisation is the same at every world size, float rounding aside.
- `scale`: each rank keeps b = B0 / W0 samples (B0 the global batch at the base world size W0), so the global
  batch is b x W, and the learning rate follows a rule of k = W / W0:
    linear   lr0 x k            Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
    sqrt     lr0 x sqrt(k)      Krizhevsky 2014, "One weird trick for parallelizing convolutional neural
                                networks"; Hoffer et al. 2017, "Train longer, generalize better"; for Adam,
                                Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"
    adascale lr0 x r_t          Johnson et al. 2020, "AdaScale SGD: A User-Friendly Algorithm for Distributed
                                Training": r_t = (s2/B0 + m2) / (s2/B + m2) in [min(1, k), max(1, k)], from the
                                per-sample gradient variance s2 and squared gradient norm m2, estimated each step
                                from the ranks' gradients (`AdaScale`, `gradient_moments`); its theory is for SGD
                                (with Adam the gain is a heuristic).

`ElasticSampler` fixes the global sample order by (seed, epoch) and counts the samples consumed; each step takes
the next global batch of that order, split over the current ranks, so within an epoch no sample is skipped or seen
twice across resizes. The time and cost of a job under a resize plan for each policy is the planner's model,
`cocoweave.cluster.planning.resize` (`predict_resizes`, `parse_resize_plan`: importable from here too).

The package by job: `policy` (BatchPolicy, StepPlan), `sampler` (ElasticSampler), `adascale` (AdaScale and the
gradient moments it reads).
"""

from ..cluster.planning.resize import (  # noqa: F401 - the planner's model of a resized job, importable from here
    ElasticPrediction,
    PhaseCost,
    Resize,
    parse_resize_plan,
    parse_schedule,
    predict_resizes,
    progress_per_step,
)
from .adascale import AdaScale as AdaScale
from .adascale import gradient_moments as gradient_moments
from .policy import LR_RULES as LR_RULES
from .policy import MODES as MODES
from .policy import BatchPolicy as BatchPolicy
from .policy import Mode as Mode
from .policy import StepPlan as StepPlan
from .policy import split_evenly as split_evenly
from .sampler import ElasticSampler as ElasticSampler
