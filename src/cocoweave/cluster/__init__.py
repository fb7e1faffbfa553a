"""Cluster planning: CM-DARE's reproduction, scaling laws, the GPU catalog, the planner and its plots.

Nothing here imports cocoweave's compiler (ir, schedule, plan, backends); the measurement store may be used.
"""
