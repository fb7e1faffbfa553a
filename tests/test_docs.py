"""The README is a front page over docs/ (issue #49 item 6): short, its two commands, links that resolve, and no
measured figure of the old README lost in the move (tests/data/readme_figures.txt, frozen by
scripts/freeze_readme_figures.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]


def _freezer():
    spec = importlib.util.spec_from_file_location("freeze_readme_figures", ROOT / "scripts/freeze_readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _without_code(text: str) -> str:
    """Markdown outside fenced code blocks and inline code (a link written in code is an example, not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+\s+(.*)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M),
                          flags=re.M)
    return {_slug(h) for h in headings}


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; its detail belongs in docs/ (at most 250)"


def test_quick_start_is_the_two_commands():
    text = README.read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert section, "README.md has no '## Quick start' section"
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", section.group(1), flags=re.S | re.M)
    assert len(blocks) == 1, "the Quick start has one code block"
    commands = [line.split("#")[0].strip() for line in blocks[0].splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):            # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_links_every_feature_to_docs():
    """The status table's rows each link to a page of docs/."""
    text = README.read_text()
    table = re.search(r"^## Status\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert table, "README.md has no '## Status' section"
    rows = [r for r in table.group(1).splitlines() if r.startswith("|") and not re.match(r"\|\s*-", r)][1:]
    assert rows, "the status table has no rows"
    unlinked = [r.split("|")[1].strip() for r in rows if not re.search(r"\]\(docs/[\w.-]+\.md", r)]
    assert not unlinked, f"status rows without a docs/ link: {unlinked}"


def test_no_figure_of_the_old_readme_is_lost():
    freezer = _freezer()
    frozen = [line for line in (ROOT / "tests/data/readme_figures.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert len(frozen) > 400, "the frozen list is the old README's figures"
    text = "\n".join(page.read_text() for page in PAGES)
    lost = [figure for figure in frozen if not freezer.present(figure, text)]
    assert not lost, f"figures of the old README found nowhere in README.md or docs/*.md: {lost}"


def test_figure_rule():
    freezer = _freezer()
    assert freezer.figures("0.88x and 1.26x, 402 s,\n12.3 ms; 8.9% of 2 x 2 on torch 2.13.0, 4.22 TB/s") == [
        "0.88x", "1.26x", "402 s", "12.3 ms", "8.9%", "4.22 TB/s"]
    assert freezer.present("0.8x", "goal 0.8x the peer") and not freezer.present("0.8x", "10.8x")
    assert freezer.present("402 s", "took 402\ns") and not freezer.present("2 s", "402 s")
    assert freezer.present("0.81", "0.81-0.87x") and not freezer.present("0.81", "0.815")
