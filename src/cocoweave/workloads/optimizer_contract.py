"""The contract between the optimizer programs (workloads/optimizers.py) and cocoweave.optim, which runs them on
buckets: the names of their tensor inputs and state, the runtime scalars each family takes, and torch's state-dict
key of each state tensor. Written once here; both sides import it (workloads never import optim)."""

from __future__ import annotations

from collections.abc import Container

GRAD = "g"  # the gradient bucket, in the parameters' dtype (Local: the program reduces it)
WEIGHTS = "w"  # the weights the update reads and writes (fp32 masters when PARAMS is an input too)
PARAMS = "p"  # fp32 master weights for low-precision parameters: the parameters the model reads, p = cast(w)
ACTIVE = "active"  # masked programs: which elements have a gradient this step (bool)
STEPS = "t"  # masked Adam, AdamW, LAMB: the per-element step count (state)
STARTED = "started"  # masked SGD: per element, whether its momentum buffer started (state, 0 or 1)
MAX_NORM = "max_norm"  # clipped programs: the runtime scalar the global gradient norm is clipped to
EXP_AVG, EXP_AVG_SQ, MOMENTUM = "m", "v", "buf"  # the moments

GIVEN = (GRAD, ACTIVE)  # tensor inputs given afresh each step (not state)
ADAM_STATE = {EXP_AVG: "exp_avg", EXP_AVG_SQ: "exp_avg_sq"}  # program state name -> torch's state-dict key
SGD_STATE = {MOMENTUM: "momentum_buffer"}

# the runtime scalars, in the order the programs declare them
ADAMW_SCALARS = ("lr", "beta1", "beta2", "eps", "weight_decay", "step")  # adamw, adam_l2, lamb
ADAM_SCALARS = ("lr", "beta1", "beta2", "eps", "step")  # adam (the paper's order of operations)
SGD_SCALARS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "momentum_on")


def model_weights(inputs: Container[str]) -> str:
    """The input the model's parameters are: PARAMS where the program has one (fp32 masters), else WEIGHTS."""
    return PARAMS if PARAMS in inputs else WEIGHTS
