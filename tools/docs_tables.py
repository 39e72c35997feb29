"""Render the docs' result tables (markdown) and the accuracy-vs-wall-clock plot from bench JSON.

A developer tool, not installed. It reads what ``cpdpkit bench --json FILE`` writes (the main
job: ``BenchReport.to_dict()`` in cpdpkit/bench/periodic/report.py) and what ``cpdpkit bench sharding
--json FILE`` writes (``ShardingReport.to_dict()`` in cpdpkit/bench/sharding/suite.py); docs/json.md
describes both. For every file it prints a markdown section: a caption, the command that
reproduces the run, the date the file was written, the table with the same columns as the
CLI's (one per topology of a ``--topologies`` run), and the goals tables (docs/results.md): the
fixed goals of the default run, and the overlap and auto-K goals and K-over-time lines that
``cpdpkit bench`` prints (cpdpkit/bench/periodic/goals.py, shared). JSON from before ``--topologies`` has
no topology per result: it is the config's. Other JSON files are skipped with a note.

Usage::

    python tools/docs_tables.py                          # every runs/*.json
    python tools/docs_tables.py runs/bench.json --out table.md
    python tools/docs_tables.py runs/bench.json --plot docs/bench_wan_digits.png

Paste the output into docs/results.md. Torch is not needed (only matplotlib, for ``--plot``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path
from typing import Any

from cpdpkit.bench.periodic.goals import k_over_time_lines, overlap_and_auto_goals, result_topology  # as judged
from cpdpkit.bench.sharding.goals import goal_lines  # the goals block `cpdpkit bench sharding` prints
from cpdpkit.cli._bench_plot import plot_accuracy_vs_wall  # the plot `cpdpkit bench --plot` draws

ROOT = Path(__file__).resolve().parents[1]

MAIN_COLUMNS = ("strategy", "status", "peak acc %", "final acc %", "Δ pp", "wall s", "Δ wall %", "step ms",
                "exposed ms/step", "coll/step", "KB/step", "max KB/step", "harness s")
# `cpdpkit bench` defaults (cpdpkit/bench/periodic/config.py BenchConfig), to print the shortest command that
# reproduces a run; kept here so this tool needs no torch. A stale default prints a wrong command:
# tests/test_bench_stats.py checks these against BenchConfig().
MAIN_DEFAULTS = {"strategies": ["ddp", "localsgd-torch", "localsgd", "slowmo", "cpdp", "cpdp-overlap", "cpdp-auto"],
                 "periods": [2, 4],
                 "model": "char-mlp", "dataset": "stdlib-text", "data_dir": None, "epochs": 4, "batch_size": 128,
                 "lr": 0.1,
                 "momentum": 0.9, "slowmo_momentum": 0.0, "slowmo_lr": 1.0, "outer_optimizer": "slowmo",
                 "outer_lr": None, "warmup_steps": 0,
                 "optimizer_state": "keep", "lr_schedule": "constant", "world_size": 2, "topology": "wan", "seeds": 1,
                 "profile_dir": None, "augment": False, "max_images": None, "overlap_steps": 3,
                 "target_exposed_frac": 0.05, "k_min": 1, "k_max": 8, "max_divergence": None, "topologies": None,
                 "inject_fault": None, "compression": ["none"], "fragments": 1}
MAIN_QUICK = {"strategies": ["ddp", "localsgd-torch", "cpdp"], "periods": [4], "epochs": 3}
SHARDING_DEFAULTS = {"strategies": ["fsdp2", "fsdp2-zero2", "hsdp", "zero1", "zero1-overlap", "planned", "two-stage",
                                    "partial"],
                     "model": "gpt-tiny", "world_size": 4, "topology": "cluster-slow-ib", "batch_size": 4, "lr": 0.003,
                     "steps": 10, "optimizer": "adamw", "memory_budget": None, "min_unit_bytes": None,
                     "max_grad_norm": None, "profile_dir": None}
SHARDING_QUICK = {"model": "gpt-micro", "steps": 4}
SHARDING_QUICK_WARMUP = 1


# ---- formatting ------------------------------------------------------------------------------
def _num(value: Any, spec: str, *, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, ("+" if signed else "") + spec)


def markdown_table(columns: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table; text columns left-aligned, the others right-aligned."""
    left = {"strategy", "status", "goal", "measured", ""}
    align = ["---" if c in left else "---:" for c in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _label(r: dict[str, Any]) -> str:
    base = r["strategy"] if r.get("period") is None else f"{r['strategy']} K={r['period']}"
    return f"{base} {r['variant']}" if r.get("variant") else base  # as the CLI's StrategyResult.label


def _option(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"--{name}" if value else ""
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    return f"--{name.replace('_', '-')} {value}"


def _command(prefix: str, config: dict[str, Any], defaults: dict[str, Any], quick: bool, json_path: Path) -> str:
    """The shortest command line that reproduces ``config`` (options that differ from the defaults)."""
    parts = [prefix, "--quick" if quick else ""]
    for key, default in defaults.items():
        if key in config and config[key] != default:
            parts.append(_option("profile" if key == "profile_dir" else key, config[key]))
    parts.append(f"--json {_shown(json_path)}")
    return " ".join(p for p in parts if p)


def main_command(config: dict[str, Any], json_path: Path) -> str:
    quick = bool(config.get("quick"))
    return _command("cpdpkit bench", config, {**MAIN_DEFAULTS, **(MAIN_QUICK if quick else {})}, quick, json_path)


def sharding_command(config: dict[str, Any], json_path: Path) -> str:
    quick = config.get("warmup_steps") == SHARDING_QUICK_WARMUP  # --quick is the only way to get 1 warm-up step
    defaults = {**SHARDING_DEFAULTS, **(SHARDING_QUICK if quick else {})}
    return _command("cpdpkit bench sharding", config, defaults, quick, json_path)


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _written(path: Path) -> str:
    return dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.UTC).strftime("%Y-%m-%d")


# ---- the main job: cpdpkit bench ---------------------------------------------------------------
def significant(ci: list[float] | None) -> bool:
    """Whether a 95 % CI ``[low, high]`` excludes 0 (as cpdpkit.bench.periodic.report.significant)."""
    return ci is not None and (ci[0] > 0.0 or ci[1] < 0.0)


def _delta(value: float | None, spec: str, ci: list[float] | None, *, show_ci: bool) -> str:
    """As the CLI's table: ``+1.23 [+0.40, +2.06]*``; the CI only when defined, ``*`` when it excludes 0."""
    text = _num(value, spec, signed=True)
    if ci is not None and show_ci:
        text += f" [{ci[0]:+{spec}}, {ci[1]:+{spec}}]"
    return text + ("*" if significant(ci) else "")


def main_rows(report: dict[str, Any]) -> list[list[str]]:
    """The rows of ``cpdpkit bench``'s table, formatted as the CLI prints them."""
    rows = []
    for r in report["results"]:
        sd = r.get("std") or {}
        if r.get("status") != "ok":
            rows.append([_label(r), r.get("status", "failed"), *["-"] * (len(MAIN_COLUMNS) - 2)])
            continue
        acc = f"{r['peak_test_acc'] * 100:.2f}±{sd.get('peak_test_acc', 0.0) * 100:.2f}"
        wall = f"{r['wall_s']:.2f}±{sd.get('wall_s', 0.0):.2f}"
        rows.append([
            _label(r), r["status"], acc, _num(r["final_test_acc"] * 100, ".2f"),
            _delta(r.get("delta_acc_pp_vs_ddp"), ".2f", r.get("delta_acc_ci95_pp"), show_ci=True), wall,
            _delta(r.get("delta_wall_pct_vs_ddp"), ".1f", r.get("delta_wall_ci95_s"), show_ci=False),
            _num(r["step_s"] * 1e3, ".2f"),
            _num(r["exposed_sync_s_per_step"] * 1e3, ".2f"), _num(r["collectives_per_step"], ".2f"),
            _num(r["bytes_per_step"] / 1e3, ".1f"), _num(r.get("max_bytes_per_step", math.nan) / 1e3, ".1f"),
            _num(r.get("harness_overhead_s"), ".1f"),
        ])
    return rows


def _find(report: dict[str, Any], strategy: str, period: int | None) -> dict[str, Any] | None:
    for r in report["results"]:
        if r["strategy"] == strategy and r.get("period") == period and r.get("status") == "ok":
            return r
    return None


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def main_goals(report: dict[str, Any]) -> list[list[str]]:
    """The CPDP paper's goals for the default run (README/docs): cpdp K=4 against ddp and localsgd-torch."""
    ddp, cpdp = _find(report, "ddp", None), _find(report, "cpdp", 4)
    rows: list[list[str]] = []
    if ddp and cpdp:
        wall = cpdp["wall_s"] / ddp["wall_s"]
        rows.append(["`cpdp` K=4 wall clock <= 0.80 × `ddp`",
                     f"{cpdp['wall_s']:.2f} s / {ddp['wall_s']:.2f} s = {wall:.2f}×", _met(wall <= 0.80)])
        exp_c, exp_d = cpdp["exposed_sync_s_per_step"] * 1e3, ddp["exposed_sync_s_per_step"] * 1e3
        ratio = exp_c / exp_d if exp_d > 0 else math.nan
        rows.append(["`cpdp` K=4 exposed sync per step <= 0.5 × `ddp`",
                     f"{exp_c:.2f} / {exp_d:.2f} ms = {ratio:.3f}×", _met(ratio <= 0.5)])
        diff = (cpdp["peak_test_acc"] - ddp["peak_test_acc"]) * 100
        rows.append(["`cpdp` K=4 peak accuracy >= `ddp` − 0.5 pp",
                     f"{cpdp['peak_test_acc'] * 100:.2f} % vs {ddp['peak_test_acc'] * 100:.2f} % ({diff:+.2f} pp)",
                     _met(diff >= -0.5)])
    pairs = []
    for r in report["results"]:
        if r["strategy"] == "cpdp" and r.get("status") == "ok":
            peer = _find(report, "localsgd-torch", r.get("period"))
            if peer:
                pairs.append((r["period"], r["peak_test_acc"] * 100, peer["peak_test_acc"] * 100))
    if pairs:
        pairs.sort(reverse=True)
        text = "; ".join(f"K={k}: {c:.2f} vs {p:.2f} %" for k, c, p in pairs)
        rows.append(["`cpdp` accuracy >= `localsgd-torch` at the same K", text, _met(all(c >= p for _, c, p in pairs))])
    return rows


def topologies_of(report: dict[str, Any]) -> list[str | None]:
    """The topologies of a main-job report's results, in order (a result without one: the config's)."""
    return list(dict.fromkeys(result_topology(r, report["config"]) for r in report["results"]))


def on_topology(report: dict[str, Any], topology: str | None) -> dict[str, Any]:
    """The part of ``report`` on one topology (the whole report has the same form)."""
    return {**report, "results": [r for r in report["results"] if result_topology(r, report["config"]) == topology]}


def _topology_block(report: dict[str, Any]) -> list[str]:
    """The table of one topology and the fixed goals of the default run on it."""
    out = [markdown_table(MAIN_COLUMNS, main_rows(report))]
    goals = main_goals(report)
    if goals:
        out += ["", markdown_table(["goal", "measured", ""], goals)]
    return out


def render_main(report: dict[str, Any], path: Path) -> str:
    cfg = report["config"]
    topologies = topologies_of(report) or [cfg["topology"]]
    where = f"topology {topologies[0]}" if len(topologies) == 1 else f"topologies {', '.join(map(str, topologies))}"
    caption = (f"{cfg['model']} on {cfg['dataset']}, {cfg['world_size']} ranks, {where}, "
               f"lr {cfg['lr']}, {cfg['epochs']} epochs, {cfg['seeds']} seed(s)")
    out = [f"### {caption}", "",
           f"`{main_command(cfg, path)}` (written {_written(path)}; "
           "mean ± std over seeds; Δ vs ddp, paired by seed, [95 % CI]; * = the CI excludes 0 (Δ wall %: of the "
           "paired wall-clock difference); exposed = time the training loop waited on communication; "
           "harness = launch, data, evaluation, not in wall s)", ""]
    if len(topologies) == 1:
        out += _topology_block(report)
    for topology in topologies if len(topologies) > 1 else ():
        out += [f"#### topology {topology}", "", *_topology_block(on_topology(report, topology)), ""]
    k_lines = k_over_time_lines(report)
    if k_lines:
        out += ["", "K over time (K's changes, and the last decision):", "", *[f"- {line}" for line in k_lines]]
    goals = overlap_and_auto_goals(report)
    if goals:
        rows = [[g.text, g.measured, _met(g.met)] for g in goals]
        out += ["", "Goals of the overlapped and auto-K strategies (as `cpdpkit bench` prints them):", "",
                markdown_table(["goal", "measured", ""], rows)]
    text = "\n".join(out)
    while "\n\n\n" in text:  # the blocks' blank separators, one each
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n"


# ---- the sharding suite: cpdpkit bench sharding -------------------------------------------------
def sharding_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    tiers = sorted({t for r in report["results"] for t in (r.get("tier_bytes_per_step") or {})})
    columns = ["strategy", "status", "step ms", "exposed ms/step", *[f"{t} MB/step" for t in tiers],
               "optim state MB/rank", "peak RSS MB", "final loss", "stage-1 measured/predicted"]
    rows = []
    for r in report["results"]:
        if r.get("status") != "ok":
            rows.append([r["strategy"], r.get("status", "failed"), *["-"] * (len(columns) - 2)])
            continue
        tb = r["tier_bytes_per_step"]
        rows.append([r["strategy"], "ok", _num(r["step_s"] * 1e3, ".1f"),
                     _num(r["exposed_comm_s_per_step"] * 1e3, ".1f"), *[_num(tb.get(t, 0) / 1e6, ".2f") for t in tiers],
                     _num(r["optimizer_state_bytes_per_rank"] / 1e6, ".3f"), _num(r["peak_mem_bytes"] / 1e6, ".0f"),
                     _num(r["final_loss"], ".6f"),
                     f"{r['stage1_units']:.2f} / {r['stage1_units_predicted']} of {r['num_units']}"
                     if r.get("stage1_units") is not None else "-"])
    return columns, rows


def sharding_goals(goals: dict[str, Any]) -> list[str]:
    """The goals block exactly as ``cpdpkit bench sharding`` prints it (one line per goal, no colour)."""

    return goal_lines(goals) if goals else []


def render_sharding(report: dict[str, Any], path: Path) -> str:
    cfg = report["config"]
    plan = cfg.get("plan") or {}
    caption = (f"{cfg['model']}, {cfg['world_size']} ranks ({cfg.get('num_replicas', '?')} nodes x "
               f"{cfg.get('ranks_per_node', '?')}), topology {cfg['topology']}, {cfg['optimizer']}, "
               f"{cfg['steps']} timed steps; plan {plan.get('strategy', '?')} mesh {plan.get('mesh', '?')}")
    columns, rows = sharding_rows(report)
    out = [f"### {caption}", "",
           f"`{sharding_command(cfg, path)}` (written {_written(path)}; "
           "exposed = training thread blocked in the emulated backend's Work.wait(); tier MB = bytes sent per rank "
           "under the network model (cpdpkit.network); peak RSS = ru_maxrss minus RSS before the model was built)", "",
           markdown_table(columns, rows)]
    goals = sharding_goals(report.get("goals") or {})
    if goals:
        out += ["", "Goals, as the command prints them:", "", "```", *goals, "```"]
    return "\n".join(out) + "\n"


# ---- reading ---------------------------------------------------------------------------------
def kind_of(report: Any) -> str | None:
    """``"main"`` (cpdpkit bench), ``"sharding"`` (cpdpkit bench sharding) or None (not a bench result)."""
    if not isinstance(report, dict) or not isinstance(report.get("results"), list) or "config" not in report:
        return None
    if "goals" in report or any("exposed_comm_s_per_step" in r for r in report["results"]):
        return "sharding"
    if "periods" in report["config"] or any("peak_test_acc" in r for r in report["results"]):
        return "main"
    return None


def render(path: Path) -> tuple[str | None, dict[str, Any] | None]:
    """(markdown, the report) for one JSON file; (None, None) when it is not a bench result."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"skipped {path}: {exc}", file=sys.stderr)
        return None, None
    kind = kind_of(report)
    if kind is None:
        print(f"skipped {path}: not a cpdpkit bench result (no config/results)", file=sys.stderr)
        return None, None
    return (render_main(report, path) if kind == "main" else render_sharding(report, path)), report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/docs_tables.py", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("files", nargs="*", type=Path, help="bench JSON files (default: runs/*.json)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here instead of stdout")
    parser.add_argument("--plot", type=Path, default=None,
                        help="draw test accuracy vs wall clock of the (one) cpdpkit bench result to this PNG")
    args = parser.parse_args(argv)
    files = args.files or sorted((ROOT / "runs").glob("*.json"))
    if not files:
        print("error: no JSON files given and none in runs/; run cpdpkit bench --json runs/bench.json first",
              file=sys.stderr)
        return 2
    sections, mains = [], []
    for path in files:
        text, report = render(path)
        if text is not None:
            sections.append(text)
            if kind_of(report) == "main":
                mains.append(report)
    if args.plot is not None:
        if len(mains) != 1:
            print(f"error: --plot needs exactly one cpdpkit bench result among the files, got {len(mains)}",
                  file=sys.stderr)
            return 2
        plot_accuracy_vs_wall(mains[0], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if not sections:
        print("error: none of the files is a cpdpkit bench result", file=sys.stderr)
        return 1
    text = "\n".join(sections)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
