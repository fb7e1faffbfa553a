"""The program IR: layouts, types, the value graph, DSL operations and the printer."""

from . import ops, semantics  # noqa: F401 - importing them fills the operation table (registry.py)
from .graph import WORLD, Group, Program, Value
from .layout import Layout, Local, MeshLayout, Position, Replicated, Sliced, slice_bounds
from .mesh import Mesh
from .printer import fingerprint, format_program

__all__ = ["WORLD", "Group", "Layout", "Local", "Mesh", "MeshLayout", "Position", "Program", "Replicated", "Sliced",
           "Value", "fingerprint", "format_program", "slice_bounds"]
