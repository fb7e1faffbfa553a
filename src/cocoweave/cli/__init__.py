"""The `cocoweave` command line (typer + rich)."""

from __future__ import annotations

import inspect
import logging
from typing import Annotated

import typer

from ..log import log_to_stderr
from ..version import __version__
from .cluster_commands import plan_command
from .demo import demo
from .perf_commands import perf_app
from .preflight_commands import preflight
from .profile_commands import profile
from .program_commands import run, show
from .schedule_commands import check, schedules
from .tune_commands import measure, tune

HELP = """cocoweave: write a distributed workload once; rewrite, check, run and tune it.

Program files (FILE.py:FUNCTION) are trusted code: cocoweave runs them in its own process, as `python FILE.py`
would, so they can read, write or delete anything you can. Run only programs you trust. Loading one may take at
most $COCOWEAVE_LOAD_TIMEOUT seconds (default 60). Ranks are given as -n/--world-size 4, 1-8 or 1,2,4 (default
4); --json PATH writes the results as JSON ('-': to stdout); where ranks run, --timeout is how long a rank may
wait for the others and --wall-timeout caps the whole run. Exit codes: 0 ok, 1 a check found a difference, 2 bad input,
3 a bug of cocoweave, 4 a rank failed or hung."""

app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _flow(text: str | None) -> str | None:
    """A help text's paragraphs each as one line, so that --help wraps them to the terminal instead of keeping
    the source's line breaks (which cut sentences in two); paragraphs with indented lines are kept as written."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if any(line[:1].isspace() for line in p.splitlines()) else " ".join(p.split())
                       for p in paragraphs)  # an indented block (a legend, a table) keeps its lines


def _flow_help(typer_app: typer.Typer) -> None:
    """_flow every help text of `typer_app`, its commands and its sub-apps."""
    typer_app.info.help = _flow(typer_app.info.help)
    for command in typer_app.registered_commands:
        command.help = _flow(command.help or inspect.getdoc(command.callback))
    for group in typer_app.registered_groups:
        _flow_help(group.typer_instance)


def _version(value: bool) -> None:
    if value:
        print(f"cocoweave {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False,
          verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, show_default=False,
                                               help="Log what cocoweave does on stderr: -v launches, restarts, "
                                                    "checkpoints and caches; -vv also debug detail.")] = 0) -> None:
    """cocoweave: distributed workloads with computation and communication as first-class operations."""
    if verbose:
        log_to_stderr(logging.INFO if verbose == 1 else logging.DEBUG)


app.command()(show)
app.command()(run)
app.command()(schedules)
app.command()(check)
app.command()(demo)
app.command("plan")(plan_command)
app.command()(profile)
app.command()(measure)
app.command()(tune)
app.command()(preflight)
app.add_typer(perf_app, name="perf")
_flow_help(app)


def main() -> None:
    """Console entry point."""
    app()
