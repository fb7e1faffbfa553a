"""Cluster planning, by concern: `cmdare/` reproduces CM-DARE (its tables, features, regressors, the parameter-server
law), `profiling/` measures a user's torchrun script and models its step, `planning/` recommends a cluster (the
planner, its step times, checkpoint model and plot; `planning/llm/` for LLM layouts at scale). Shared by the three:
the machine catalog (`catalog.py`, `data/catalog.yaml`: every GPU's and network's figures, once), the input schemas
(`schema.py`) and YAML reading (`yamlio.py`); `data/` also ships CM-DARE's tables.

Nothing here imports cocoweave's compiler (ir, schedule, plan, backends); the measurement store may be used.
"""
