"""The exit codes of every ``cpdpkit`` command: a leaf module, so the modules under ``cpdpkit/cli/`` need not import
the package (``cpdpkit.cli``'s ``__init__``, which loads the typer app) for a number."""

from __future__ import annotations

__all__ = ["EXIT_OK", "EXIT_REGRESSION", "EXIT_USER_ERROR"]

EXIT_OK = 0
EXIT_REGRESSION = 1  # cpdpkit profile --baseline ... --max-regression: a run regressed
EXIT_USER_ERROR = 2  # bad input (one line on stderr), for every command and both profile entries
