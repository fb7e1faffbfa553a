"""Read a planner input file (catalog, profile, LLM spec) as YAML, turning every failure into one sentence.

Planner inputs may come from anyone, so reading one is bounded: aliases may not expand the document beyond
`MAX_NODES` values (a few hundred bytes of nested aliases, the "billion laughs", otherwise expand to billions),
no alias may refer to a value that contains it, and the text itself is at most `MAX_BYTES`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from cocoweave.errors import PlanningError

MAX_NODES = 20_000  # values after alias expansion: the shipped catalog has ~1,500
MAX_BYTES = 128 * 2**10  # ten times the shipped catalog (12 KB)
MAX_DEPTH = 64  # nesting of collections: the shipped catalog's is 4
MAX_MESSAGE = 300  # characters of a user's value quoted in an error message


def shorten(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` cut to `limit` characters with the number left out said, so an error quoting a user's value stays one
    short sentence whatever the value."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


# libyaml's parser when PyYAML has it (ten times faster, with its own nesting limit), else PyYAML's own
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _flow_depth(text: str) -> int:
    """The deepest nesting of [ and { in `text` (quotes not parsed: an upper bound). PyYAML's scanner looks ahead
    over a whole flow collection, in time quadratic in its depth, before the composer can refuse it."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    return deepest


def _expanded_size(node: yaml.Node, budget: int) -> int:
    """Values `node` stands for once every alias is expanded, counting up to `budget` (then stopping); ValueError
    for an alias inside the value it names (a cycle) or nesting deeper than MAX_DEPTH."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(n: yaml.Node) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ValueError("an alias refers to a value that contains it")
        if len(active) >= MAX_DEPTH:
            raise ValueError(f"more than {MAX_DEPTH} levels of nesting")
        active.add(key)
        total = 1
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [part for pair in n.value for part in pair]
        else:
            children = []
        for child in children:  # stop as soon as the budget is spent
            total += size(child)
            if total > budget:
                break
        active.discard(key)
        sizes[key] = total
        return total

    return size(node)


def load_yaml(path: str | os.PathLike, what: str) -> Any:
    """The parsed document of `path`; PlanningError names the file, and the line for syntax errors."""
    path = Path(path)
    try:
        with path.open("rb") as f:  # at most MAX_BYTES + 1, so a FIFO or /dev/zero cannot hang or fill memory
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise PlanningError(f"cannot read {what} {path}: {exc.strerror or exc}.") from exc
    if len(raw) > MAX_BYTES:
        raise PlanningError(f"{what} {path} is larger than the {MAX_BYTES:,} bytes a planner input may be.")
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise PlanningError(f"{what} {path} is not UTF-8 text (byte {exc.start}).") from exc
    if _flow_depth(text) > MAX_DEPTH:
        raise PlanningError(f"{what} {path} nests its values more than {MAX_DEPTH} levels deep, too deep for a "
                            "planner input.")
    loader = _LOADER(text)
    try:
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            expanded = _expanded_size(node, MAX_NODES)
        except (ValueError, RecursionError) as exc:
            why = str(exc) if isinstance(exc, ValueError) else f"more than {MAX_DEPTH} levels of nesting"
            raise PlanningError(f"{what} {path}: {why}; planner inputs must be plain trees at most {MAX_DEPTH} "
                                "levels deep.") from None
        if expanded > MAX_NODES:
            raise PlanningError(f"{what} {path} holds more than {MAX_NODES:,} values once its aliases are expanded, "
                                "more than a planner input may.")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = shorten(str(getattr(exc, "problem", None) or "syntax error"))
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise PlanningError(f"{what} {path} is not valid YAML{where}: {problem}.") from exc
    finally:
        loader.dispose()
