"""Backends execute programs (and, once lowered, plans): `reference` simulates every rank in one process."""
