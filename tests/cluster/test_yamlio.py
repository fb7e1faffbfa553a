"""Planner inputs read within bounds: an alias bomb, a self-referring alias, deep nesting, a huge or endless file are
refused with one short sentence, quickly; an ordinary file (the shipped catalog) still loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from cocoweave.cluster.catalog import DEFAULT_CATALOG
from cocoweave.cluster.yamlio import MAX_NODES, load_yaml
from cocoweave.errors import PlanningError


def alias_bomb() -> str:
    """The "billion laughs": 9 levels of 9 aliases, 9^9 values from a few hundred bytes."""
    text, prev = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n', "a"
    for name in "bcdefghi":
        text += f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]\n"
        prev = name
    return text


@pytest.mark.parametrize("text, words", [
    (alias_bomb(), f"more than {MAX_NODES:,} values"),
    ("a: &a [1, *a]\n", "refers to a value that contains it"),
    ("[" * 5000 + "]" * 5000 + "\n", "levels deep"),
    ("k:\n" + "".join(" " * i + "- a:\n" for i in range(0, 400, 2)), "levels"),
    ("x: " + "1" * 200_000 + "\n", "larger than"),
])
def test_hostile_yaml_is_refused_with_a_short_sentence(tmp_path: Path, text: str, words: str, returns_within):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    assert len(text) < 1000 or "larger" in words or "levels" in words
    err = returns_within(lambda: load_yaml(path, "LLM spec"))
    assert isinstance(err, PlanningError), err
    assert words in str(err) and str(path) in str(err) and len(str(err)) < 400


def test_an_endless_file_is_refused(returns_within):
    err = returns_within(lambda: load_yaml("/dev/zero", "catalog"))
    assert isinstance(err, PlanningError) and "larger than" in str(err)


def test_ordinary_files_and_small_aliases_still_load(tmp_path: Path):
    assert "machines" in load_yaml(DEFAULT_CATALOG, "catalog")
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {gpus_per_node: 8}\nm1: *b\nm2: *b\n")
    assert load_yaml(path, "catalog")["m2"] == {"gpus_per_node": 8}
