"""The CPU ground-truth comparison, shared by tests/test_profiler_cpu_truth.py and
benchmarks/profiler_cpu_truth.py: the profiler's exposed time per step of a run that
tests/_profiler_cpu_workload.py wrote, against the truth the workload timed (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path

from cpdpkit.profiler import analyze


def tolerance_us(truth_us: float) -> float:
    """The goal: max(5 %, 0.5 ms)."""
    return max(0.05 * truth_us, 500.0)


def compare(out: Path) -> tuple[list[str], list[str], list[float]]:
    """(the steps off by more than :func:`tolerance_us`, every step, the profiler's exposed time
    of every step), each step as a line naming rank, step, truth, profiler and the truth's parts."""
    report = analyze([out])
    assert not report.errors, report.errors
    (run,) = report.runs
    assert [r.rank for r in run.ranks] == [0, 1] and all(r.mode == "cpu" for r in run.ranks)
    bad, lines, exposed = [], [], []
    for rank in run.ranks:
        truth = json.loads(Path(f"{out}.truth-rank{rank.rank}.json").read_text())
        steps = {s.step: s for s in rank.steps}
        assert sorted(int(k) for k in truth) == sorted(s.step for s in rank.steps if not s.partial)
        for key, t in truth.items():
            want = t["blocked_us"]
            got = steps[int(key)].exposed_us
            exposed.append(got)
            line = (f"rank {rank.rank} step {key}: truth {want:.0f} us, profiler {got:.0f} us (call "
                    f"{t['launch_us']:.0f} us, wait {t['wait_us']:.0f} us, runnable {t['wait_runnable_us']:.0f} us, "
                    f"before the wait {t.get('before_wait_us', 0.0):.0f} us)")
            lines.append(line)
            if abs(got - want) > tolerance_us(want):
                bad.append(line)
    return bad, lines, exposed
