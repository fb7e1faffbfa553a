"""Exception classes of cocoweave. Every error a user can cause is one of these, with one sentence."""

from __future__ import annotations


class CocoweaveError(Exception):
    """Base class: something the user asked for is wrong; the message says what and where."""


class ProgramError(CocoweaveError):
    """A program violates a typing, shape or layout rule of the DSL."""


class ScheduleError(CocoweaveError):
    """A transformation's precondition does not hold."""


class LoadError(CocoweaveError):
    """A program file could not be loaded (syntax error, missing function, bad sizes)."""


class InputError(CocoweaveError):
    """Inputs given to an executable do not match the program (names, shapes, dtypes, devices)."""


class BackendError(CocoweaveError):
    """A backend failed to execute a plan (a rank died, a timeout, a mismatch between ranks)."""


class StoreError(CocoweaveError):
    """The measurement store was given data that does not match its schema, or is unreadable."""


class PlanningError(CocoweaveError):
    """A configuration request cannot be satisfied (no configuration meets the deadline or budget)."""


class ParallelConfigError(CocoweaveError, ValueError):
    """A parallel layer or model was configured in a way its process group cannot split (sizes, heads, stages)."""


class OptimizerError(CocoweaveError, ValueError):
    """A cocoweave.optim optimizer was given a hyperparameter, parameter or state dict it cannot use."""


class CheckpointError(CocoweaveError):
    """A checkpoint is missing, incomplete (a save was interrupted) or does not match what loads it."""


class ElasticError(CocoweaveError, ValueError):
    """An elastic-training policy, sampler state or resize plan cannot be used as given."""


class SettingsError(CocoweaveError, ValueError):
    """An environment variable cocoweave reads (a COCOWEAVE_* setting, a launcher's rank variable) is malformed,
    or two launchers' variables disagree."""


class PreflightError(CocoweaveError):
    """A pre-flight check found that a job would hang (a send without its receive, a group entered in different
    orders, a circular wait) or would not fit its device's memory; the message names the ranks, operations and
    step."""
