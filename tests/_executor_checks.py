"""Checks that the executor tests (tests/test_planner_executor.py, tests/test_planner_partial.py) and
the label tests (tests/test_labels.py) share, run in the test process on what the ranks saved
(tests/_executor_jobs.py, tests/_partial_jobs.py, tests/_label_jobs.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from _executor_jobs import NUM_STEPS
from cpdpkit import labels

ALTERNATE = [1.0, 10.0, 1.0]  # loss scales: the scaled steps clip, the others do not


def _inside(event: tuple, spans: list[tuple]) -> bool:
    _, thread, start, end = event
    return any(t == thread and s <= start and end <= e for _, t, s, e in spans)


def check_collectives_labelled(events: list[tuple], allowed_foreign: tuple[str, ...]) -> set[str]:
    """Every c10d call site runs inside a cpdpkit communication phase (or a foreign library's own
    span, e.g. FSDP2's); returns the cpdpkit phases seen."""
    comm = [e for e in events if (p := labels.phase_by_label(e[0])) is not None and p.is_communication]
    foreign = [e for e in events if e[0].startswith(allowed_foreign)] if allowed_foreign else []
    calls = [e for e in events if e[0].startswith("c10d::")]
    assert calls, "no collective seen at all"
    bare = [e[0] for e in calls if not _inside(e, comm) and not _inside(e, foreign)]
    assert not bare, f"collectives without a cpdpkit label: {sorted(set(bare))}"
    local = [e for e in events if (p := labels.phase_by_label(e[0])) is not None and not p.is_communication]
    inside_local = [e[0] for e in calls if _inside(e, local) and not _inside(e, comm)]
    assert not inside_local, f"collectives inside a local-work label: {inside_local}"
    return {labels.phase_by_label(e[0]) for e in events if labels.phase_by_label(e[0]) is not None}


def check_misuse_and_labels(results: list[dict[str, Any]], cases: list[dict[str, Any]],
                            allowed_foreign: tuple[str, ...]) -> list[tuple[list[str], dict[str, Any]]]:
    """Both executors on gloo ranks: accumulating without no_sync is two errors (a zero_grad() after a
    synced backward, a second synced backward before step()), and every collective of the clipping
    case is labelled with each communication phase seen. Each rank's (errors, clipping case) for the
    executor's own checks."""
    by_name = {c["name"]: i for i, c in enumerate(cases)}
    out = []
    for rank_result in results:
        errors = rank_result["cases"][by_name["adamw-accum"]]["ex"]["errors"]
        assert len(errors) == 2 and "zero_grad() after a synced backward" in errors[0], errors
        assert "a second synced backward before step()" in errors[1], errors
        ex = rank_result["cases"][by_name["sgd-clip-alternate"]]["ex"]
        seen = check_collectives_labelled(ex["events"], allowed_foreign)
        h = labels.SHARD
        assert {h.GRAD_REDUCE_SCATTER, h.GRAD_WAIT, h.GRAD_NORM, h.PARAM_ALL_GATHER, h.PARAM_WAIT, h.UPDATE,
                h.TIMINGS} <= seen, seen
        out.append((errors, ex))
    return out


def _expected_clip_stats(clipped: list[bool]) -> tuple[int, int]:
    """(speculated, mispredicted) steps under the adaptive rule: no speculation after a clipped step."""
    speculated = mispredicted = 0
    previous = False
    for c in clipped:
        if not previous:
            speculated += 1
            mispredicted += c
        previous = c
    return speculated, mispredicted


def check_stats_and_clipping(name, ex, ref_norms, clip):
    """Both executors' stats (2 stage-1 units) and, with clipping, norms and speculation counts.

    Returns which steps clipped (``None`` without clipping)."""
    stats = ex["stats"]
    assert stats["steps"] == NUM_STEPS and stats["stage1_scheduled"] == 2, name
    if clip is None:
        assert stats["stage1_launched"] == 2 and stats["clip_speculated"] == 0, name
        return None
    assert ex["norms"] == pytest.approx(ref_norms, rel=1e-5), name
    clipped = [n > clip for n in ref_norms]
    assert (stats["clip_speculated"], stats["clip_mispredicted"]) == _expected_clip_stats(clipped), name
    return clipped


def check_gloo_cases(plan: Any, results: list[dict[str, Any]], cases: list[dict[str, Any]],
                     check_case: Callable[..., list[bool] | None]) -> dict[str, list[bool] | None]:
    """An executor's 4 gloo ranks: the plan's stages (two blocks in stage 1, the root in stage 2) as
    every case ran them, each case checked by ``check_case(rank, case, res, stages)``; which steps
    clipped, by case name."""
    assert results[0]["backend"] == "gloo"
    stages = {s.unit: (s.stage, s.order) for s in plan.schedule.slots}
    assert stages == {"<root>": (2, 2), "blocks.0-1": (1, 1), "blocks.2-3": (1, 0)}
    clipped = {}
    for rank, rank_result in enumerate(results):
        for case, res in zip(cases, rank_result["cases"]):
            assert res["ex"]["stages"] == stages, case["name"]
            clipped[case["name"]] = check_case(rank, case, res, stages)
    return clipped


def check_resumed(results, who):
    keys = set()
    for rank, rank_result in enumerate(results):
        for res in rank_result["cases"]:
            name = res["name"]
            assert res["fresh_differs"], name
            assert res["resumed_params"].keys() == res["full_params"].keys()
            for fqn, expect in res["full_params"].items():
                torch.testing.assert_close(res["resumed_params"][fqn], expect, rtol=0, atol=0,
                                           msg=f"{name} {fqn} rank {rank}")
            assert res["resumed_losses"] == pytest.approx(res["full_losses"], rel=0, abs=1e-7), name
            assert len(res["errors"]) == 2, name
            assert "no optimizer state for this rank's mesh coordinates" in res["errors"][0]
            assert f"{who} cannot reshard" in res["errors"][1]
            keys.add(tuple(res["optim_keys"]))  # every case, not only the last
    # every rank saves its own optimizer entry, named by its (replicate, shard) coordinates
    assert keys == {(f"rep{r}of2_shard{s}of2",) for r in range(2) for s in range(2)}
