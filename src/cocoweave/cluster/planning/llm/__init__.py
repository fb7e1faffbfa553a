"""LLM planning at scale (`cocoweave plan --llm`): a transformer spec, tp x pp x dp layouts, group-aware
collectives, Korthikanti memory, the step model, layout search, published runs and calibration."""
