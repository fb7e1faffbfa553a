"""Measurement and prediction: the measurement store, CM-DARE model reproduction, and the cluster planner."""
