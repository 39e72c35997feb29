"""Which rank each trace file of a run holds, and what in a run folder does not fit.

The rank of a file is the first of:

1. ``distributedInfo.rank`` in the trace (Kineto writes it whenever a process group is up,
   also in the old form ``"distributedInfo": {"rank": N}`` without a world size);
2. ``run.json``'s ``"ranks"``, a map from trace file name to rank
   (``{"host_a.pt.trace.json": 0, "host_b.pt.trace.json": 1}``), for traces without one;
3. the file name: ``rank3.json``, ``rank-3.json.gz``, ``job_rank_3_7.pt.trace.json``,
   ``worker3.pt.trace.json`` (:func:`cpdpkit.profiler.trace.rank_from_file_name`);
4. else the smallest rank that no other file of the run claims, files taken in name order.

The run's world size is the most common ``distributedInfo.world_size`` of its traces (ties:
run.json's ``world_size`` if it is one of them, else the first file's), or run.json's
``world_size`` when no trace has one. Each finding below is one :class:`TraceIssue`; the files
it does not name are analysed as usual:

* a trace whose world size differs from the run's is skipped (another run's trace);
* a rank at or above the world size is skipped (another run's trace);
* two files with the same rank: the first by file name is kept, the others are skipped;
* ranks below the world size without a file: one issue naming the run and the ranks (a run
  given as a single trace file is one rank by choice and is not checked; a rank whose file
  failed to load is reported by that failure, not again as missing);
* run.json's ``world_size`` differing from the traces': reported, the traces' is used.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from cpdpkit.labels import format_ranks
from cpdpkit.profiler._record import record
from cpdpkit.profiler.report import TraceIssue
from cpdpkit.profiler.trace import rank_from_file_name, rank_in_meta, world_size_in_meta

__all__ = ["RankHint", "rank_hint", "run_json_ranks", "settle_ranks", "ranks_text"]


@record
class RankHint:
    """What one loaded file says about its rank (``source``: where ``rank`` came from)."""

    path: str
    rank: int | None
    source: str
    world_size: int | None


def run_json_ranks(info: Mapping[str, Any], run_json: str,
                   files: Sequence[str]) -> tuple[dict[str, int], list[TraceIssue]]:
    """run.json's ``"ranks"`` map (``{}`` when absent), and issues for a malformed one."""
    raw = info.get("ranks")
    if raw is None:
        return {}, []
    if not isinstance(raw, dict) or not all(type(v) is int and v >= 0 for v in raw.values()):
        problem = '"ranks" must map trace file names to ranks >= 0, such as {"rank0.json": 0}; ignored'
        return {}, [TraceIssue(run_json, f"{run_json}: {problem}")]
    names = {os.path.basename(f) for f in files}
    unknown = sorted(k for k in raw if k not in names)
    issues = []
    if unknown:
        listed = ", ".join(unknown)
        issues.append(TraceIssue(run_json, f'{run_json}: "ranks" names {listed}, not a trace file of this run'))
    return {k: v for k, v in raw.items() if k in names}, issues


def rank_hint(path: str, meta: Mapping[str, Any], ranks: Mapping[str, int]) -> RankHint:
    """The rank of the trace at ``path`` with metadata ``meta`` (rules 1-3 of the module doc)."""
    world = world_size_in_meta(meta)
    rank = rank_in_meta(meta)
    if rank is not None:
        return RankHint(path, rank, "distributedInfo", world)
    name = os.path.basename(path)
    if name in ranks:
        return RankHint(path, ranks[name], "run.json", world)
    rank = rank_from_file_name(path)
    return RankHint(path, rank, "file name" if rank is not None else "", world)


def ranks_text(ranks: Sequence[int]) -> str:
    """``[3]`` -> ``rank 3``; ``[1, 3, 5, 6, 7]`` -> ``ranks 1, 3, 5-7``."""
    return ("rank " if len(set(ranks)) == 1 else "ranks ") + format_ranks(ranks).replace(",", ", ")


def _world_size(hints: Sequence[RankHint], declared: int | None) -> int | None:
    sizes = Counter(h.world_size for h in hints if h.world_size is not None)
    if not sizes:
        return declared
    ranked = sizes.most_common()
    tied = [w for w, n in ranked if n == ranked[0][1]]
    return declared if declared in tied else tied[0]


def _declared(info: Mapping[str, Any]) -> int | None:
    value = info.get("world_size")
    return value if type(value) is int and value >= 1 else None


def settle_ranks(
    hints: Sequence[RankHint],
    *,
    run_path: str,
    info: Mapping[str, Any],
    run_json: str,
    failed: Sequence[str] = (),
    ranks: Mapping[str, int] | None = None,
) -> tuple[dict[str, int], list[TraceIssue]]:
    """The final rank of every file kept (by path), and the issues (see the module doc).

    ``hints`` are the loaded files in name order, ``failed`` the files that did not load,
    ``ranks`` run.json's map (for the ranks of failed files).
    """
    issues: list[TraceIssue] = []
    declared = _declared(info)
    world = _world_size(hints, declared)
    if declared is not None and world is not None and declared != world:
        issues.append(TraceIssue(run_json, f"{run_json}: world_size {declared}, but the traces say {world}; "
                                            f"using {world}"))
    kept: list[RankHint] = []
    claimed: dict[int, str] = {}
    for h in hints:
        problem = None
        if h.world_size is not None and world is not None and h.world_size != world:
            problem = (f"world size {h.world_size} (distributedInfo), but the run's is {world}: "
                       "a trace of another run in this folder? skipped")
        elif h.rank is not None and world is not None and h.rank >= world:
            problem = (f"rank {h.rank} ({h.source}) is not below the run's world size {world}: "
                       "a trace of another run in this folder? skipped")
        elif h.rank is not None and h.rank in claimed:
            problem = (f"rank {h.rank} ({h.source}) is also the rank of {claimed[h.rank]}: "
                       "traces of different runs in one folder? skipped")
        if problem is not None:
            issues.append(TraceIssue(h.path, f"{h.path}: {problem}"))
            continue
        if h.rank is not None:
            claimed[h.rank] = h.path
        kept.append(h)
    final: dict[str, int] = {}
    free = (r for r in range(1 << 62) if r not in claimed)
    for h in kept:
        rank = h.rank if h.rank is not None else next(free)
        if world is not None and rank >= world:
            issues.append(TraceIssue(h.path, f"{h.path}: no rank in distributedInfo, run.json's \"ranks\" or the "
                                             f"file name, and every rank below the world size {world} is taken; "
                                             "skipped"))
            continue
        final[h.path] = rank
    single_file = not os.path.isdir(run_path)
    if world is not None and not single_file:
        issues.extend(_missing(run_path, world, final, failed, ranks or {}))
    return final, issues


def _missing(run_path: str, world: int, final: Mapping[str, int], failed: Sequence[str],
             ranks: Mapping[str, int]) -> list[TraceIssue]:
    failed_ranks = {ranks.get(os.path.basename(p), rank_from_file_name(p)) for p in failed}
    if None in failed_ranks:  # a file that failed to load may hold any rank: its error says enough
        return []
    present = set(final.values())
    missing = [r for r in range(world) if r not in present and r not in failed_ranks]
    if not missing:
        return []
    text = (f"{run_path}: world size {world}, but no trace of {ranks_text(missing)} (found {len(present)} of {world}); "
            "the present ranks are analysed")
    return [TraceIssue(run_path, text, warning=True)]
