"""Every command's command line as a fuzz target: refused (exit 2, one line) or accepted before any rank starts.

A case is a command (every leaf of the typer app: ``plan``, ``profile``, ``topology ...``, ``bench``,
``bench sharding``, ``bench hybrid``, ``launch``), zero to five of its options, each with a value drawn
from numbers out of every range (NaN, infinities, ``1e400``, 2^31, negative, 30 digits), names
(presets, models, strategies, nonsense, rich markup), and paths (a small valid trace, topology and
script in the case folder, a missing file, the folder itself, ``/proc/x.json``, an input as an output),
and zero to two such positional arguments. It runs in-process through typer's ``CliRunner`` with the
case folder as the working directory. Ranks never start: ``torch.distributed.run.run`` (where
``cpdpkit launch`` and every bench start their ranks) raises :class:`RanksWouldStart`, which counts as
accepted. The outcome is ``ok`` (exit 0, or the ranks would start), ``error`` (exit 2 with either
cpdpkit's ``error:`` line, one per bad input, or click's usage message) or ``crash`` (a traceback, another exit code,
another exception, or an ``error:`` message of several lines).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from cpdpkit.errors import CpdpkitError

__all__ = ["RanksWouldStart", "cli_cases", "run_cli_case"]

ARGV = "argv.json"
_NUMBERS = ("-1", "0", "1", "2", "3", "4", "7", "64", "0.5", "1.5", "-0.0", "1e-320", "1e400", "nan", "inf", "-inf",
            "NaN", "1048577", "2147483646", "2147483648", "9" * 30, "1_000", "0x10", "1,2", "2,0", "4,nan", ",")
_NAMES = ("", "x", "lan", "wan", "wan-variable", "cluster", "multisite", "cluster-slow-ib", "llama-70b", "gpt-tiny",
          "gpt-micro", "char-mlp", "cnn", "ddp", "cpdp", "slowmo", "localsgd,cpdp", "fsdp2", "zero1", "adamw",
          "cifar100", "paper", "cosine", "keep", "[red]x[/red]", "a\nb", "é", "64MiB", "1TiB", "-5MiB", "..")
_PATHS = ("{dir}/trace.json", "{dir}/topo.toml", "{dir}/script.py", "{dir}/missing.json", "{dir}", "/proc/x.json",
          "{dir}/out.json", "{dir}/out.png", "{dir}/sub/", "out.json", "{dir}/trace.json.gz")
_TOPOLOGY = b'[topology]\nname = "two"\ndescription = "two ranks"\n'


class RanksWouldStart(Exception):  # noqa: N818 - not an error: the command line was accepted
    """Raised where ranks would start: everything before it (the validation) has run."""


@functools.cache
def _commands() -> tuple[tuple[tuple[str, ...], tuple[tuple[str, bool], ...], int], ...]:
    """``(path, ((option, is_flag), ...), positional count)`` of every leaf command of the app."""
    import typer.main

    from cpdpkit.cli import app

    out = []

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if path:
            options, positional = [], 0
            for param in cmd.params:
                if param.param_type_name == "argument":
                    positional += 1
                elif not getattr(param, "hidden", False):
                    options += [(opt, bool(param.is_flag)) for opt in param.opts if opt.startswith("--")]
            out.append((path, tuple(options), positional))
        for name, sub in sorted((subs or {}).items()):
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return tuple(out)


def cli_cases() -> st.SearchStrategy[dict[str, bytes]]:
    return _cli_cases(_commands())  # the app imported before any draw (it touches the random module)


@st.composite
def _cli_cases(draw: st.DrawFn, commands: tuple) -> dict[str, bytes]:
    path, options, positional = draw(st.sampled_from(commands))
    value = st.sampled_from(_NUMBERS) | st.sampled_from(_NAMES) | st.sampled_from(_PATHS)
    argv = list(path)
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 2, 3, 5]))) if options else ():
        option, is_flag = draw(st.sampled_from(options))
        argv += [option] if is_flag else [option, draw(value)]
    argv += [draw(value) for _ in range(draw(st.integers(0, max(positional, 2))))]
    return {ARGV: json.dumps(argv).encode(), "trace.json": _trace_text(), "topo.toml": _TOPOLOGY,
            "script.py": b"print('ran')\n"}


@functools.cache
def _trace_text() -> bytes:
    from _trace_builder import cpu_scenario

    return json.dumps(cpu_scenario(0)).encode()


class CliRefused(CpdpkitError):
    """The command line was refused as it should be (exit 2); the message names the case folder."""


def run_cli_case(folder: Path) -> None:
    """Run the case's command line; raise :class:`CliRefused` (a refusal), AssertionError (a crash) or return."""
    from unittest import mock

    import torch.distributed.run
    from typer.testing import CliRunner

    from cpdpkit.cli import app

    argv = [a.replace("{dir}", str(folder)) for a in json.loads((folder / ARGV).read_text())]

    def would_start(*args: Any, **kwargs: Any) -> None:
        raise RanksWouldStart

    here = os.getcwd()
    os.chdir(folder)
    try:
        with mock.patch.object(torch.distributed.run, "run", would_start):
            result = CliRunner(env={"COLUMNS": "200"}).invoke(app, argv)
    finally:
        os.chdir(here)
    stderr, shown = result.stderr.strip(), f"cpdpkit {json.dumps(argv)}"  # json: an argument may hold a newline
    if isinstance(result.exception, RanksWouldStart) or (result.exit_code == 0 and result.exception is None):
        return
    if result.exit_code != 2 or not isinstance(result.exception, SystemExit) or "Traceback" in result.output:
        raise AssertionError(f"{shown}: exit {result.exit_code}, {result.exception!r}: {result.output[-300:]!r}")
    ours = stderr.startswith(("error:", "warning:"))  # profile: one line per bad input
    if ours and not all(line.startswith(("error:", "warning:")) for line in stderr.splitlines()):
        raise AssertionError(f"{shown}: an error of several lines: {stderr[:300]!r}")
    if not stderr and "Usage:" in result.output:  # a group without its sub-command: click prints its help
        raise CliRefused(f"{folder}: {shown}: the help of a group, exit 2")
    if not stderr:
        raise AssertionError(f"{shown}: exit 2 with nothing on stderr")
    first = stderr.splitlines()[0][:200] if ours else "click's usage error"
    raise CliRefused(f"{folder}: {shown}: {first!r}")
