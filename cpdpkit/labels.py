"""The trace-label contract: the names cpdpkit gives its spans, and the parser the profiler uses.

Every collective cpdpkit issues runs inside a ``torch.profiler.record_function`` span whose name
comes from here, so the profiler (:mod:`cpdpkit.profiler.classify`) can tell which phase of which
component a span is, and of which collective kind, without a list of string literals of its own.

Two kinds of names:

* **Phases** ``cpdpkit::<component>::<phase>``: ``sync`` (:class:`~cpdpkit.sync.PeriodicSyncOptimizer`)
  and ``shard`` (:class:`~cpdpkit.shard.TwoStageExecutor`). A phase is either communication of a
  collective kind (the span covers issuing the collective and, for blocking phases, waiting for it)
  or local work (``kind is None``: arithmetic such as SlowMo's outer update, never counted as
  communication). :data:`PHASES` lists them all.
* **Emulated link time** ``cpdpkit::emu::<op>[bytes=N,tier=T,ranks=R,modeled_us=F]``: one per
  collective on an emulated process group, spanning its modeled time on the link
  (:func:`emu_label` / :func:`parse_emu_label`).

Torch-free and dependency-free: the profiler imports it where no torch is installed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "PREFIX",
    "KINDS",
    "Phase",
    "PHASES",
    "SYNC",
    "SHARD",
    "phase_by_label",
    "EmuLabel",
    "emu_label",
    "parse_emu_label",
    "format_ranks",
    "parse_rank_ranges",
]

PREFIX = "cpdpkit::"
EMU_PREFIX = "cpdpkit::emu::"

# Canonical collective kinds (what every label, the emulator and the profiler call collectives).
KINDS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all",
    "send_recv",
    "other",
)


@dataclass(frozen=True)
class Phase:
    """One labelled phase: ``component`` and ``name`` make the label; ``kind`` is the collective
    kind it communicates with (``None``: local work, not communication)."""

    component: str
    name: str
    kind: str | None

    @property
    def label(self) -> str:
        return f"{PREFIX}{self.component}::{self.name}"

    @property
    def is_communication(self) -> bool:
        return self.kind is not None


class _SyncPhases:
    """Phases of :class:`~cpdpkit.sync.PeriodicSyncOptimizer` (label ``cpdpkit::sync::<name>``)."""

    CONFIG_CHECK = Phase("sync", "config_check", "all_gather")  # ranks agree on the configuration
    BROADCAST_INIT = Phase("sync", "broadcast_init", "broadcast")  # identical start parameters
    GRAD_ALLREDUCE = Phase("sync", "grad_allreduce", "all_reduce")  # a bucket launched from backward
    GRAD_WAIT = Phase("sync", "grad_wait", "all_reduce")  # step() waiting for the buckets
    PARAM_AVERAGE = Phase("sync", "param_average", "all_reduce")  # reconciliation's averaging
    PARAM_AVERAGE_LAUNCH = Phase("sync", "param_average_launch", "all_reduce")  # overlap_steps >= 1: launch only
    PARAM_AVERAGE_WAIT = Phase("sync", "param_average_wait", "all_reduce")  # overlap_steps >= 1: waiting to apply it
    BUFFER_SYNC = Phase("sync", "buffer_sync", "broadcast")
    STATE_SYNC = Phase("sync", "state_sync", "all_reduce")  # optimizer_state="average"
    REPLICA_CHECK = Phase("sync", "replica_check", "all_reduce")  # check_replicas=True: checksums, MAX over ranks
    SLOWMO_UPDATE = Phase("sync", "slowmo_update", None)  # local arithmetic after the average
    PERIOD_DECISION = Phase("sync", "period_decision", None)  # period="auto": the next K, details in [...]


class _ShardPhases:
    """Phases of :class:`~cpdpkit.shard.TwoStageExecutor` (label ``cpdpkit::shard::<name>``)."""

    GRAD_REDUCE_SCATTER = Phase("shard", "grad_reduce_scatter", "reduce_scatter")  # replicate axis, launch
    GRAD_WAIT = Phase("shard", "grad_wait", "reduce_scatter")  # a unit's update waiting for its slice
    GRAD_NORM = Phase("shard", "grad_norm_allreduce", "all_reduce")  # clipping's global norm
    PARAM_ALL_GATHER = Phase("shard", "param_all_gather", "all_gather")  # updated slices, launch
    PARAM_WAIT = Phase("shard", "param_wait", "all_gather")  # stage 1 in step(), stage 2 before forward
    UPDATE = Phase("shard", "update", None)  # the inner optimizer on one unit's slice
    TIMINGS = Phase("shard", "timings_allreduce", "all_reduce")  # calibrate(): measured timings, max over the world
    BROADCAST_INIT = Phase("shard", "broadcast_init", "broadcast")  # PartialShardExecutor: identical start parameters


SYNC = _SyncPhases
SHARD = _ShardPhases

PHASES: tuple[Phase, ...] = tuple(
    value for ns in (_SyncPhases, _ShardPhases) for value in vars(ns).values() if isinstance(value, Phase)
)
_BY_LABEL = {p.label: p for p in PHASES}


def phase_by_label(name: str) -> Phase | None:
    """The :class:`Phase` an event name stands for, or ``None``.

    Tolerates what torch appends to a ``record_function`` name in some traces (``#...``) and
    bracketed details (``[...]``).
    """
    phase = _BY_LABEL.get(name)
    if phase is None and name.startswith(PREFIX):
        phase = _BY_LABEL.get(name.split("[", 1)[0].split("#", 1)[0])
    return phase


# ---- ranks --------------------------------------------------------------------------------
def format_ranks(ranks: Iterable[int]) -> str:
    """Ranks as sorted comma-separated ranges: ``[0, 1, 2, 3, 8, 9]`` -> ``"0-3,8-9"``."""
    members = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(members):
        j = i
        while j + 1 < len(members) and members[j + 1] == members[j] + 1:
            j += 1
        parts.append(str(members[i]) if i == j else f"{members[i]}-{members[j]}")
        i = j + 1
    return ",".join(parts)


def parse_rank_ranges(text: str) -> tuple[int, ...] | None:
    """``"0-3,8-11"`` -> (0, 1, 2, 3, 8, 9, 10, 11); ``None`` if malformed."""
    ranks: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            return None
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b - a > 1 << 20:
            return None
        ranks.extend(range(a, b + 1))
    return tuple(ranks)


# ---- emulated link time ---------------------------------------------------------------------
@dataclass(frozen=True)
class EmuLabel:
    """Fields of a ``cpdpkit::emu::<op>[bytes=..,tier=..,ranks=..,modeled_us=..]`` name."""

    kind: str
    num_bytes: int | None
    tier: str | None
    ranks: tuple[int, ...] | None
    modeled_us: float | None


def emu_label(kind: str, *, num_bytes: int, tier: str, ranks: str, modeled_s: float) -> str:
    """The span name of one emulated collective (``ranks`` as :func:`format_ranks` writes them)."""
    return f"{EMU_PREFIX}{kind}[bytes={num_bytes},tier={tier},ranks={ranks},modeled_us={modeled_s * 1e6:.1f}]"


def parse_emu_label(name: str) -> EmuLabel | None:
    """Parse :func:`emu_label`'s output; ``None`` when ``name`` does not follow the contract."""
    if not name.startswith(EMU_PREFIX):
        return None
    body = name[len(EMU_PREFIX):]
    op, bracket, rest = body.partition("[")
    if not op or not all(c.isalnum() or c == "_" for c in op):
        return None
    if bracket and (not rest.endswith("]") or "]" in rest[:-1]):
        return None
    fields: dict[str, str] = {}
    for item in rest[:-1].split(",") if bracket else ():
        key, sep, value = item.partition("=")
        if sep:
            fields[key.strip()] = value.strip()
        elif "ranks" in fields and item.strip():
            fields["ranks"] += "," + item.strip()  # ranges contain commas: ranks=0-3,8-11
    kind = op if op in KINDS else _canonical_kind(op)

    def num(key: str, cast: type) -> float | int | None:
        try:
            return cast(fields[key]) if key in fields else None
        except ValueError:
            return None

    ranks = parse_rank_ranges(fields["ranks"]) if "ranks" in fields else None
    return EmuLabel(kind, num("bytes", int), fields.get("tier") or None, ranks, num("modeled_us", float))


def _canonical_kind(op: str) -> str:
    t = op.lower().replace("_", "")
    for kind in KINDS:
        if kind.replace("_", "") == t:
            return kind
    return "other"
