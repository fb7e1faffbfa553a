"""Freeze the measured figures of the old, long README into tests/data/readme_figures.txt (run once, issue #49).

When the README became a front page over docs/ (issue #49 item 6), its figures moved to docs/perf.md and the feature
pages. This script extracts every figure of the README as it was before that move (commit 21ff88d, read with
`git show`), one per line; tests/test_docs.py then checks that each is still written somewhere in README.md or
docs/*.md, so that no figure is lost. The list is frozen: rerunning the script on a later README would only list
what is there, so it reads the old README by commit.

    python scripts/freeze_readme_figures.py > tests/data/readme_figures.txt

A figure is a number with a unit (`0.88x`, `402 s`, `12.3 ms`, `8.9%`, `64 MiB`, `4.22 TB/s`) or a number with a
decimal point (a table cell such as `202.5`); a range `0.81-0.87x` gives its two ends. tests/test_docs.py imports
FIGURE and `present()` from here, so the extraction and the check are the same rule.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

OLD_README_COMMIT = "21ff88d"

_NUM = r"\d+(?:\.\d+)?"
_UNIT = r"(?:x|\s?(?:%|ms|us|µs|s|min|MiB|GiB|KiB|MB/s|GB/s|TB/s|MB|GB|KB|TFLOP/s))"
# A number not inside a longer number or word: with a unit (x written against it: "2 x 2" is a layout), or a
# decimal number on its own. A version's parts (2.13.0) are not figures.
FIGURE = re.compile(rf"(?<![\w.]){_NUM}{_UNIT}(?![\w/])|(?<![\w.])\d+\.\d+(?![\w.]|\.\d)")


def normalise(text: str) -> str:
    """Whitespace as one space, so a figure wrapped over two lines ("402\\ns") reads as written ("402 s")."""
    return re.sub(r"\s+", " ", text)


def figures(text: str) -> list[str]:
    """The distinct figures of a text, in the order they first appear."""
    return list(dict.fromkeys(m.group(0) for m in FIGURE.finditer(normalise(text))))


def present(figure: str, text: str) -> bool:
    """Whether `figure` is written in `text` as a figure of its own (not as part of a longer number)."""
    tail = r"(?![\w/])" if not figure[-1].isdigit() else r"(?!\d|\.\d)"
    return re.search(rf"(?<![\w.]){re.escape(figure)}{tail}", normalise(text)) is not None


def old_readme(repo: Path) -> str:
    return subprocess.run(["git", "show", f"{OLD_README_COMMIT}:README.md"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


def main() -> None:
    repo = Path(__file__).resolve().parent.parent
    out = [f"# Every figure of README.md at commit {OLD_README_COMMIT} (before it became a front page over docs/),",
           "# extracted once by scripts/freeze_readme_figures.py; tests/test_docs.py checks each is still written",
           "# in README.md or docs/*.md. Frozen: do not regenerate from a later README.",
           *figures(old_readme(repo))]
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
