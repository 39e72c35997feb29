"""The overlap and auto-K goals of ``cpdpkit bench``, and its K-over-time lines, from the ``--json`` form.

One place for both readers: the CLI evaluates ``BenchReport.to_dict()`` after a run and
``tools/docs_tables.py`` a saved JSON file, so the two print the same verdicts. Torch-free; the
input is the ``--json`` schema (a results entry without ``"topology"``, from before
``--topologies``, is on ``config["topology"]``). A goal is judged only when its runs are there:

* on ``wan``: ``cpdp-overlap`` K=4's exposed sync per step <= 0.30 × ``ddp``'s, and its mean peak
  accuracy >= ``cpdp`` K=4's − 0.3 pp;
* on every topology: ``cpdp-auto``'s wall clock <= 1.05 × the best fixed K's, and its mean peak
  accuracy >= that K's − 0.3 pp. The fixed Ks are the ``cpdp`` results at K in {1, 2, 4, 8}; the
  best is the fastest (lowest mean wall clock; the smaller K on a tie) of those whose mean peak
  accuracy is within 0.3 pp of the most accurate one;
* on every topology (issue 24), against the same strategy uncompressed and unfragmented: ``cpdp`` K=4
  ``int8`` bytes per step <= 0.30 × and peak accuracy >= − 0.3 pp; ``topk:0.02`` <= 0.05 × at >= − 0.5 pp;
  ``cpdp-overlap`` K=4 with 4 fragments: the largest step's payload <= 0.30 × at >= − 0.3 pp.

The uncompressed, unfragmented result is the reference wherever a strategy and K are looked up.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ACC_TOLERANCE_PP", "FIXED_PERIODS", "Goal", "best_fixed_period", "k_over_time_lines",
           "overlap_and_auto_goals", "result_topology"]

ACC_TOLERANCE_PP = 0.3
FIXED_PERIODS = (1, 2, 4, 8)
OVERLAP_TOPOLOGY = "wan"
OVERLAP_EXPOSED_RATIO = 0.30
AUTO_WALL_RATIO = 1.05
# (strategy, compression, fragments, the byte measure, its ratio goal, the accuracy tolerance in pp)
STREAM_GOALS = (("cpdp", "int8", 1, "bytes_per_step", 0.30, 0.3),
                ("cpdp", "topk:0.02", 1, "bytes_per_step", 0.05, 0.5),
                ("cpdp-overlap", "none", 4, "max_bytes_per_step", 0.30, 0.3))
_EPS = 1e-9  # a difference of exactly -0.3 pp is within the tolerance despite float rounding
_MAX_SHOWN = 12  # K changes shown in one K-over-time line before the middle is elided


@dataclass(frozen=True, kw_only=True)
class Goal:
    """One goal's verdict: ``text`` (the goal), ``measured`` (the numbers behind it), ``met``."""

    name: str  # overlap_exposed | overlap_accuracy | auto_wall | auto_accuracy | <strategy>_<codec>_f<F>_bytes ...
    topology: str | None
    text: str
    measured: str
    met: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def result_topology(result: dict[str, Any], config: dict[str, Any]) -> str | None:
    """A results entry's topology: its own, else the run's config's (JSON from before --topologies)."""
    return result.get("topology") or config.get("topology")


def _label(r: dict[str, Any]) -> str:
    return r["strategy"] if r.get("period") is None else f"{r['strategy']} K={r['period']}"


def _find(report: dict[str, Any], strategy: str, period: int | None, topology: str | None,
          compression: str = "none", fragments: int = 1) -> dict[str, Any] | None:
    for r in report["results"]:
        if (r["strategy"] == strategy and r.get("period") == period
                and r.get("compression", "none") == compression and r.get("fragments", 1) == fragments
                and result_topology(r, report["config"]) == topology):
            return r
    return None


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and r.get("status") == "ok"


def _failed(name: str, topology: str | None, text: str, r: dict[str, Any]) -> Goal:
    return Goal(name=name, topology=topology, text=text, measured=f"{_label(r)} {r.get('status', 'failed')}",
                met=False)


def _accuracy_goal(name: str, topology: str | None, text: str, r: dict[str, Any], ref: dict[str, Any]) -> Goal:
    diff = (r["peak_test_acc"] - ref["peak_test_acc"]) * 100
    measured = (f"{r['peak_test_acc'] * 100:.2f} % vs {_label(ref)}'s {ref['peak_test_acc'] * 100:.2f} % "
                f"({diff:+.2f} pp)")
    return Goal(name=name, topology=topology, text=text, measured=measured, met=diff >= -ACC_TOLERANCE_PP - _EPS)


def _overlap_goals(report: dict[str, Any]) -> list[Goal]:
    topo = OVERLAP_TOPOLOGY
    overlap = _find(report, "cpdp-overlap", 4, topo)
    if overlap is None:
        return []
    goals = []
    ddp, cpdp = _find(report, "ddp", None, topo), _find(report, "cpdp", 4, topo)
    text = f"cpdp-overlap K=4 exposed sync per step <= {OVERLAP_EXPOSED_RATIO:.2f} × ddp's on {topo}"
    if _ok(ddp) and not _ok(overlap):
        goals.append(_failed("overlap_exposed", topo, text, overlap))
    elif _ok(ddp):
        mine, base = overlap["exposed_sync_s_per_step"] * 1e3, ddp["exposed_sync_s_per_step"] * 1e3
        ratio = mine / base if base > 0 else math.nan
        goals.append(Goal(name="overlap_exposed", topology=topo, text=text,
                          measured=f"{mine:.2f} / {base:.2f} ms = {ratio:.3f}×", met=ratio <= OVERLAP_EXPOSED_RATIO))
    text = f"cpdp-overlap K=4 mean peak accuracy >= cpdp K=4's − {ACC_TOLERANCE_PP} pp on {topo}"
    if _ok(cpdp) and not _ok(overlap):
        goals.append(_failed("overlap_accuracy", topo, text, overlap))
    elif _ok(cpdp):
        goals.append(_accuracy_goal("overlap_accuracy", topo, text, overlap, cpdp))
    return goals


def best_fixed_period(report: dict[str, Any], topology: str | None) -> tuple[dict[str, Any], list[int]] | None:
    """``(the best fixed-K cpdp result, the Ks it was chosen from)`` on ``topology``; None without one.

    The best: among the finished ``cpdp`` results at K in :data:`FIXED_PERIODS`, the fastest of those
    whose mean peak accuracy is within :data:`ACC_TOLERANCE_PP` of the most accurate one.
    """
    fixed = [r for k in FIXED_PERIODS if _ok(r := _find(report, "cpdp", k, topology))]
    if not fixed:
        return None
    top = max(r["peak_test_acc"] for r in fixed)
    close = [r for r in fixed if (r["peak_test_acc"] - top) * 100 >= -ACC_TOLERANCE_PP - _EPS]
    best = min(close, key=lambda r: (r["wall_s"], r["period"]))
    return best, [r["period"] for r in fixed]


def _auto_goals(report: dict[str, Any], topology: str | None) -> list[Goal]:
    auto, chosen = _find(report, "cpdp-auto", None, topology), best_fixed_period(report, topology)
    if auto is None or chosen is None:
        return []
    best, ks = chosen
    where = f" on {topology}" if topology else ""
    wall_text = f"cpdp-auto wall clock <= {AUTO_WALL_RATIO:.2f} × the best fixed K's{where}"
    acc_text = f"cpdp-auto mean peak accuracy >= the best fixed K's − {ACC_TOLERANCE_PP} pp{where}"
    if not _ok(auto):
        return [_failed("auto_wall", topology, wall_text, auto), _failed("auto_accuracy", topology, acc_text, auto)]
    ratio = auto["wall_s"] / best["wall_s"] if best["wall_s"] > 0 else math.nan
    of = ",".join(map(str, ks))
    wall = Goal(name="auto_wall", topology=topology, text=wall_text, met=ratio <= AUTO_WALL_RATIO,
                measured=f"{auto['wall_s']:.2f} s / {_label(best)}'s {best['wall_s']:.2f} s = {ratio:.3f}× "
                         f"(best fixed K={best['period']} of K={of})")
    return [wall, _accuracy_goal("auto_accuracy", topology, acc_text, auto, best)]


def _stream_goals(report: dict[str, Any], topology: str | None) -> list[Goal]:
    """Issue 24's: a codec's bytes or fragments' largest step against the same strategy sent whole in fp32."""
    goals = []
    where = f" on {topology}" if topology else ""
    for strategy, codec, fragments, key, ratio_goal, tolerance in STREAM_GOALS:
        mine = _find(report, strategy, 4, topology, codec, fragments)
        base = _find(report, strategy, 4, topology)
        if mine is None or not _ok(base):
            continue
        what = codec if fragments == 1 else f"{fragments} fragments"
        measure = "bytes per step" if key == "bytes_per_step" else "largest step's payload"
        name = f"{strategy}_{codec}_f{fragments}"
        text = f"{strategy} K=4 {what}: {measure} <= {ratio_goal:.2f} × uncompressed's{where}"
        acc_text = f"{strategy} K=4 {what}: mean peak accuracy >= uncompressed's − {tolerance} pp{where}"
        if not _ok(mine):
            goals += [_failed(name + "_bytes", topology, text, mine), _failed(name + "_accuracy", topology, acc_text,
                                                                              mine)]
            continue
        ratio = mine[key] / base[key] if base[key] > 0 else math.nan
        goals.append(Goal(name=name + "_bytes", topology=topology, text=text, met=ratio <= ratio_goal,
                          measured=f"{mine[key]:,.0f} / {base[key]:,.0f} B = {ratio:.3f}×"))
        diff = (mine["peak_test_acc"] - base["peak_test_acc"]) * 100
        goals.append(Goal(name=name + "_accuracy", topology=topology, text=acc_text, met=diff >= -tolerance - _EPS,
                          measured=f"{mine['peak_test_acc'] * 100:.2f} % vs {base['peak_test_acc'] * 100:.2f} % "
                                   f"({diff:+.2f} pp)"))
    return goals


def overlap_and_auto_goals(report: dict[str, Any]) -> list[Goal]:
    """Every goal whose runs ``report`` (the ``--json`` form) holds, in print order."""
    goals = _overlap_goals(report)
    topologies = dict.fromkeys(result_topology(r, report["config"]) for r in report["results"])
    for topology in topologies:
        goals += _auto_goals(report, topology) + _stream_goals(report, topology)
    return goals


# ---- K over time ---------------------------------------------------------------------------------
def _changes(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries where K changed (the first included), and the last entry (how far the run got)."""
    out = [h for i, h in enumerate(history) if i == 0 or h["period"] != history[i - 1]["period"]]
    if history and out[-1] is not history[-1]:
        out.append(history[-1])
    return out


def _elide(values: list[str], sep: str) -> str:
    if len(values) > _MAX_SHOWN:
        values = [*values[: _MAX_SHOWN // 2], "…", *values[-(_MAX_SHOWN // 2 - 1):]]
    return sep.join(values)


def k_over_time_line(label: str, history: list[dict[str, Any]], mean_period: float | None) -> str:
    """``cpdp-auto on wan, seed 0: K 1→2→4→8→8 at steps 0,1,3,7,15 (mean K 7.6)``: K's changes only."""
    shown = _changes(history)
    ks = _elide([str(h["period"]) for h in shown], "→")
    steps = _elide([str(h["step"]) for h in shown], ",")
    mean = "-" if mean_period is None else f"{mean_period:.1f}"
    return f"{label}: K {ks} at steps {steps} (mean K {mean})"


def k_over_time_lines(report: dict[str, Any]) -> list[str]:
    """One line per seed of every run whose K is chosen at run time (period None, with a K history)."""
    lines = []
    for r in report["results"]:
        if r.get("period") is not None:
            continue
        topology = result_topology(r, report["config"])
        for seed in r.get("seeds") or ():
            if seed.get("period_history"):
                where = f" on {topology}" if topology else ""
                lines.append(k_over_time_line(f"{r['strategy']}{where}, seed {seed['seed']}",
                                              seed["period_history"], seed.get("mean_period")))
    return lines
