"""Planning a cluster (`cocoweave plan`): the planner's step times per configuration (`step_times`: from YAML, a
CM-DARE model or a run profile), the checkpoint model, the planner (Pareto front, recommendation), the job under a
resize plan (`resize`), the plan's plot, and `llm/`, the planner for LLM layouts at scale."""
