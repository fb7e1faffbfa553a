"""Schedules: a program plus checked, replayable transformation steps (split, reorder, as_slice,
fuse, overlap), and the enumeration of every legal schedule."""
