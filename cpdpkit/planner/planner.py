"""The sharding planner: choose units, mesh, placements and state sharding for one model.

:func:`plan_sharding` searches a small set of candidates and keeps the cheapest that fits:

1. **Units.** Every block (a child of a ``ModuleList``/``Sequential``) is a unit; neighbouring
   blocks of one container merge while the merged unit is below ``min_unit_bytes`` (default: the
   size where a collective's latency term equals its bandwidth term, ``p·α·bandwidth`` on the
   shard tier), so small layers do not pay one latency each. Blocks are never split.
2. **Mesh.** The shard axis is a node (HSDP over the fast intra-node tier), a site, or the
   whole world (FSDP); the replicate axis takes the rest. ``reshard_after_forward`` is
   ``True``, ``False`` (no backward all-gather, more memory) or, for world sharding, the node
   size (ZeRO++ hpZ: the backward all-gather stays on the intra-node tier; checked against
   the topology, so the "consecutive ranks share a node" assumption of an int holds).
3. **Placements.** ``Shard(0)`` when dim 0 divides by the shard size, else the first other dim
   that does, else padded ``Shard(0)``: no padding and no ownership imbalance wherever any dim
   allows it.
4. **State sharding.** With a replicate axis, optimizer state may be split further across it
   (gradient reduce-scatter + parameter all-gather across replicas instead of an all-reduce:
   the same ring bytes, 1/R of the optimizer memory, balanced within one element per unit).

Each candidate's α-β time per step (the topology's model) and peak memory are computed in
closed form; among candidates within the memory budget the fastest wins, and among those within
1 % of it the leanest in memory. :func:`fsdp2_default_plan` prices FSDP2's defaults the same way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from cpdpkit.planner._cost import Candidate, CostModel, Evaluation, UnitGeom, _is_int, evaluate, shard_layout
from cpdpkit.planner.config import PlannerConfig, PlannerError, ceil_div, format_bytes
from cpdpkit.planner.model_spec import ROOT, ModelSpec
from cpdpkit.planner.plan import MeshPlan, ParamPlacement, ShardingPlan, StateSharding, UnitPlan
from cpdpkit.planner.presets import load_model_spec
from cpdpkit.planner.schedule import plan_two_stage
from cpdpkit.topology import Topology, resolve_topology

__all__ = ["plan_sharding", "fsdp2_default_plan", "planning_summary", "resolve_inputs"]

_TIME_TIE_FRAC = 0.01  # candidates within 1 % of the fastest count as equally fast
_ROOT_NAME = "<root>"


def resolve_inputs(model: Any, topology: Topology | str, world_size: int | None = None,
                   ranks_per_node: int | None = None) -> tuple[ModelSpec, Topology]:
    """(ModelSpec, placed Topology) from the flexible inputs the public functions accept."""
    spec = load_model_spec(model)
    if isinstance(topology, str):
        topo = resolve_topology(topology, world_size=world_size, ranks_per_node=ranks_per_node)
    elif isinstance(topology, Topology):
        if ranks_per_node is not None:
            topo = replace(topology, ranks_per_node=ranks_per_node)
        else:
            topo = topology
        topo = topo.place(world_size) if world_size is not None else topo
    else:
        raise PlannerError(f"topology = {topology!r} is invalid; pass a Topology, a preset name or a .toml path")
    if not topo.is_placed:
        raise PlannerError(f"topology {topo.name!r} is not placed; pass world_size (--world-size)")
    return spec, topo


# ---- units ---------------------------------------------------------------------------------
def _block_params(spec: ModelSpec) -> tuple[list[list[int]], list[int]]:
    per_block: list[list[int]] = [[] for _ in spec.blocks]
    root: list[int] = []
    for i, p in enumerate(spec.params):
        (root if p.block == ROOT else per_block[p.block]).append(i)
    return per_block, root


def group_blocks(spec: ModelSpec, min_unit_bytes: int, param_bytes: int) -> list[list[int]]:
    """Blocks in groups (each group one unit): neighbours of one container merge while small.

    Within each run of blocks of one container, a group closes once it holds ``min_unit_bytes``;
    a small remainder at the end of the run joins the group before it.
    """
    per_block, _ = _block_params(spec)
    sizes = [sum(spec.params[i].numel for i in idx) * param_bytes for idx in per_block]
    runs: list[list[int]] = []
    for b, block in enumerate(spec.blocks):
        if not sizes[b]:
            continue  # a block with no parameters of its own needs no unit
        if runs and spec.blocks[runs[-1][-1]].container == block.container:
            runs[-1].append(b)
        else:
            runs.append([b])
    groups: list[list[int]] = []
    for run in runs:
        run_groups: list[list[int]] = [[]]
        for b in run:
            if sum(sizes[x] for x in run_groups[-1]) >= min_unit_bytes:
                run_groups.append([])
            run_groups[-1].append(b)
        if len(run_groups) > 1 and sum(sizes[x] for x in run_groups[-1]) < min_unit_bytes:
            run_groups[-2].extend(run_groups.pop())
        groups.extend(run_groups)
    return groups


def _unit_name(spec: ModelSpec, group: list[int]) -> str:
    first, last = spec.blocks[group[0]].fqn, spec.blocks[group[-1]].fqn
    if len(group) == 1:
        return first
    container = spec.blocks[group[0]].container
    head, tail = f"{container}.", last.rsplit(".", 1)[-1]
    if container and first.startswith(head) and last == head + tail:
        return f"{first}-{tail}"  # layer1.0-2
    return f"{first}..{last}"


def _build_units(spec: ModelSpec, groups: list[list[int]], shard_size: int, *, balanced: bool,
                 raf: bool | int) -> tuple[list[UnitPlan], list[UnitGeom], list[ParamPlacement]]:
    """Units (root first), their geometry, and every parameter's placement."""
    per_block, root_params = _block_params(spec)
    members = [(_ROOT_NAME, ("",), root_params, True)]
    for g in groups:
        idx = [i for b in g for i in per_block[b]]
        members.append((_unit_name(spec, g), tuple(spec.blocks[b].fqn for b in g), idx, False))
    units, geoms, placements = [], [], []
    for name, fqns, idx, is_root in members:
        real = np.zeros(shard_size, dtype=np.int64)
        padded = numel = 0
        unit_raf = False if is_root else raf
        # FSDP2 (2.13) keeps an int-resharded parameter flat after forward and then fails to
        # chunk-cat it on dim > 0 in backward: such units keep Shard(0).
        unit_balanced = balanced and not _is_int(unit_raf)
        for i in idx:
            p = spec.params[i]
            layout = shard_layout(p.shape, shard_size, balanced=unit_balanced)
            real += layout.real_by_position
            padded += layout.padded_numel
            numel += p.numel
            placements.append(ParamPlacement(fqn=p.fqn, shape=p.shape, dim=layout.dim,
                                             padded_numel=layout.padded_numel))
        units.append(UnitPlan(name=name, module_fqns=fqns, param_fqns=tuple(spec.params[i].fqn for i in idx),
                              numel=numel, padded_numel=padded, reshard_after_forward=unit_raf))
        geoms.append(UnitGeom(padded_numel=padded, real_by_position=real,
                              reshard_after_forward=unit_raf, is_root=is_root))
    return units, geoms, placements


# ---- candidates ----------------------------------------------------------------------------
def _shard_sizes(topo: Topology) -> list[tuple[str, int]]:
    """(strategy, shard size): a node, a site, the world; deduplicated, largest group last."""
    rpn, nps = topo.ranks_per_node, topo.nodes_per_site
    world = topo.world_size
    out: dict[int, str] = {}
    for name, size in (("hsdp-node", rpn), ("hsdp-site", rpn * nps), ("fsdp", world)):  # type: ignore[operator]
        out.setdefault(size, name)
    if world in out:
        out[world] = "fsdp"
    return [(name, size) for size, name in sorted(out.items())]


def _candidates(topo: Topology, config: PlannerConfig) -> list[Candidate]:
    out = []
    world, rpn = topo.world_size, topo.ranks_per_node
    sizes = _shard_sizes(topo)
    if config.shard_size is not None:
        if world % config.shard_size:  # type: ignore[operator]
            raise PlannerError(f"shard_size = {config.shard_size} does not divide the world size {world}; "
                               f"use a divisor such as {topo.ranks_per_node} (one node) or {world}")
        chosen = dict((s, name) for name, s in sizes).get(config.shard_size, "hsdp")
        sizes = [("fsdp" if config.shard_size == world else chosen, config.shard_size)]
    for strategy, s in sizes:
        rafs: list[bool | int] = [True, False]
        if s == world and 1 < rpn < world:  # type: ignore[operator]
            rafs.append(rpn)  # type: ignore[arg-type]
        if config.reshard_after_forward is not None:
            rafs = [_checked_raf(config.reshard_after_forward, s, topo)]
        for raf in rafs:
            for sharded in ((False, True) if config.allow_state_sharding and s < world else (False,)):  # type: ignore[operator]
                label = strategy + ("-hpz" if _is_int(raf) else "")
                out.append(Candidate(strategy=label, shard_size=s, reshard_after_forward=raf, state_sharded=sharded))
    return out


def _checked_raf(raf: bool | int, shard_size: int, topo: Topology) -> bool | int:
    """An int reshard_after_forward must be a block of consecutive ranks inside one node."""
    if isinstance(raf, bool):
        return raf
    rpn: int = topo.ranks_per_node  # type: ignore[assignment]
    if shard_size % raf or rpn % raf or raf >= shard_size:
        raise PlannerError(
            f"reshard_after_forward = {raf} must divide the node size {rpn} and the shard size {shard_size} "
            f"and be smaller than it (FSDP2 reshards onto blocks of consecutive ranks, which must share a "
            f"node); use {rpn if rpn < shard_size and shard_size % rpn == 0 else True}")
    return raf


def _auto_min_unit_bytes(topo: Topology, shard_size: int) -> int:
    tier = topo.tier_of(range(shard_size))
    if tier is None:
        return 1
    return max(1, int(shard_size * tier.latency_s * tier.bandwidth_bytes_per_s))


def _mesh(topo: Topology, shard_size: int) -> MeshPlan:
    world: int = topo.world_size  # type: ignore[assignment]
    replicas = world // shard_size
    model = CostModel(topo)
    shape, names = ((shard_size,), ("shard",)) if replicas == 1 else ((replicas, shard_size), ("replicate", "shard"))
    return MeshPlan(shape=shape, dim_names=names, shard_size=shard_size, replicate_size=replicas,
                    shard_tier=model.tier_name((0, shard_size, 1)),
                    replicate_tier=model.tier_name((0, world, shard_size)))


def _all_gather_order(units: list[UnitPlan]) -> list[tuple[str, str]]:
    order = [(u.name, "forward") for u in units]
    order += [(u.name, "backward") for u in reversed(units) if u.reshard_after_forward is not False]
    return order


def _notes(cand: Candidate, evaluation: Evaluation, config: PlannerConfig) -> list[str]:
    notes = []
    rb = evaluation.rank_bytes
    if cand.state_sharded:
        notes.append(
            "optimizer state is sharded across the replicate axis; FSDP2 alone cannot execute that (its HSDP "
            "all-reduces gradients and keeps the full shard's state on every replica): train with "
            f"cpdpkit.planner.TwoStageExecutor for {format_bytes(rb.peak_bytes)} per rank; apply_plan alone "
            f"applies the mesh, units and placements only ({format_bytes(rb.fsdp2_peak_bytes)} per rank)")
    if config.memory_budget_bytes is not None and rb.fsdp2_peak_bytes > config.memory_budget_bytes >= rb.peak_bytes:
        notes.append("this plan fits the memory budget only with optimizer-state sharding")
    notes.append("activations are not modeled; keep room for them beside peak_memory_bytes")
    return notes


def _evaluate_all(spec: ModelSpec, topo: Topology, config: PlannerConfig,
                  candidates: list[Candidate], *, balanced: bool, merge: bool) -> list[tuple[Evaluation, Any]]:
    model = CostModel(topo)
    results = []
    for cand in candidates:
        min_bytes = config.min_unit_bytes or _auto_min_unit_bytes(topo, cand.shard_size)
        groups = group_blocks(spec, min_bytes if merge else 1, config.param_bytes)
        built = _build_units(spec, groups, cand.shard_size, balanced=balanced, raf=cand.reshard_after_forward)
        results.append((evaluate(model, built[1], cand, config), built))
    return results


def _to_plan(spec: ModelSpec, topo: Topology, config: PlannerConfig, evaluation: Evaluation, built: Any,
             *, notes: list[str] | None = None) -> ShardingPlan:
    cand = evaluation.candidate
    units, _, placements = built
    replicas = topo.world_size // cand.shard_size  # type: ignore[operator]
    state = StateSharding(axis="replicate" if cand.state_sharded else None,
                          num_partitions=replicas if cand.state_sharded else 1,
                          executed_by_fsdp2=not cand.state_sharded)
    plan = ShardingPlan(
        model_name=spec.name, strategy=cand.strategy + ("+state" if cand.state_sharded else ""),
        world_size=topo.world_size, topology=topo, config=config, mesh=_mesh(topo, cand.shard_size),  # type: ignore[arg-type]
        units=tuple(units), placements=tuple(placements), state_sharding=state,
        rank_bytes=evaluation.rank_bytes, comm=evaluation.comm, all_gather_order=tuple(_all_gather_order(units)),
        notes=tuple(notes if notes is not None else _notes(cand, evaluation, config)),
    )
    return replace(plan, schedule=plan_two_stage(plan))


def _budget_error(spec: ModelSpec, topo: Topology, config: PlannerConfig, results: list) -> PlannerError:
    budget = config.memory_budget_bytes
    leanest = min((ev for ev, _ in results), key=lambda ev: ev.rank_bytes.peak_bytes)
    rb = leanest.rank_bytes
    states = spec.numel * config.state_bytes_per_param
    msg = (f"memory budget {format_bytes(budget)} per rank is too small for {spec.name} on {topo.world_size} "  # type: ignore[arg-type]
           f"ranks: the leanest plan ({leanest.candidate.strategy}"
           f"{'+state' if leanest.candidate.state_sharded else ''}) needs {format_bytes(rb.peak_bytes)} per rank "
           f"(model states {format_bytes(rb.peak_bytes - rb.buffer_bytes)} + FSDP2 buffers "
           f"{format_bytes(rb.buffer_bytes)}); ")
    room = budget - rb.buffer_bytes  # type: ignore[operator]
    if room <= 0:
        return PlannerError(msg + f"the buffers alone exceed it on any number of ranks; raise --memory-budget "
                                  f"to more than {format_bytes(rb.buffer_bytes)}")
    rpn: int = topo.ranks_per_node  # type: ignore[assignment]
    need = ceil_div(ceil_div(states, room), rpn) * rpn
    return PlannerError(msg + f"raise --memory-budget to at least {format_bytes(rb.peak_bytes)} "
                              f"or use about {need} ranks or more")


def plan_sharding(model: Any, topology: Topology | str, *, world_size: int | None = None,
                  config: PlannerConfig | None = None, ranks_per_node: int | None = None) -> ShardingPlan:
    """The cheapest plan for ``model`` on ``topology`` that fits ``config.memory_budget_bytes``.

    ``model``: an ``nn.Module`` (meta device is fine), a :class:`ModelSpec`, a preset name
    (``llama-70b``) or ``"package.module:factory"``. ``topology``: a :class:`Topology` or a
    preset name / TOML path, placed on ``world_size``. Raises :class:`PlannerError` when no
    candidate fits the budget (naming what would).
    """
    config = config or PlannerConfig()
    spec, topo = resolve_inputs(model, topology, world_size, ranks_per_node)
    results = _evaluate_all(spec, topo, config, _candidates(topo, config), balanced=True, merge=True)
    budget = config.memory_budget_bytes
    fitting = [r for r in results if budget is None or r[0].rank_bytes.peak_bytes <= budget]
    if not fitting:
        raise _budget_error(spec, topo, config, results)
    fastest = min(ev.time_s for ev, _ in fitting)
    close = [r for r in fitting if r[0].time_s <= fastest * (1 + _TIME_TIE_FRAC) + 1e-12]
    best = min(close, key=lambda r: (r[0].rank_bytes.peak_bytes, r[0].time_s))
    return _to_plan(spec, topo, config, best[0], best[1])


def fsdp2_default_plan(model: Any, topology: Topology | str, *, world_size: int | None = None,
                       config: PlannerConfig | None = None, ranks_per_node: int | None = None) -> ShardingPlan:
    """FSDP2's default for the same inputs: every block a unit, ``Shard(0)`` everywhere, HSDP
    with shards inside a node (plain FSDP on one node), no state sharding. Ignores the budget."""
    config = config or PlannerConfig()
    spec, topo = resolve_inputs(model, topology, world_size, ranks_per_node)
    s: int = topo.ranks_per_node  # type: ignore[assignment]
    cand = Candidate(strategy="fsdp2-default", shard_size=s, reshard_after_forward=True, state_sharded=False)
    ((evaluation, built),) = _evaluate_all(spec, topo, config, [cand], balanced=False, merge=False)
    return _to_plan(spec, topo, config, evaluation, built, notes=[
        "FSDP2's default: fully_shard on every block and the root, Shard(0), shards inside a node"])


def planning_summary(plan: ShardingPlan, baseline: ShardingPlan, plan_seconds: float) -> dict[str, Any]:
    """The ``"summary"`` object of ``cpdpkit plan --json``: the plan's figures, its planning
    time, and the same figures for FSDP2's default under ``"baseline"``."""
    out = plan.summary()
    out["plan_seconds"] = plan_seconds
    out["fits_budget"] = _fits(plan)
    out["fsdp2_peak_memory_bytes"] = plan.rank_bytes.fsdp2_peak_bytes
    out["baseline"] = baseline.summary()
    out["baseline"]["fits_budget"] = _fits(baseline)
    return out


def _fits(plan: ShardingPlan) -> bool | None:
    budget = plan.config.memory_budget_bytes
    return None if budget is None else plan.rank_bytes.peak_bytes <= budget
