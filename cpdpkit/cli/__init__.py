"""The ``cpdpkit`` command line (typer). Each command lives in its own module."""

from __future__ import annotations

from cpdpkit.cli.app import app

# Importing a command module registers its command on ``app``.
from cpdpkit.cli import launch as _launch  # noqa: F401,E402
from cpdpkit.cli import topology as _topology  # noqa: F401,E402
from cpdpkit.cli import profile as _profile  # noqa: F401,E402
from cpdpkit.cli import plan as _plan  # noqa: F401,E402
from cpdpkit.cli import bench as _bench  # noqa: F401,E402

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    app()
