"""The ``cpdpkit`` command line (typer). Each command lives in its own module."""

from __future__ import annotations

from cpdpkit.cli.app import app

# Importing a command module registers its command on ``app``.
from cpdpkit.cli import demo as _demo  # noqa: F401,E402

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    app()
