"""The immutable result of planning: :class:`ShardingPlan` and its parts, all JSON round-trippable.

Byte counts follow FSDP2's layout. A parameter sharded on ``dim`` over ``S`` ranks is split into
``S`` chunks of ``ceil(size[dim] / S)`` slices; rank ``i`` of the shard axis owns chunk ``i``
(*real* bytes, possibly fewer or none) and stores and sends the chunk padded to full size
(*padded* bytes). Optimizer state covers real elements only (FSDP2 hands the optimizer the
unpadded local view), split further across the replicate axis when the plan shards state.

Traffic is counted per rank: ``wire_bytes_per_rank`` is what one rank sends in one step for a
phase under the α-β model's algorithm (a ring all-gather of ``n`` output bytes over ``p`` ranks
sends ``(p-1)/p·n``); a collective's whole traffic is charged to its group's slowest tier.

A plan of ``param_sharding = "replicated"`` (``strategy = "partial"``, partially sharded data
parallelism) keeps every parameter whole on every rank: it has no placements, its units'
``padded_numel`` equal ``numel``, and its gradients and optimizer state are split flat per unit
(see :mod:`cpdpkit.planner._cost`). Format version 2 added ``param_sharding``, ``candidates``
and ``choice_reason``; version-1 JSON still loads (as ``"sharded"``, with no candidates).

A plan planned with ``reconcile_period = K`` on a topology of several sites has a
:class:`Reconciliation`: its replicate axis (across sites) carries no per-step collective, only
a gradient all-reduce and a parameter average every K steps (see
:mod:`cpdpkit.planner._reconcile_cost`). Such a plan is written as format version 3 (so a reader
that does not know reconciliations refuses it rather than all-reduce across sites every step);
every other plan is still written as version 2, unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpdpkit._text_file import read_text_file
from cpdpkit.errors import TopologyError
from cpdpkit.planner.config import PlannerConfig, PlannerError, Record
from cpdpkit.planner.timeline import TwoStageSchedule
from cpdpkit.topology import Topology

__all__ = [
    "ParamPlacement",
    "UnitPlan",
    "MeshPlan",
    "StateSharding",
    "RankBytes",
    "CommPhase",
    "CandidateSummary",
    "Reconciliation",
    "ShardingPlan",
    "PLAN_FORMAT_VERSION",
]

PLAN_FORMAT_VERSION = 2
_RECONCILED_FORMAT_VERSION = 3  # a plan with a reconciliation
_READABLE_VERSIONS = (1, 2, 3)


@dataclass(frozen=True, kw_only=True)
class ParamPlacement(Record):
    """``Shard(dim)`` of one parameter on the shard axis; ``padded_numel`` = S × padded chunk."""

    fqn: str
    shape: tuple[int, ...]
    dim: int
    padded_numel: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class UnitPlan(Record):
    """One ``fully_shard`` call: its modules (``""`` = the root), parameters and reshard policy."""

    name: str
    module_fqns: tuple[str, ...]
    param_fqns: tuple[str, ...]
    numel: int
    padded_numel: int
    reshard_after_forward: bool | int

    def __post_init__(self) -> None:
        object.__setattr__(self, "module_fqns", tuple(self.module_fqns))
        object.__setattr__(self, "param_fqns", tuple(self.param_fqns))

    @property
    def is_root(self) -> bool:
        return self.module_fqns == ("",)


@dataclass(frozen=True, kw_only=True)
class MeshPlan(Record):
    """The data-parallel mesh: ``(replicate, shard)`` for HSDP, ``(shard,)`` for plain FSDP.

    Shard groups are ``shard_size`` consecutive ranks (a node, a site or the world); replicate
    groups take every ``shard_size``-th rank. Tiers are the groups' slowest links.
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    shard_size: int
    replicate_size: int
    shard_tier: str | None
    replicate_tier: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "dim_names", tuple(self.dim_names))


@dataclass(frozen=True, kw_only=True)
class StateSharding(Record):
    """Fine-grained optimizer-state sharding across the replicate axis (or the world).

    With ``axis="replicate"`` each rank keeps ``1/num_partitions`` of the optimizer state of its
    shard (an even split of the real elements, within one element per unit); the step becomes
    reduce-scatter of gradients across the replicate axis, a partial optimizer step, and an
    all-gather of the updated parameters across the replicate axis. FSDP2 itself cannot do this
    (its HSDP all-reduces gradients and steps the whole shard on every replica), so
    ``executed_by_fsdp2`` is False and :func:`~cpdpkit.shard.apply.apply_plan` applies HSDP only.

    ``axis="world"`` (the partial kind): each rank keeps ``1/world_size`` of every unit's optimizer
    state; gradients are reduce-scattered inside the node, then across nodes, and the updated
    slices all-gathered back the same way; parameters are never sharded.
    """

    axis: str | None
    num_partitions: int
    executed_by_fsdp2: bool


@dataclass(frozen=True, kw_only=True)
class RankBytes(Record):
    """Per-rank model-state bytes (index = global rank) and peak-memory estimates.

    ``*_bytes`` tuples are real bytes; ``padded_*_bytes`` what every rank allocates.
    ``buffer_bytes`` covers FSDP2's unsharded parameters and gradients (the current unit and one
    prefetched, the root, and units kept after forward). Activations are not modeled.
    ``fsdp2_peak_bytes`` is the peak when only FSDP2 executes the plan (no state sharding); for a
    partial plan, which FSDP2 cannot execute at all, the peak of plain DDP (full parameters,
    gradients and optimizer state on every rank).
    """

    param_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    optim_bytes: tuple[int, ...]
    padded_param_bytes: int
    padded_grad_bytes: int
    buffer_bytes: int
    peak_bytes: int
    fsdp2_peak_bytes: int

    def __post_init__(self) -> None:
        for name in ("param_bytes", "grad_bytes", "optim_bytes"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))

    @property
    def total_bytes(self) -> tuple[int, ...]:
        """Real parameter + gradient + optimizer bytes of each rank."""
        return tuple(p + g + o for p, g, o in zip(self.param_bytes, self.grad_bytes, self.optim_bytes))

    @property
    def padded_total_bytes(self) -> tuple[int, ...]:
        return tuple(self.padded_param_bytes + self.padded_grad_bytes + o for o in self.optim_bytes)


@dataclass(frozen=True, kw_only=True)
class CommPhase(Record):
    """One kind of collective issued every step (summed over units)."""

    name: str
    op: str
    axis: str
    tier: str | None
    num_ranks: int
    num_collectives: int
    collective_bytes: int
    wire_bytes_per_rank: int
    time_s: float
    # a group spanning tiers, priced hierarchically: wire_bytes_per_rank split by tier (as the emulator counts)
    tier_bytes: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.tier_bytes is None:  # written only when set: one-tier phases keep their format, byte for byte
            del out["tier_bytes"]
        return out


@dataclass(frozen=True, kw_only=True)
class CandidateSummary(Record):
    """One candidate the planner evaluated: what it was, its modeled cost and whether it fit.

    ``time_s``: the sum of its collectives' modeled times per step; ``peak_bytes``: its peak per
    rank; ``fits_budget``: ``True`` also when there is no budget; ``chosen``: the plan's own.
    """

    strategy: str
    shard_size: int
    reshard_after_forward: bool | int
    state_sharded: bool
    param_sharding: str
    time_s: float
    peak_bytes: int
    fits_budget: bool
    chosen: bool = False


@dataclass(frozen=True, kw_only=True)
class Reconciliation:
    """The cross-site reconciliation of a plan with ``reconcile_period`` (CPDP across sites).

    Every ``period`` steps each rank all-reduces its gradient shard (one collective per unit, as
    FSDP2's HSDP does on the replicate axis) and averages its parameter shard (one flat
    all-reduce, as SlowMo's averaging does) over its cross-site group: the ``num_ranks`` ranks
    holding the same shard, one per site, over ``tier``. There are ``num_groups`` such groups
    (one per rank of a site); each phase is priced for one group by the topology's network model,
    as the planner prices every replicate-axis phase.

    ``phases`` are per reconciliation; ``wire_bytes_per_rank`` and ``time_s`` their sums;
    ``amortised_s_per_step`` is ``time_s / period``, the part of each step's modeled time.
    ``slowmo_state_bytes`` is SlowMo's anchor and slow momentum per rank (2 × the rank's padded
    parameter shard in ``anchor_dtype``), included in the plan's optimizer bytes and peak.
    """

    period: int
    axis: str
    tier: str | None
    num_ranks: int
    num_groups: int
    phases: tuple[CommPhase, ...]
    wire_bytes_per_rank: int
    time_s: float
    amortised_s_per_step: float
    slowmo_state_bytes: int
    anchor_dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "phases", tuple(self.phases))

    def to_dict(self) -> dict[str, Any]:
        return {"period": self.period, "axis": self.axis, "tier": self.tier, "num_ranks": self.num_ranks,
                "num_groups": self.num_groups, "phases": [c.to_dict() for c in self.phases],
                "wire_bytes_per_rank": self.wire_bytes_per_rank, "time_s": self.time_s,
                "amortised_s_per_step": self.amortised_s_per_step, "slowmo_state_bytes": self.slowmo_state_bytes,
                "anchor_dtype": self.anchor_dtype}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Reconciliation:
        return cls(**{**data, "phases": tuple(CommPhase.from_dict(c) for c in data["phases"])})


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """A frozen sharding plan for one model on one placed topology.

    ``all_gather_order`` lists ``(unit, phase)`` in issue order: forward (root first), then
    backward in reverse for units resharded after forward.

    ``schedule`` is the two-stage schedule of the replicate-axis exchanges of updated
    parameters (:func:`~cpdpkit.planner.schedule.plan_two_stage`): which run during backward
    (stage 1) and which during the next forward (stage 2), in which order on the slow link.
    ``None`` when the plan has no replicate axis or does not shard optimizer state.

    ``param_sharding`` is ``"sharded"`` (FSDP2-style) or ``"replicated"`` (``strategy ==
    "partial"``). ``candidates`` lists every candidate the search evaluated (the chosen one
    marked) and ``choice_reason`` says in one sentence why this one won; both are empty for a
    plan that was not searched (FSDP2's default) or read from version-1 JSON.

    ``reconciliation`` (``None`` unless planned with ``reconcile_period`` on several sites): the
    replicate axis's periodic exchange; ``comm`` then holds only per-step collectives, and
    ``tier_bytes_per_step`` / ``predicted_comm_s_per_step`` add the reconciliation averaged
    over its period.
    """

    model_name: str
    strategy: str
    world_size: int
    topology: Topology
    config: PlannerConfig
    mesh: MeshPlan
    units: tuple[UnitPlan, ...]
    placements: tuple[ParamPlacement, ...]
    state_sharding: StateSharding
    rank_bytes: RankBytes
    comm: tuple[CommPhase, ...]
    all_gather_order: tuple[tuple[str, str], ...]
    notes: tuple[str, ...] = ()
    schedule: TwoStageSchedule | None = None
    param_sharding: str = "sharded"
    candidates: tuple[CandidateSummary, ...] = ()
    choice_reason: str = ""
    reconciliation: Reconciliation | None = None

    def __post_init__(self) -> None:
        for name in ("units", "placements", "comm", "notes", "candidates"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "all_gather_order", tuple(tuple(x) for x in self.all_gather_order))

    # ---- summaries -------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def model_bytes(self) -> int:
        """Parameter bytes of one full copy of the model in ``config.param_dtype``."""
        return self.num_params * self.config.param_bytes

    @property
    def padding_bytes(self) -> int:
        """Padding of one sharded copy of the parameters (``param_dtype`` bytes)."""
        return sum(u.padded_numel - u.numel for u in self.units) * self.config.param_bytes

    @property
    def tier_bytes_per_step(self) -> dict[str, int]:
        out = {name: 0 for name in self.topology.tier_names}
        for phase in self.comm:
            if phase.tier_bytes is not None:
                for tier, wire in phase.tier_bytes.items():
                    out[tier] += wire
            elif phase.tier is not None:
                out[phase.tier] += phase.wire_bytes_per_rank
        rec = self.reconciliation
        if rec is not None and rec.tier is not None:  # averaged over the period
            out[rec.tier] += round(rec.wire_bytes_per_rank / rec.period)
        return out

    @property
    def predicted_comm_s_per_step(self) -> float:
        """Sum of the modeled times of every collective of a step (no overlap assumed), plus the
        reconciliation's ``amortised_s_per_step`` when the plan has one."""
        rec = self.reconciliation
        return sum(p.time_s for p in self.comm) + (rec.amortised_s_per_step if rec is not None else 0.0)

    def summary(self) -> dict[str, Any]:
        totals = self.rank_bytes.total_bytes
        return {
            "world_size": self.world_size,
            "strategy": self.strategy,
            "param_sharding": self.param_sharding,
            "num_units": len(self.units),
            "max_rank_bytes": max(totals),
            "mean_rank_bytes": sum(totals) / len(totals),
            "min_rank_bytes": min(totals),
            "padded_rank_bytes": max(self.rank_bytes.padded_total_bytes),
            "peak_memory_bytes": self.rank_bytes.peak_bytes,
            "padding_bytes": self.padding_bytes,
            "model_bytes": self.model_bytes,
            "tier_bytes_per_step": self.tier_bytes_per_step,
            "predicted_comm_s_per_step": self.predicted_comm_s_per_step,
        } | ({} if self.reconciliation is None else {"reconciliation": self.reconciliation.to_dict()})

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {
            "format_version": PLAN_FORMAT_VERSION if self.reconciliation is None else _RECONCILED_FORMAT_VERSION,
            "model_name": self.model_name,
            "strategy": self.strategy,
            "param_sharding": self.param_sharding,
            "world_size": self.world_size,
            "topology": self.topology.to_dict(),
            "config": self.config.to_dict(),
            "mesh": self.mesh.to_dict(),
            "units": [u.to_dict() for u in self.units],
            "placements": [p.to_dict() for p in self.placements],
            "state_sharding": self.state_sharding.to_dict(),
            "rank_bytes": self.rank_bytes.to_dict(),
            "comm": [c.to_dict() for c in self.comm],
            "all_gather_order": [list(x) for x in self.all_gather_order],
            "notes": list(self.notes),
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "choice_reason": self.choice_reason,
        }
        if self.reconciliation is not None:
            out["reconciliation"] = self.reconciliation.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardingPlan:
        """A plan from :meth:`to_dict`'s dict; :class:`PlannerError` (one line) when it does not fit the format."""
        if not isinstance(data, Mapping):
            raise PlannerError(f"a plan must be a JSON object, got {type(data).__name__}; "
                               "pass cpdpkit plan --json's file")
        version = data.get("format_version")
        if version not in _READABLE_VERSIONS or isinstance(version, bool):
            raise PlannerError(f"plan format_version = {_short(version)} is not supported; re-run cpdpkit plan "
                               f"(this cpdpkit reads versions {', '.join(map(str, _READABLE_VERSIONS))})")
        try:
            return cls._from_fields(data)
        except KeyError as exc:
            raise PlannerError(f"plan field {_short(exc.args[0])} is missing; re-run cpdpkit plan") from None
        except (TypeError, ValueError, AttributeError, OverflowError, IndexError, RecursionError) as exc:
            raise PlannerError(f"plan does not fit format version {version} ({type(exc).__name__}: "
                               f"{_clip(str(exc))}); re-run cpdpkit plan") from None

    @classmethod
    def _from_fields(cls, data: Mapping[str, Any]) -> ShardingPlan:
        return cls(
            model_name=data["model_name"], strategy=data["strategy"], world_size=data["world_size"],
            topology=Topology.from_dict(data["topology"]), config=PlannerConfig.from_dict(data["config"]),
            mesh=MeshPlan.from_dict(data["mesh"]), units=tuple(UnitPlan.from_dict(u) for u in data["units"]),
            placements=tuple(ParamPlacement.from_dict(p) for p in data["placements"]),
            state_sharding=StateSharding.from_dict(data["state_sharding"]),
            rank_bytes=RankBytes.from_dict(data["rank_bytes"]),
            comm=tuple(CommPhase.from_dict(c) for c in data["comm"]),
            all_gather_order=tuple(tuple(x) for x in data["all_gather_order"]),
            notes=tuple(data.get("notes", ())),
            schedule=None if data.get("schedule") is None else TwoStageSchedule.from_dict(data["schedule"]),
            param_sharding=data.get("param_sharding", "sharded"),
            candidates=tuple(CandidateSummary.from_dict(c) for c in data.get("candidates", ())),
            choice_reason=data.get("choice_reason", ""),
            reconciliation=None if data.get("reconciliation") is None
            else Reconciliation.from_dict(data["reconciliation"]),
        )

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        return cls.from_dict(_parse_json(text))

    @classmethod
    def load(cls, path: str | Path) -> ShardingPlan:
        """A plan from a ``--json`` file of ``cpdpkit plan`` (its ``"plan"`` key) or a bare plan.

        Raises :class:`PlannerError` (or the :class:`~cpdpkit.errors.TopologyError` of its topology):
        one line that starts with the file's path.
        """
        p = Path(path)
        text = read_text_file(p, what="plan file", max_bytes=_MAX_PLAN_BYTES, error=PlannerError,
                              fix="pass cpdpkit plan --json's file")
        try:
            data = _parse_json(text)
            return cls.from_dict(data.get("plan", data) if isinstance(data, dict) else data)
        except (PlannerError, TopologyError) as exc:  # one line: a key in a message may hold a newline
            raise type(exc)(" ".join(f"{p}: {exc}".split())) from None


_MAX_PLAN_BYTES = 256 << 20  # a plan holds per-unit and per-parameter records, never per-rank ones


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError(f"not valid JSON ({exc}); pass cpdpkit plan --json's file") from None
    except RecursionError:
        raise PlannerError("not valid JSON (arrays or objects nested too deeply); pass cpdpkit plan --json's "
                           "file") from None
    except ValueError as exc:  # an integer past Python's 4,300-digit limit
        raise PlannerError(f"not valid JSON ({_clip(str(exc))}); pass cpdpkit plan --json's file") from None


def _short(value: Any) -> str:
    """``repr(value)`` in at most about 80 characters (a broken file may hold a 5,000-digit number)."""
    try:
        return _clip(repr(value))
    except ValueError:  # an int past Python's 4,300-digit str() limit
        return f"<a {value.bit_length()}-bit integer>"


def _clip(text: str) -> str:
    """``text`` on one line, cut in the middle past 80 characters."""
    text = " ".join(text.split())
    return text if len(text) <= 80 else f"{text[:38]}...{text[-38:]}"
