"""The ``cpdpkit`` command line (typer). Each command lives in its own module.

:func:`main` runs a plain ``cpdpkit profile ...`` without importing typer or rich
(:mod:`cpdpkit.cli._fast_profile`); everything else goes through the typer :data:`app`,
which loads on first use (``from cpdpkit.cli import app`` still works).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from cpdpkit.cli._exit import EXIT_USER_ERROR

__all__ = ["app", "main", "EXIT_USER_ERROR"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from cpdpkit.cli._app import app

        # Importing a command module registers its command on ``app``, in this order (``cpdpkit --help``).
        # isort: off
        from cpdpkit.cli import launch, topology, profile, plan, bench  # noqa: F401
        # isort: on

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point.

    As the process's entry (``argv`` is ``None``), a plain ``profile`` command ends with
    :func:`os._exit` once its output is flushed (its files are written and closed by then): the
    interpreter's teardown (a last garbage collection and freeing every object and module, ~3 % of
    a small trace's instructions) does nothing a finished command needs. Called with ``argv`` it
    raises :class:`SystemExit`, as before.
    """
    import gc

    collecting = gc.isenabled()
    gc.disable()  # no collections while the fast path imports and runs (it makes no reference cycles)
    from cpdpkit.cli._fast_profile import try_profile

    code = try_profile(sys.argv[1:] if argv is None else argv)
    if collecting:
        gc.enable()
    if code is not None:
        if argv is None:
            _exit_now(code)
        raise SystemExit(code)
    from cpdpkit.cli import app

    if argv is None:
        app()
    else:
        app(args=list(argv), prog_name="cpdpkit")


def _exit_now(code: int) -> None:
    """Flush the standard streams and end the process with ``code``, skipping the teardown; when a
    flush fails (a closed pipe), return so that :class:`SystemExit` reports it the usual way."""
    import os

    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(code)
