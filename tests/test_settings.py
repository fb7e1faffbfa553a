"""The COCOWEAVE_* settings: one table, documented in docs/settings.md, each read by the module it names, defaults when
unset or empty, and one sentence naming the variable when a value is malformed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cocoweave import launch, settings
from cocoweave.backends.torch.executable import default_kernels
from cocoweave.cli.options import load_timeout
from cocoweave.errors import SettingsError
from cocoweave.settings_doc import markdown
from cocoweave.storage import codecache

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "cocoweave"
CONSTANTS = {name: value for name, value in vars(settings).items() if isinstance(value, settings.Setting)}


def test_docs_settings_md_is_the_table():
    assert (ROOT / "docs" / "settings.md").read_text(encoding="utf-8") == markdown(), \
        "docs/settings.md is stale: python -m cocoweave.settings_doc > docs/settings.md"


def test_every_setting_is_declared_once_and_read_by_the_module_it_names():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names)) and all(n.startswith("COCOWEAVE_") for n in names)
    for constant, setting in CONSTANTS.items():
        if setting.read_by.startswith("tests/"):
            assert setting.name in (ROOT / setting.read_by).read_text(encoding="utf-8")
            continue
        module = SRC.parent.joinpath(*setting.read_by.split("."))
        path = module.with_suffix(".py") if module.with_suffix(".py").exists() else module / "__init__.py"
        assert path.exists(), f"{setting.name}: read_by {setting.read_by} is not a module"
        assert f"settings.{constant}." in path.read_text(encoding="utf-8"), \
            f"{setting.name}: {setting.read_by} does not read settings.{constant}"


def test_every_cocoweave_variable_named_in_the_sources_is_in_the_table():
    declared = {s.name for s in settings.SETTINGS}
    named = {m for p in SRC.rglob("*.py") for m in re.findall(r"COCOWEAVE_[A-Z_]+", p.read_text(encoding="utf-8"))}
    assert named - declared == set()


def test_unset_or_empty_is_the_default(monkeypatch):
    for setting in settings.SETTINGS:
        monkeypatch.setenv(setting.name, "")
    assert default_kernels() == "auto" and load_timeout() == 60.0 and not settings.DEBUG.get()
    assert codecache.max_files() == 1000 and codecache.max_bytes() == 100_000_000
    assert settings.PROFILE_STEPS.get() == 20 and settings.STORE.get() is None
    assert launch.max_local_ranks() >= 16


def test_values_are_typed(monkeypatch):
    monkeypatch.setenv("COCOWEAVE_CACHE_MAX_MB", "0.0025")
    monkeypatch.setenv("COCOWEAVE_DEBUG", "yes")
    monkeypatch.setenv("COCOWEAVE_MAX_LOCAL_RANKS", "40")
    monkeypatch.setenv("COCOWEAVE_STORE", "/tmp/elsewhere")
    assert codecache.max_bytes() == 2500 and settings.DEBUG.get() and launch.max_local_ranks() == 40
    assert settings.STORE.get() == Path("/tmp/elsewhere")


@pytest.mark.parametrize(("name", "value", "read", "expected"), [
    ("COCOWEAVE_KERNELS", "fast", default_kernels, "one of auto, triton, compiled, torch"),
    ("COCOWEAVE_CACHE_MAX_FILES", "lots", codecache.max_files, "a number of files above 0"),
    ("COCOWEAVE_CACHE_MAX_MB", "-1", codecache.max_bytes, "a number of megabytes above 0"),
    ("COCOWEAVE_MAX_LOCAL_RANKS", "0", launch.max_local_ranks, "a whole number of at least 1"),
    ("COCOWEAVE_LOAD_TIMEOUT", "soon", load_timeout, "a number of seconds"),
    ("COCOWEAVE_DEBUG", "maybe", settings.DEBUG.get, "1 or 0 (on or off)"),
    ("COCOWEAVE_PROFILE_STEPS", "2.5", settings.PROFILE_STEPS.get, "a whole number of at least 0"),
])
def test_a_malformed_value_is_one_sentence_naming_the_variable(monkeypatch, name, value, read, expected):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=f"^{re.escape(f'{name} must be {expected}, got {value!r}')}$"):
        read()
