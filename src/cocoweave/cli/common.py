"""What every command shares: turning cocoweave errors into one sentence and an exit code that says
what kind of failure it was (bad input, a mismatch, a rank that failed, a bug of ours), and consoles and
tables that never cut what they print."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import settings
from ..errors import CocoweaveError

console = Console()
err_console = Console(stderr=True)
if not console.is_terminal:  # piped or redirected: tables take the width they need, nothing is cut
    console.width = 1000

EXIT_USAGE = 2  # bad input: the user can fix it
EXIT_MISMATCH = 1  # a check found a difference
EXIT_INTERNAL = 3  # a bug in cocoweave
EXIT_RANK_FAILED = 4  # a rank crashed, hung or raised while running (launch.BackendError naming the ranks)


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print `error: message` on stderr, the message as plain text (never markup), and return the Exit to raise."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)
    return typer.Exit(code)


def table(title: str, columns: dict[str, str]) -> Table:
    """A rich table titled `title` (plain text) with `columns` {name: justify}: cells wrap, never cut."""
    out = Table(title=Text(title), title_justify="left")
    for name, justify in columns.items():
        out.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    return out


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a command; a CocoweaveError becomes one line on stderr and exit code 2 (4 when ranks failed),
    never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CocoweaveError as e:
            raise fail(str(e), EXIT_RANK_FAILED if getattr(e, "ranks", None) else EXIT_USAGE) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except MemoryError:
            raise fail("this machine ran out of memory; use smaller sizes or fewer ranks") from None
        except Exception as e:  # a bug of ours: one line, the traceback only on request
            if settings.DEBUG.get():
                raise
            raise fail(f"internal error: {type(e).__name__}: {e} (set COCOWEAVE_DEBUG=1 for the traceback; "
                       "please report it)", EXIT_INTERNAL) from None

    return wrapper
