"""Startup stays light: ``--help``, ``profile``, ``plan`` and ``topology`` never import torch.

Each case drives the typer app in a fresh interpreter (a subprocess: this test process has torch
loaded already) and reports whether ``torch`` reached ``sys.modules``. Only commands that train
(``launch``, ``bench``) may import it, and only when they run. No timing is asserted here; the
startup time users feel is measured by hand (see the issue "Codebase shape").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from _trace_builder import cpu_scenario, write_trace
from cpdpkit.cli import app

pytestmark = pytest.mark.timeout(60)

# Runs `cpdpkit ARGS` in-process and writes {"exit_code", "torch", "cpdpkit_modules"} to REPORT.
_DRIVER = """
import json, sys
report, args = sys.argv[1], sys.argv[2:]
from cpdpkit.cli import app
try:
    app(args=args, prog_name="cpdpkit")
    code = 0
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
with open(report, "w") as f:
    json.dump({"exit_code": code, "torch": "torch" in sys.modules,
               "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:5]}, f)
"""


def _run(tmp_path: Path, *args: str) -> dict:
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(report), *args], capture_output=True, text=True,
                          timeout=50, env={**os.environ, "COLUMNS": "160"}, cwd=tmp_path)
    assert report.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(report.read_text())
    result["output"] = proc.stdout + proc.stderr
    return result


def _command_paths(group=None, prefix=()):  # type: ignore[no-untyped-def]
    """Every command and group under the app, as argument lists (``["bench", "sharding"]``)."""
    group = group or typer.main.get_command(app)
    for name, cmd in getattr(group, "commands", {}).items():
        yield [*prefix, name]
        yield from _command_paths(cmd, (*prefix, name))


HELP_CASES = [[], *list(_command_paths())]


def test_every_command_is_covered():
    names = {" ".join(path) for path in HELP_CASES}
    assert {"", "launch", "profile", "plan", "topology", "topology show", "bench", "bench sharding"} <= names


@pytest.mark.parametrize("path", HELP_CASES, ids=lambda p: " ".join(p) or "cpdpkit")
def test_help_does_not_import_torch(path, tmp_path):
    result = _run(tmp_path, *path, "--help")
    assert result["exit_code"] == 0, result["output"]
    assert "Usage: cpdpkit" in result["output"]
    assert not result["torch"], result["torch_modules"]


def test_profile_does_not_import_torch(tmp_path):
    run = tmp_path / "ddp"
    for rank in (0, 1):
        write_trace(run / f"rank{rank}.pt.trace.json", cpu_scenario(rank))
    (run / "run.json").write_text(json.dumps({"strategy": "ddp"}))
    result = _run(tmp_path, "profile", str(run), "--json", str(tmp_path / "p.json"))
    assert result["exit_code"] == 0, result["output"]
    assert json.loads((tmp_path / "p.json").read_text())["runs"][0]["name"] == "ddp"
    assert not result["torch"], result["torch_modules"]


def test_profile_bad_input_does_not_import_torch(tmp_path):
    result = _run(tmp_path, "profile", str(tmp_path / "missing"))
    assert result["exit_code"] == 2, result["output"]
    assert not result["torch"], result["torch_modules"]


@pytest.mark.parametrize("args", [
    ["plan", "--model", "vit-s", "--world-size", "8", "--topology", "cluster", "--no-schedule"],
    ["plan", "--model", "llama-7b", "--world-size", "64"],
    ["topology", "show", "wan"],
    ["topology", "show", "cluster", "--world-size", "16", "--json"],
], ids=lambda a: " ".join(a[:3]))
def test_plan_and_topology_do_not_import_torch(args, tmp_path):
    result = _run(tmp_path, *args)
    assert result["exit_code"] == 0, result["output"]
    assert not result["torch"], result["torch_modules"]


def test_launcher_and_env_modules_do_not_import_torch():
    code = ("import sys, cpdpkit.launch, cpdpkit._env, cpdpkit.cli; "
            "assert cpdpkit.launch.TOPOLOGY_ENV == cpdpkit._env.TOPOLOGY_ENV == 'CPDPKIT_TOPOLOGY'; "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
