"""``cpdpkit bench``: every synchronisation strategy on one workload over an emulated network."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cpdpkit.bench.config import BENCH_STRATEGIES, BenchConfig
from cpdpkit.bench.report import BenchReport, StrategyResult
from cpdpkit.bench.runner import run_bench
from cpdpkit.cli.app import app, out_console
from cpdpkit.errors import ConfigError

__all__ = ["bench"]


def _int_list(name: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{name} {text!r} is not a comma-separated list of integers: e.g. {name} 2,4") from None


def _config(*, strategies_given: bool, periods_given: bool, **kw) -> BenchConfig:  # noqa: ANN003
    strategies = tuple(s.strip() for s in kw.pop("strategies").split(",") if s.strip())
    periods = _int_list("--periods", kw.pop("periods"))
    if kw["quick"]:  # a smaller run, unless the user chose strategies/periods
        kw["epochs"] = min(kw["epochs"], 3)
        strategies = strategies if strategies_given else ("ddp", "localsgd-torch", "cpdp")
        periods = periods if periods_given else (4,)
    return BenchConfig(strategies=strategies, periods=periods, **kw)


@app.command()
def bench(
    ctx: typer.Context,
    suite: str = typer.Option("cpdp", "--suite", help="cpdp (synchronisation strategies) | sharding "
                              "(fsdp2, hsdp, planned, two-stage on a small GPT)."),
    strategies: str = typer.Option(",".join(BENCH_STRATEGIES), help="Comma-separated subset."),
    periods: str = typer.Option("2,4", help="K values for the periodic strategies."),
    model: str = typer.Option("cnn", help="cnn | resnet18 | resnet50 | vit-s (torchvision)."),
    dataset: str = typer.Option("digits", help="digits | synthetic | cifar100."),
    data_dir: str = typer.Option(None, help="Folder holding CIFAR-100 (cifar100 only)."),
    epochs: int = typer.Option(30, help="Passes over the training set."),
    batch_size: int = typer.Option(32, help="Per-rank batch size."),
    lr: float = typer.Option(0.1, help="Learning rate (fixed, the paper's main setting)."),
    momentum: float = typer.Option(0.0, help="Inner SGD momentum."),
    world_size: int = typer.Option(2, help="Ranks per run."),
    topology: str = typer.Option("wan", help="Topology preset or TOML file to emulate."),
    seeds: int = typer.Option(1, help="Seeds per strategy (mean ± std)."),
    quick: bool = typer.Option(False, "--quick", help="A small smoke run (well under a minute)."),
    profile: str = typer.Option(None, "--profile", help="Write traces for every run under DIR."),
    json_out: str = typer.Option(None, "--json", help="Write the results as JSON to FILE."),
    plot: str = typer.Option(None, "--plot", help="Plot test accuracy vs wall clock to FILE.png."),
    work_dir: str = typer.Option(None, help="Keep per-run folders here (default: a temp dir)."),
    steps: int = typer.Option(10, help="--suite sharding: timed steps (after 2 warm-up steps)."),
    optimizer: str = typer.Option("adamw", help="--suite sharding: adamw | adam | sgd."),
    memory_budget: str = typer.Option(None, help="--suite sharding: planner memory budget per rank, e.g. 64MiB."),
    max_grad_norm: float = typer.Option(None, help="--suite sharding: clip gradients to this global norm."),
) -> None:
    """Train one workload under ddp, localsgd-torch, localsgd, slowmo and cpdp; compare them.

    --suite sharding: fsdp2, hsdp, planned and two-stage on a small GPT over an emulated cluster."""
    from cpdpkit.topology import resolve_topology

    if suite == "sharding":
        from cpdpkit.cli._bench_sharding import run_sharding_suite

        given = {name for name in ("strategies", "model", "world_size", "topology", "batch_size", "lr")
                 if ctx.get_parameter_source(name).name != "DEFAULT"}
        run_sharding_suite(given=given, strategies=strategies, model=model, world_size=world_size,
                           topology=topology, batch_size=batch_size, lr=lr, steps=steps, optimizer=optimizer,
                           memory_budget=memory_budget, max_grad_norm=max_grad_norm, quick=quick,
                           profile=profile, json_out=json_out,
                           work_dir=work_dir)
        return
    if suite != "cpdp":
        raise ConfigError(f"unknown --suite {suite!r}: choose cpdp or sharding")

    config = _config(
        strategies=strategies, periods=periods, model=model, dataset=dataset, data_dir=data_dir,
        epochs=epochs, batch_size=batch_size, lr=lr, momentum=momentum, world_size=world_size,
        topology=topology, seeds=seeds, quick=quick, profile_dir=profile,
        strategies_given=ctx.get_parameter_source("strategies").name != "DEFAULT",
        periods_given=ctx.get_parameter_source("periods").name != "DEFAULT",
    )
    resolve_topology(topology, world_size=world_size)  # a bad topology fails before any launch
    with tempfile.TemporaryDirectory(prefix="cpdpkit-bench-") as tmp:
        report = _run_with_progress(config, Path(work_dir or tmp))
    out_console.print(_table(report))
    failed = [r for r in report.results if r.status != "ok"]
    for r in failed:
        out_console.print(f"[red]{r.label} {r.status}:[/red] {'; '.join(r.reasons)}")
    if json_out:
        Path(json_out).write_text(json.dumps(report.to_dict(), indent=1))
        out_console.print(f"wrote {json_out}")
    if plot:
        _plot(report, Path(plot))
        out_console.print(f"wrote {plot}")


def _run_with_progress(config: BenchConfig, work_dir: Path) -> BenchReport:
    runs = config.runs()
    columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=out_console, transient=False) as progress:
        overall = progress.add_task("runs", total=len(runs))
        epoch_task = progress.add_task("", total=config.epochs)

        def on_event(event: tuple) -> None:
            kind, spec = event[0], event[1]
            name = f"{spec.label} seed {spec.seed}"
            if kind == "start":
                progress.reset(epoch_task, total=spec.epochs, description=name)
            elif kind == "epoch":
                progress.update(epoch_task, completed=event[2])
            elif kind == "done":
                progress.advance(overall)

        return run_bench(config, work_dir, on_event)


def _fmt(value: float | None, spec: str, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, ("+" if signed else "") + spec)


def _row(r: StrategyResult) -> list[str]:
    m, sd = r.means, r.stds
    acc = f"{m['peak_test_acc'] * 100:.2f}±{sd['peak_test_acc'] * 100:.2f}"
    return [r.label, r.status, acc, _fmt(m["final_test_acc"] * 100, ".2f"),
            _fmt(r.delta_acc_pp, ".2f", True), f"{m['wall_s']:.2f}±{sd['wall_s']:.2f}",
            _fmt(r.delta_wall_pct, ".1f", True), _fmt(m["step_s"] * 1e3, ".2f"),
            _fmt(m["exposed_sync_s_per_step"] * 1e3, ".2f"),
            _fmt(m["collectives_per_step"], ".2f"), _fmt(m["bytes_per_step"] / 1e3, ".1f"),
            _fmt(r.harness_s, ".1f")]


def _table(report: BenchReport) -> Table:
    cfg = report.config
    table = Table(title=f"{cfg['model']} on {cfg['dataset']}, {cfg['world_size']} ranks, topology "
                        f"{cfg['topology']}, lr {cfg['lr']}, {cfg['epochs']} epochs, "
                        f"{cfg['seeds']} seed(s)")
    for col in ("strategy", "status", "peak acc %", "final acc %", "Δ pp", "wall s", "Δ wall %",
                "step ms", "exposed ms/step", "coll/step", "KB/step", "harness s"):
        table.add_column(col, justify="left" if col in ("strategy", "status") else "right",
                         no_wrap=True)
    table.caption = ("Δ vs ddp; exposed = time the training loop waited on communication; "
                     "harness = launch, data, evaluation (not in wall s)")
    for r in report.results:
        table.add_row(*_row(r))
    return table


def _plot(report: BenchReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in report.results:
        if r.curve:
            ax.plot([p["wall_s"] for p in r.curve], [p["test_acc"] * 100 for p in r.curve],
                    marker=".", label=r.label)
    ax.set_xlabel("wall-clock training time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"test accuracy vs wall clock ({report.config['topology']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
