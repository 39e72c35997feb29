"""The typer application object and its error policy (``cpdpkit.cli.app`` registers the commands).

Each command lives in its own module under ``cpdpkit/cli/`` and registers itself on
:data:`app`. A :class:`~cpdpkit.errors.CpdpkitError` raised by any command becomes one red
line on stderr and exit code 2; ``cpdpkit --debug COMMAND`` shows the traceback instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from cpdpkit._outputs import check_output_file
from cpdpkit.cli._exit import EXIT_USER_ERROR
from cpdpkit.errors import CpdpkitError

__all__ = ["app", "err_console", "out_console", "EXIT_USER_ERROR", "prepare_output"]



def prepare_output(path: str | None, option: str, inputs: Iterable[str | None] = (),
                   suffixes: tuple[str, ...] | None = None) -> None:
    """Before any work: an output file (``--json``, ``--plot``) can be written (:mod:`cpdpkit._outputs`)."""
    check_output_file(path, option, inputs=inputs, suffixes=suffixes)


def _console(stderr: bool = False) -> Console:
    # Piped output (CI logs, `make run | tee`) gets a wide table instead of rich's 80 columns.
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=160)


out_console = _console()
err_console = _console(stderr=True)


class _ErrorPolicyGroup(TyperGroup):
    """Runs a sub-command and turns user errors into one line and exit code 2."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CpdpkitError as exc:
            if isinstance(ctx.obj, dict) and ctx.obj.get("debug"):  # the traceback, and still exit 2
                import traceback

                traceback.print_exc()
            err_console.print(f"[bold red]error:[/bold red] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(EXIT_USER_ERROR) from None


app = typer.Typer(
    cls=_ErrorPolicyGroup,
    name="cpdpkit",
    help="Training when communication is the bottleneck: plan, profile, launch and bench.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    ctx.obj = {"debug": debug}

