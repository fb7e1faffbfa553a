"""The `cocoweave` command line (typer + rich)."""

from __future__ import annotations

from typing import Annotated

import typer

from .. import __version__
from .cluster_commands import plan_command
from .demo import demo
from .perf_commands import perf_app
from .profile_commands import profile
from .program_commands import run, show
from .schedule_commands import check, schedules
from .tune_commands import measure, tune

app = typer.Typer(help="cocoweave: write a distributed workload once; rewrite, check, run and tune it.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _version(value: bool) -> None:
    if value:
        print(f"cocoweave {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """cocoweave: distributed workloads with computation and communication as first-class operations."""


app.command()(show)
app.command()(run)
app.command()(schedules)
app.command()(check)
app.command()(demo)
app.command("plan")(plan_command)
app.command()(profile)
app.command()(measure)
app.command()(tune)
app.add_typer(perf_app, name="perf")


def main() -> None:
    """Console entry point."""
    app()
