"""Schedules: a program plus checked, typed transformation steps (steps.py: split, reorder, as_slice,
fuse, overlap, algorithm) that rebuild it, and the enumeration of every legal schedule."""
