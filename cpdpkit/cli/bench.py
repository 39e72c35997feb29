"""``cpdpkit bench``: benchmark suites over an emulated network, one sub-command per suite.

``cpdpkit bench [OPTIONS]`` runs the main job: every synchronisation strategy on one workload.
``cpdpkit bench sharding [OPTIONS]`` runs the sharding suite (:mod:`cpdpkit.cli._bench_sharding`).
``cpdpkit bench hybrid [OPTIONS]`` runs CPDP over HSDP against global DDP and HSDP across sites
(:mod:`cpdpkit.cli._bench_hybrid`).
``--suite sharding`` on the main job still works; it prints a one-line deprecation notice.

Options whose default depends on other options (``--quick``, the suite) default to None here and
are resolved in one place each (:func:`_bench_config`, :func:`~cpdpkit.cli._bench_sharding.sharding_config`);
the defaults shown in ``--help`` are documentation of those (tests/test_bench_* check them).
The benchmark's modules import torch, so they are imported when a suite runs, never for ``--help``.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from cpdpkit._outputs import PLOT_SUFFIXES, check_output_dir, write_output
from cpdpkit.cli._app import app, err_console, out_console, prepare_output
from cpdpkit.cli._bench_hybrid import hybrid_config, run_hybrid_suite
from cpdpkit.cli._bench_plot import plot_accuracy_vs_wall
from cpdpkit.cli._bench_sharding import run_sharding_suite, sharding_config
from cpdpkit.errors import ConfigError

if TYPE_CHECKING:
    from rich.table import Table

    from cpdpkit.bench.periodic.config import BenchConfig
    from cpdpkit.bench.periodic.report import BenchReport, StrategyResult
    from cpdpkit.topology import Topology

__all__ = ["bench_app", "bench", "sharding", "hybrid"]

_QUICK_STRATEGIES = ("ddp", "localsgd-torch", "cpdp")
_QUICK_PERIODS = (4,)
_QUICK_MAX_EPOCHS = 3
_SHARDING_ONLY = ("--steps", "--optimizer", "--memory-budget", "--max-grad-norm")


class _BenchGroup(TyperGroup):
    """``bench`` is the main job and a group of suites: refuse main-job options before a suite's name.

    ``cpdpkit bench --quick sharding`` would otherwise parse ``--quick`` as the main job's
    option and then drop it; the fix is to put the options after the suite's name.
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        given = list(args)  # the parser consumes ``args``
        rest = super().parse_args(ctx, args)
        suite = ctx._protected_args  # the sub-command TyperGroup.invoke will run (same attribute it reads)
        if suite and suite[0] in self.commands:
            before = given[: len(given) - len(rest) - 1]
            if before:
                raise ConfigError(f"{' '.join(before)} before {suite[0]!r} would be ignored: put the options after "
                                  f"the suite's name, e.g. cpdpkit bench {suite[0]} {' '.join(before)}")
        return rest


bench_app = typer.Typer(
    cls=_BenchGroup, invoke_without_command=True, no_args_is_help=False,
    short_help="Compare strategies over an emulated network: sync strategies (default), sharding or hybrid.",
)
app.add_typer(bench_app, name="bench")


def _int_list(name: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{name} {text!r} is not a comma-separated list of integers: e.g. {name} 2,4") from None


def _float_list(name: str, text: str) -> float | tuple[float, ...]:
    """One float, or a tuple of them for a comma-separated list (swept like --periods)."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{name} {text!r} is not a number or a comma-separated list of numbers: e.g. {name} "
                          "0,0.2,0.5") from None
    return values[0] if len(values) == 1 else values


def _one_float(name: str, text: str) -> float:
    """One number: a list here is refused (only --periods, --slowmo-momentum and --outer-lr are swept, and
    --compression's codecs)."""
    if "," in text:
        raise ConfigError(f"{name} takes one value, got {text!r}: the swept options are --periods, "
                          "--slowmo-momentum and --outer-lr; run once per value of " + name)
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name} {text!r} is not a number: e.g. {name} 0.1") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _bench_config(*, strategies: str | None, periods: str | None, epochs: int | None, quick: bool,
                  preset: str | None = None, topologies: str | None = None, **kw: Any) -> BenchConfig:
    """The main job's BenchConfig: the options given (not None), else ``--quick``'s reduced defaults, else the
    preset's settings, else BenchConfig's."""
    from cpdpkit.bench.periodic.config import BenchConfig

    if topologies is not None and kw.get("topology") is not None:
        raise ConfigError(f"--topology {kw['topology']} and --topologies {topologies} both given: use --topologies "
                          "for several presets, or --topology for one (a preset or a TOML file)")
    args = {name: value for name, value in kw.items() if value is not None}
    if topologies is not None:
        args["topologies"] = _names(topologies)
    if preset is not None:
        from cpdpkit.bench.periodic.presets import apply_preset

        args = apply_preset(preset, args, quick=quick)
    if strategies is not None:
        args["strategies"] = _names(strategies)
    elif quick:
        args["strategies"] = _QUICK_STRATEGIES
    for flag, name in (("--slowmo-momentum", "slowmo_momentum"), ("--outer-lr", "outer_lr")):
        if isinstance(args.get(name), str):
            args[name] = _float_list(flag, args[name])
    for flag, name in (("--lr", "lr"), ("--momentum", "momentum"), ("--slowmo-lr", "slowmo_lr")):
        if isinstance(args.get(name), str):
            args[name] = _one_float(flag, args[name])
    if periods is not None:
        args["periods"] = _int_list("--periods", periods)
    elif quick:
        args["periods"] = _QUICK_PERIODS
    if epochs is not None:
        args["epochs"] = epochs
    if quick:  # --quick caps the epochs even when they are given
        args["epochs"] = min(args.get("epochs", _QUICK_MAX_EPOCHS), _QUICK_MAX_EPOCHS)
    return BenchConfig(quick=quick, **args)


@bench_app.callback()
def bench(
    ctx: typer.Context,
    suite: str = typer.Option("cpdp", "--suite", help="Deprecated: --suite sharding is `cpdpkit bench sharding`."),
    strategies: str | None = typer.Option(None, help="Comma-separated subset of ddp, localsgd-torch, localsgd, "
                                             "slowmo, cpdp, cpdp-overlap (the average applied --overlap-steps "
                                             "later), cpdp-auto (K chosen at run time), slowmo-overlap, "
                                             "cpdp-step-then-average (cpdp's old order: step, then average).",
                                          show_default="all but slowmo-overlap and cpdp-step-then-average; "
                                                       "--quick: ddp,localsgd-torch,cpdp"),
    periods: str | None = typer.Option(None, help="K values for the periodic strategies.",
                                          show_default="2,4; --quick: 4"),
    model: str | None = typer.Option(None, help="char-mlp (next character) | cnn | resnet50-cifar (ResNet-50, 3x3 "
                                        "stem, no torchvision) | resnet18 | resnet50 | vit-s (torchvision).",
                                     show_default="char-mlp"),
    dataset: str | None = typer.Option(None, help="stdlib-text (next character of Python's own standard library "
                                          "source) | digits | synthetic | cifar100 | tinyimagenet.",
                                       show_default="stdlib-text"),
    data_dir: str | None = typer.Option(None, help="Folder holding CIFAR-100 or TinyImageNet (cifar100, "
                                           "tinyimagenet); nothing is downloaded."),
    preset: str | None = typer.Option(None, help="paper: the CPDP paper's main setting (resnet50-cifar on cifar100, "
                                         "or --dataset tinyimagenet, from --data-dir; lr 0.1 constant, momentum 0.9, "
                                         "batch 128, 200 epochs, --augment, periods 2,4, wan; with --quick: batch 4, "
                                         "64 images). mnist1d: MNIST-1D generated offline (pip package mnist1d), "
                                         "its 1-D CNN with shift augmentation, 4 replicas over wan, lr 0.1, "
                                         "momentum 0.9, ddp, localsgd, cpdp at K=4, 3 seeds. Options given "
                                         "override it."),
    augment: bool | None = typer.Option(None, "--augment/--no-augment", show_default=False,
                                        help="Random crop (padding 4) and horizontal flip of training batches, "
                                             "seeded per (seed, epoch, rank). Off by default; on with --preset paper."),
    epochs: int | None = typer.Option(None, help="Passes over the training set.",
                                         show_default="4; --quick: at most 3"),
    batch_size: int | None = typer.Option(None, help="Per-rank batch size.", show_default="128"),
    lr: str | None = typer.Option(None, metavar="FLOAT", help="Learning rate (fixed, the paper's main setting).",
                                       show_default="0.1"),
    momentum: str | None = typer.Option(None, metavar="FLOAT", help="Inner SGD momentum (every strategy).",
                                        show_default="0.9"),
    slowmo_momentum: str | None = typer.Option(None, metavar="FLOAT[,FLOAT...]",
                                               help="SlowMo's β (slowmo, cpdp); a comma-separated list is swept "
                                                    "like --periods.",
                                               show_default="0 at every replica count (measured at 2, 4, "
                                                            "8: docs/results.md)"),
    slowmo_lr: str | None = typer.Option(None, metavar="FLOAT", help="SlowMo's α (slowmo, cpdp).",
                                         show_default="1.0"),
    outer_optimizer: str | None = typer.Option(None, help="The outer step of slowmo and cpdp on the pseudo-gradient "
                                                  "(anchor - average): slowmo (--slowmo-momentum, --slowmo-lr), "
                                                  "diloco (Nesterov SGD, lr 0.7, momentum 0.9) or a torch.optim "
                                                  "class name (e.g. SGD, Adam) with --outer-lr.",
                                                  show_default="slowmo"),
    outer_lr: str | None = typer.Option(None, metavar="FLOAT[,FLOAT...]",
                                        help="LR of an outer optimizer other than slowmo; a list is swept.",
                                             show_default="diloco 0.7, a torch.optim class 1.0"),
    compression: str | None = typer.Option(None, metavar="CODEC[,CODEC...]",
                                           help="Codecs of the reconciliation (and of cpdp's synchronous-step "
                                                "gradients) with error feedback: none | bf16 | int8 | topk:F (F in "
                                                "(0, 1]); a list is swept like --periods (localsgd, slowmo, cpdp and "
                                                "their -overlap and step-then-average forms; the others: none).",
                                           show_default="none"),
    fragments: int | None = typer.Option(None, help="Stream each reconciliation in this many fragments of about "
                                            "equal bytes, staggered over the period (localsgd, slowmo, cpdp and "
                                            "their -overlap forms).", show_default="1"),
    warmup_steps: int | None = typer.Option(None, help="Steps of gradient all-reduce before the periodic phase "
                                               "(localsgd, slowmo, cpdp).", show_default="0"),
    optimizer_state: str | None = typer.Option(None, help="keep | average | reset: the inner optimizer's state at "
                                                  "each reconciliation (localsgd, slowmo, cpdp).", show_default="keep"),
    lr_schedule: str | None = typer.Option(None, help="constant | cosine (CosineAnnealingLR over all steps) | step "
                                              "(lr / 10 at 50 % and 75 % of the steps); every strategy.",
                                              show_default="constant"),
    overlap_steps: int | None = typer.Option(None, help="τ of cpdp-overlap and slowmo-overlap: each reconciliation's "
                                                "parameter average is applied this many steps after its launch "
                                                "(or at the next reconciliation, if that comes first).",
                                                show_default="3"),
    target_exposed_frac: float | None = typer.Option(None, help="cpdp-auto: the share of step time its controller "
                                                        "lets synchronisation expose.", show_default="0.05"),
    k_min: int | None = typer.Option(None, help="cpdp-auto: the smallest K it may pick.", show_default="1"),
    k_max: int | None = typer.Option(None, help="cpdp-auto: the largest K it may pick.", show_default="8"),
    max_divergence: float | None = typer.Option(None, help="cpdp-auto: cap on the ranks' relative parameter "
                                                   "divergence ||x_i - mean|| / ||mean||.", show_default="no cap"),
    world_size: int | None = typer.Option(None, help="Ranks per run.", show_default="2"),
    topology: str | None = typer.Option(None, help="Topology preset or TOML file to emulate.",
                                           show_default="wan"),
    topologies: str | None = typer.Option(None, help="Run the whole comparison once per preset, e.g. "
                                             "lan,wan,wan-variable (instead of --topology)."),
    seeds: int | None = typer.Option(None, help="Seeds per strategy (mean ± std; with >= 2, a 95 % CI of each "
                                             "difference to ddp, paired by seed).",
                                     show_default="1; --preset mnist1d: 3"),
    quick: bool = typer.Option(False, "--quick", help="A small smoke run (well under a minute)."),
    profile: str | None = typer.Option(None, "--profile", help="Write traces for every run under DIR."),
    json_out: str | None = typer.Option(None, "--json", help="Write the results as JSON to FILE."),
    plot: str | None = typer.Option(None, "--plot", help="Plot test accuracy vs wall clock to FILE.png."),
    work_dir: str | None = typer.Option(None, help="Keep per-run folders here (default: a temp dir)."),
    inject_fault: str | None = typer.Option(None, "--inject-fault", help=(
        "kill:rank=R:step=S: kill rank R (SIGKILL) after step S once; each run checkpoints, is restarted, resumes, "
        "and is compared with a run without the fault.")),
    steps: int | None = typer.Option(None, hidden=True),  # the next four: only for --suite sharding
    optimizer: str | None = typer.Option(None, hidden=True),
    memory_budget: str | None = typer.Option(None, hidden=True),
    max_grad_norm: float | None = typer.Option(None, hidden=True),
) -> None:
    """Train one workload under ddp, localsgd-torch, localsgd, slowmo, cpdp, cpdp-overlap and cpdp-auto; compare
    them.

    Other suites are sub-commands: cpdpkit bench sharding --help, cpdpkit bench hybrid --help."""
    if ctx.invoked_subcommand is not None:
        return
    sharding_kw = {"steps": steps, "optimizer": optimizer, "memory_budget": memory_budget,
                   "max_grad_norm": max_grad_norm}
    if suite == "sharding":
        err_console.print("note: `cpdpkit bench --suite sharding` is deprecated; use `cpdpkit bench sharding` "
                          "(same options)", soft_wrap=True, highlight=False)
        config = sharding_config(strategies=strategies, model=model, world_size=world_size, topology=topology,
                                 batch_size=batch_size, lr=lr, quick=quick, profile=profile, **sharding_kw)
        run_sharding_suite(config, json_out=json_out, work_dir=work_dir)
        return
    if suite != "cpdp":
        raise ConfigError(f"unknown --suite {suite!r}: drop --suite for the main job, or run cpdpkit bench sharding")
    given = [flag for flag, value in zip(_SHARDING_ONLY, sharding_kw.values()) if value is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: option(s) of the sharding suite only; run cpdpkit bench sharding "
                          f"{given[0]} ...")
    config = _bench_config(
        strategies=strategies, periods=periods, model=model, dataset=dataset, data_dir=data_dir, epochs=epochs,
        batch_size=batch_size, lr=lr, momentum=momentum, slowmo_momentum=slowmo_momentum, slowmo_lr=slowmo_lr,
        outer_optimizer=outer_optimizer, outer_lr=outer_lr, warmup_steps=warmup_steps,
        compression=None if compression is None else _names(compression), fragments=fragments,
        optimizer_state=optimizer_state, lr_schedule=lr_schedule,
        world_size=world_size, topology=topology, topologies=topologies, seeds=seeds,
        quick=quick, profile_dir=profile, augment=augment, preset=preset, overlap_steps=overlap_steps,
        target_exposed_frac=target_exposed_frac, k_min=k_min, k_max=k_max, max_divergence=max_divergence,
        inject_fault=inject_fault,
    )
    _run_main(config, json_out=json_out, plot=plot, work_dir=work_dir)


@bench_app.command("sharding")
def sharding(
    strategies: str | None = typer.Option(None, help="Comma-separated subset of fsdp2, fsdp2-zero2, hsdp, zero1, "
                                             "zero1-overlap, planned, two-stage, partial.", show_default="all eight"),
    model: str | None = typer.Option(None, help="gpt-tiny | gpt-small | gpt-micro.",
                                        show_default="gpt-tiny; --quick: gpt-micro"),
    world_size: int | None = typer.Option(None, help="Ranks per run (>= 2 nodes of the topology).",
                                             show_default="4"),
    topology: str | None = typer.Option(None, help="cluster-slow-ib (nodes of 2 ranks, a scaled-down IB link "
                                           "between them), cluster-slower-ib (communication dominates), a preset "
                                           "or a TOML file.", show_default="cluster-slow-ib"),
    batch_size: int | None = typer.Option(None, help="Sequences per rank per step.", show_default="4"),
    lr: float | None = typer.Option(None, help="Learning rate.", show_default="0.003"),
    steps: int | None = typer.Option(None, help="Timed steps, after 2 warm-up steps (--quick: 1).",
                                        show_default="10; --quick: at most 4"),
    optimizer: str | None = typer.Option(None, help="adamw | adam | sgd.", show_default="adamw"),
    memory_budget: str | None = typer.Option(None, help="Planner memory budget per rank, e.g. 64MiB.",
                                                show_default="no limit"),
    min_unit_bytes: int | None = typer.Option(None, help="The planner's smallest unit in bytes; 1 keeps every block "
                                                 "its own unit (finer units let more exchanges overlap backward), "
                                                 "0 leaves it to the planner.",
                                                 show_default="0"),
    max_grad_norm: float | None = typer.Option(None, help="Clip gradients to this global norm (zero1-overlap "
                                                  "cannot clip: it is then reported unsupported).",
                                                  show_default="no clipping"),
    quick: bool = typer.Option(False, "--quick", help="A small smoke run: gpt-micro, at most 4 timed steps (each "
                                                      "strategy still starts its own ranks: ~15 s each on 2 cores)."),
    profile: str | None = typer.Option(None, "--profile", help="Write traces for every run under DIR."),
    json_out: str | None = typer.Option(None, "--json", help="Write the results as JSON to FILE."),
    work_dir: str | None = typer.Option(None, help="Keep per-run folders here (default: a temp dir)."),
) -> None:
    """fsdp2, fsdp2-zero2, hsdp, ZeRO-1 (zero1, zero1-overlap), planned, two-stage and partial on a small GPT over
    an emulated two-tier cluster; compare them."""
    config = sharding_config(strategies=strategies, model=model, world_size=world_size, topology=topology,
                             batch_size=batch_size, lr=lr, steps=steps, optimizer=optimizer,
                             memory_budget=memory_budget, min_unit_bytes=min_unit_bytes, max_grad_norm=max_grad_norm,
                             quick=quick, profile=profile)
    run_sharding_suite(config, json_out=json_out, work_dir=work_dir)


@bench_app.command("hybrid")
def hybrid(
    strategies: str | None = typer.Option(None, help="Comma-separated subset of ddp-global, hsdp-global, "
                                             "cpdp-over-hsdp, cpdp-over-hsdp-overlap, cpdp-over-two-stage.",
                                          show_default="all five"),
    model: str | None = typer.Option(None, help="gpt-tiny | gpt-small | gpt-micro.",
                                        show_default="gpt-micro"),
    world_size: int | None = typer.Option(None, help="Ranks per run (>= 2 sites of the topology).",
                                             show_default="4"),
    topology: str | None = typer.Option(None, help="multisite (2 sites of 2 nodes: IB inside a site, a 16.6 ms, "
                                           "1 Gbit/s WAN between them), a preset or a TOML file with >= 2 sites.",
                                        show_default="multisite"),
    batch_size: int | None = typer.Option(None, help="Sequences per rank per step.", show_default="4"),
    lr: float | None = typer.Option(None, help="AdamW's learning rate.", show_default="0.003"),
    steps: int | None = typer.Option(None, help="Timed steps, a multiple of --period, after one period of warm-up "
                                        "steps.", show_default="24; --quick: one period"),
    period: int | None = typer.Option(None, help="K of the cpdp-over-* strategies: steps between reconciliations "
                                         "across sites.", show_default="4"),
    overlap_steps: int | None = typer.Option(None, help="τ of cpdp-over-hsdp-overlap: each parameter average is "
                                                "applied this many steps after its launch.", show_default="1"),
    compression: str | None = typer.Option(None, metavar="CODEC", help="Codec of the cpdp-over-* strategies' "
                                              "cross-site exchanges (averages and synchronous-step gradients, with "
                                              "error feedback): none | bf16 | int8 | topk:F.", show_default="none"),
    slowmo_momentum: float | None = typer.Option(None, metavar="FLOAT", help="SlowMo's β of the cpdp-over-* "
                                                    "strategies, in [0, 1).",
                                                 show_default="the library's default by replicas: 0 at 2 sites"),
    quick: bool = typer.Option(False, "--quick", help="A small smoke run: one period timed (each "
                                                      "strategy still starts its own ranks)."),
    profile: str | None = typer.Option(None, "--profile", help="Write traces for every run under DIR."),
    json_out: str | None = typer.Option(None, "--json", help="Write the results as JSON to FILE."),
    plot: str | None = typer.Option(None, "--plot", help="Plot every strategy's loss per step to FILE.png."),
    work_dir: str | None = typer.Option(None, help="Keep per-run folders here (default: a temp dir)."),
) -> None:
    """CPDP over HSDP (FSDP2 inside a site, CPDP across sites) and over the two-stage executor, against global DDP
    and global HSDP on a small GPT over an emulated two-site cluster; compare them."""
    config = hybrid_config(strategies=strategies, model=model, world_size=world_size, topology=topology,
                           batch_size=batch_size, lr=lr, steps=steps, period=period, overlap_steps=overlap_steps,
                           compression=compression, slowmo_momentum=slowmo_momentum, quick=quick,
                           profile=profile)
    run_hybrid_suite(config, json_out=json_out, plot=plot, work_dir=work_dir)


# ---- the main job: run, table, --json, --plot -------------------------------------------------------
def _run_main(config: BenchConfig, *, json_out: str | None, plot: str | None, work_dir: str | None) -> None:
    from cpdpkit.bench.periodic.runner import resolve_bench_topologies

    topologies = resolve_bench_topologies(config)  # once, here: a bad topology fails before any launch
    inputs = (config.data_dir, *config.topology_names)
    prepare_output(json_out, "--json", inputs)  # so does an output path that cannot be written
    prepare_output(plot, "--plot", inputs, suffixes=PLOT_SUFFIXES)
    check_output_dir(config.profile_dir, "--profile", inputs=inputs)
    check_output_dir(work_dir, "--work-dir", inputs=inputs, keep=False)
    with tempfile.TemporaryDirectory(prefix="cpdpkit-bench-") as tmp:
        report = _run_with_progress(config, Path(work_dir or tmp), topologies)
    _print_report(report)
    if json_out:
        write_output(json_out, json.dumps(report.to_dict(), indent=1).encode(), "--json")
        out_console.print(f"wrote {json_out}")
    if plot:
        write_output(plot, lambda tmp: plot_accuracy_vs_wall(report.to_dict(), tmp), "--plot")
        out_console.print(f"wrote {plot}")


def _print_report(report: BenchReport) -> None:
    """One table per topology, the failures, K over time of the auto runs, then the goals."""
    from cpdpkit.bench.periodic.goals import k_over_time_lines, overlap_and_auto_goals

    for topology in report.topologies:
        out_console.print(_table(report, topology))
    for r in report.results:
        if r.status != "ok":
            where = f" on {r.topology}" if len(report.topologies) > 1 else ""
            out_console.print(f"[red]{r.label}{where} {r.status}:[/red] {escape('; '.join(r.reasons))}")
    data = report.to_dict()
    for line in _fault_lines(data):
        out_console.print(line, highlight=False, soft_wrap=True)
    for line in k_over_time_lines(data):
        out_console.print(line, highlight=False)
    for goal in overlap_and_auto_goals(data):
        mark = "[green]met[/green]" if goal.met else "[red]not met[/red]"
        out_console.print(f"goal: {escape(goal.text)}: {escape(goal.measured)} {mark}", highlight=False)


def _fault_lines(data: dict[str, Any]) -> list[str]:
    """One line per run with an injected fault: restarts, resume point, and the comparison with the clean run."""
    lines = []
    for r in data["results"]:
        label = r["strategy"] if r["period"] is None else f"{r['strategy']} K={r['period']}"
        for seed in r["seeds"]:
            fault = seed.get("fault")
            if not fault:
                continue
            same = fault["final_params_equal_uninterrupted"]
            verdict = ("[green]equal[/green] to" if same else "[red]differ from[/red]") + " the uninterrupted run's"
            sha = (fault.get("final_params_sha256") or ["-"])[0][:12]
            lines.append(f"fault {escape(fault['injected'])} on {escape(label)} seed {seed['seed']}: "
                         f"{fault['restarts']} restart(s), resumed from step {fault['resumed_from_step']}; final "
                         f"parameters of every rank {verdict} (rank 0 sha256 {sha}...)")
    return lines


def _run_with_progress(config: BenchConfig, work_dir: Path, topologies: dict[str, Topology]) -> BenchReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cpdpkit.bench.periodic.runner import run_bench

    runs = config.runs()
    columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=out_console, transient=False) as progress:
        overall = progress.add_task("runs", total=len(runs))
        epoch_task = progress.add_task("", total=config.epochs)

        several = len(config.topology_names) > 1

        def on_event(event: tuple) -> None:
            kind, spec = event[0], event[1]
            name = f"{spec.label} seed {spec.seed}" + (f" {spec.topology}" if several else "")
            if kind == "start":
                progress.reset(epoch_task, total=spec.epochs, description=name)
            elif kind == "epoch":
                progress.update(epoch_task, completed=event[2])
            elif kind == "done":
                progress.advance(overall)

        return run_bench(config, work_dir, on_event, topologies=topologies)


def _fmt(value: float | None, spec: str, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, ("+" if signed else "") + spec)


def _delta(value: float | None, spec: str, ci: tuple[float, float] | None, *, show_ci: bool) -> str:
    """``+1.23``, with ``[low, high]`` of its 95 % CI when shown and a ``*`` when that excludes 0."""
    from cpdpkit.bench.periodic.report import significant

    text = _fmt(value, spec, True)
    if ci is not None and show_ci:
        text += f" [{ci[0]:+{spec}}, {ci[1]:+{spec}}]"
    return text + ("*" if significant(ci) else "")


def _row(r: StrategyResult) -> list[str]:
    m, sd = r.means, r.stds
    acc = f"{m['peak_test_acc'] * 100:.2f}±{sd['peak_test_acc'] * 100:.2f}"
    return [r.label, r.status, acc, _fmt(m["final_test_acc"] * 100, ".2f"),
            _delta(r.delta_acc_pp, ".2f", r.delta_acc_ci95_pp, show_ci=True),
            f"{m['wall_s']:.2f}±{sd['wall_s']:.2f}",
            _delta(r.delta_wall_pct, ".1f", r.delta_wall_ci95_s, show_ci=False), _fmt(m["step_s"] * 1e3, ".2f"),
            _fmt(m["exposed_sync_s_per_step"] * 1e3, ".2f"),
            _fmt(m["collectives_per_step"], ".2f"), _fmt(m["bytes_per_step"] / 1e3, ".1f"),
            _fmt(m.get("max_bytes_per_step", math.nan) / 1e3, ".1f"),
            _fmt(r.harness_s, ".1f")]


def _table(report: BenchReport, topology: str | None = None) -> Table:
    """The comparison on ``topology`` (None: every result, titled with the config's topology)."""
    from rich.table import Table

    cfg = report.config
    table = Table(title=f"{cfg['model']} on {cfg['dataset']}, {cfg['world_size']} ranks, topology "
                        f"{topology or cfg['topology']}, lr {cfg['lr']}, {cfg['epochs']} epochs, "
                        f"{cfg['seeds']} seed(s)")
    for col in ("strategy", "status", "peak acc %", "final acc %", "Δ pp", "wall s", "Δ wall %",
                "step ms", "exposed ms/step", "coll/step", "KB/step", "max KB/step", "harness s"):
        table.add_column(col, justify="left" if col in ("strategy", "status") else "right",
                         no_wrap=True)
    table.caption = ("Δ vs ddp, paired by seed, [95 % CI]; * = the CI excludes 0 (Δ wall %: of the paired "
                     "wall-clock difference); exposed = time the training loop waited on communication; "
                     "max KB/step = the most one step sent (per rank); harness = launch, data, evaluation (not in "
                     "wall s)")
    for r in report.results:
        if topology is None or r.topology == topology:
            table.add_row(*_row(r))
    return table

