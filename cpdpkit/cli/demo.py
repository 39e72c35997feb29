"""``cpdpkit demo``: a short multi-process CPU training with PeriodicSyncOptimizer."""

from __future__ import annotations

import json
import subprocess
import sys

import typer
from rich.table import Table

from cpdpkit.cli.app import app, out_console
from cpdpkit.errors import ConfigError, LaunchError
from cpdpkit.sync import STRATEGIES

__all__ = ["demo"]


@app.command()
def demo(
    nproc: int = typer.Option(2, "--nproc", help="Processes (ranks) on this machine."),
    strategy: str = typer.Option("cpdp", help=f"One of {', '.join(STRATEGIES)}."),
    period: int = typer.Option(4, help="K: steps between reconciliations."),
    epochs: int = typer.Option(10, help="Passes over the digits training set."),
) -> None:
    """Train a small MLP on scikit-learn's digits under torchrun and print opt.stats per rank."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if period < 1:
        raise ConfigError(f"--period must be >= 1, got {period}: pass --period 1 or larger")
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}: pass --nproc 2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "cpdpkit.demo", "--strategy", strategy,
           "--period", str(period), "--epochs", str(epochs)]
    out_console.print(f"[dim]$ {' '.join(cmd[1:])}[/dim]")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(), timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CPDPKIT_DEMO_RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "; ".join(proc.stderr.strip().splitlines()[-3:])
        raise LaunchError(f"the demo's ranks failed (exit {proc.returncode}): {tail}")
    result = json.loads(lines[-1].split(" ", 1)[1])
    out_console.print(_table(result))


def _child_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _table(result: dict) -> Table:
    table = Table(title=f"{result['strategy']} (K={result['period']}), "
                        f"{result['world_size']} ranks, digits MLP")
    for col in ("rank", "test acc", "wall s", "steps", "local", "reconciliations",
                "grad syncs", "collectives", "MB sent", "blocked s"):
        table.add_column(col, justify="right")
    for r in result["ranks"]:
        table.add_row(str(r["rank"]), f"{r['test_acc']:.3f}", f"{r['wall_s']:.2f}",
                      str(r["steps"]), str(r["local_steps"]), str(r["reconciliations"]),
                      str(r["gradient_syncs"]), str(r["collectives"]),
                      f"{r['bytes_sent'] / 1e6:.2f}", f"{r['blocked_s']:.3f}")
    return table
