"""``cpdpkit profile`` without typer or rich: the entry a user's plain invocation takes.

:func:`try_profile` recognises ``cpdpkit [--debug] profile RUN_DIRS... [options]`` with only
the options of the typer command (:mod:`cpdpkit.cli.profile`), parsed as click parses them
(``--opt VALUE`` or ``--opt=VALUE``, the last one wins, ``--`` ends the options), and runs
:func:`cpdpkit.cli._profile_report.run_profile`. Anything else (``--help``, an unknown or
incomplete option, no run folder) returns ``None`` and the typer app handles it, with click's
own usage errors. ``tests/test_cli_profile_fast.py`` keeps the two option lists equal.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cpdpkit.cli._exit import EXIT_USER_ERROR
from cpdpkit.cli._profile_report import ProfileArgs, error_line, run_profile
from cpdpkit.errors import CpdpkitError

__all__ = ["VALUE_OPTIONS", "FLAG_OPTIONS", "parse_profile_args", "try_profile"]

# option -> ProfileArgs field
VALUE_OPTIONS = {"--json": "json_path", "--baseline": "baseline", "--max-regression": "max_regression",
                 "--plot": "plot", "--what-if": "what_if", "--max-trace-bytes": "max_trace_bytes",
                 "--max-events": "max_events", "--timeline": "timeline"}
FLAG_OPTIONS = {"--per-step": "per_step", "--strict": "strict"}
_PATHS = {"json_path", "plot", "timeline"}


def parse_profile_args(argv: Sequence[str]) -> tuple[bool, ProfileArgs] | None:
    """``(debug, arguments)`` for a plain ``[--debug] profile ...`` command line, else ``None``."""
    i, debug = 0, False
    while i < len(argv) and argv[i] == "--debug":
        debug, i = True, i + 1
    if i >= len(argv) or argv[i] != "profile":
        return None
    values: dict[str, Any] = {}
    dirs: list[Path] = []
    rest, options = list(argv[i + 1:]), True
    while rest:
        token = rest.pop(0)
        if not options or token == "-" or not token.startswith("-"):
            dirs.append(Path(token))
        elif token == "--":
            options = False
        elif token in FLAG_OPTIONS:
            values[FLAG_OPTIONS[token]] = True
        else:
            name, eq, value = token.partition("=")
            if name not in VALUE_OPTIONS or (not eq and not rest):
                return None  # --help, an unknown option, a missing value: click says it its own way
            field = VALUE_OPTIONS[name]
            text = value if eq else rest.pop(0)
            values[field] = Path(text) if field in _PATHS else text
    if not dirs:
        return None
    return debug, ProfileArgs(run_dirs=tuple(dirs), debug=debug, **values)


def try_profile(argv: Sequence[str]) -> int | None:
    """Run a plain ``profile`` command line and return its exit code; ``None`` for typer to handle."""
    parsed = parse_profile_args(argv)
    if parsed is None:
        return None
    debug, args = parsed
    collecting = gc.isenabled()
    gc.disable()  # the analysis makes no reference cycles; collections would only walk its batches
    try:
        return run_profile(args)
    except CpdpkitError as exc:
        sys.stdout.flush()
        if debug:  # the traceback, and still exit 2
            import traceback

            traceback.print_exc()
        print(error_line("error", str(exc), sys.stderr), file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        if collecting:
            gc.enable()
