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
    """Console-script entry point."""
    from cpdpkit.cli._fast_profile import try_profile

    code = try_profile(sys.argv[1:] if argv is None else argv)
    if code is not None:
        raise SystemExit(code)
    from cpdpkit.cli import app

    if argv is None:
        app()
    else:
        app(args=list(argv), prog_name="cpdpkit")
