"""The version of cocoweave (one place; the package and every report read it from here)."""

__version__ = "0.1.0"
