"""`cocoweave demo`: check and time every schedule of the paper's workloads against plain torch baselines
on a local world, and write a report (runner: the work; baselines: the plain torch code; report: outputs)."""

from .runner import WORKLOADS, DemoResult, Row, WorkloadResult, run_demo

__all__ = ["WORKLOADS", "DemoResult", "Row", "WorkloadResult", "run_demo"]
