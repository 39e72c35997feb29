"""The sharding planner: choose units, mesh, placements and state sharding for one model.

:func:`plan_sharding` searches a small set of candidates and keeps the cheapest that fits:

1. **Units.** Every block (a child of a ``ModuleList``/``Sequential``) is a unit; neighbouring
   blocks of one container merge while the merged unit is below ``min_unit_bytes`` (default: the
   size where a collective's fixed cost equals its bandwidth term, ``p·(α + o/(p-1))·bandwidth``
   on the shard tier, ``o`` its ``collective_overhead_s``), so small layers do not pay one latency
   and one launch each. Blocks are never split.
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

5. **Partial sharding** (``param_sharding = "replicated"``, strategy ``partial``; with two nodes
   or more). Parameters stay whole on every rank; gradients and optimizer state are sharded over
   the world, inside the node first, then across nodes, and the updated slices all-gathered back
   the same way (:mod:`cpdpkit.planner._cost` has the bytes and the peak). No forward or backward
   all-gathers, and no link sends more than a ring all-reduce of the model would.

Each candidate's α-β time per step (the topology's model) and peak memory are computed in
closed form; among candidates within the memory budget the fastest wins, and among those within
1 % of it the leanest in memory, a plan with sharded parameters before a partial one (so a
partial plan wins when it is more than 1 % faster than every sharded plan that fits, i.e. when
memory rules those out; ``param_sharding`` forces either kind). The plan keeps every
candidate's figures (``candidates``) and says why it won (``choice_reason``).

6. **Reconciliation across sites** (``reconcile_period = K`` on a topology of several sites,
   CPDP over sharded training inside each site): the shard axis is the site, the replicate axis
   crosses sites only at a reconciliation every K steps, priced per step as its cost / K, and
   SlowMo's anchor and slow momentum join the memory (:mod:`cpdpkit.planner._reconcile_cost`).
:func:`fsdp2_default_plan` prices FSDP2's defaults the same way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from cpdpkit._values import is_int
from cpdpkit.planner._cost import Candidate, CostModel, Evaluation, UnitGeom, evaluate, shard_layout
from cpdpkit.planner._reconcile_cost import reconcile_site_size, reconciled
from cpdpkit.planner.config import PlannerConfig, PlannerError, ceil_div, format_bytes
from cpdpkit.planner.model_spec import ROOT, ModelSpec
from cpdpkit.planner.plan import CandidateSummary, MeshPlan, ParamPlacement, ShardingPlan, StateSharding, UnitPlan
from cpdpkit.planner.presets import load_model_spec
from cpdpkit.planner.schedule import compute_model, exchange_schedule, plan_two_stage, unit_timing
from cpdpkit.topology import Topology, TopologySpec, resolve_topology

__all__ = ["plan_sharding", "fsdp2_default_plan", "planning_summary", "resolve_inputs"]

_TIME_TIE_FRAC = 0.01  # candidates within 1 % of the fastest count as equally fast
_ROOT_NAME = "<root>"


def resolve_inputs(model: Any, topology: Topology | TopologySpec | str, world_size: int | None = None,
                   ranks_per_node: int | None = None) -> tuple[ModelSpec, Topology]:
    """(ModelSpec, placed Topology) from the flexible inputs the public functions accept: the planner's
    one edge (everything below it takes the placed Topology)."""
    spec = load_model_spec(model)
    if isinstance(topology, str):
        given: Topology | TopologySpec = resolve_topology(topology, world_size=world_size,
                                                          ranks_per_node=ranks_per_node)
    elif isinstance(topology, (Topology, TopologySpec)):
        given = replace(topology, ranks_per_node=ranks_per_node) if ranks_per_node is not None else topology
    else:
        raise PlannerError(f"topology = {topology!r} is invalid; pass a Topology, a preset name or a .toml path")
    if isinstance(given, Topology):
        return spec, given if world_size is None else given.place(world_size)
    world = world_size if world_size is not None else given.fixed_world_size
    if world is None:
        raise PlannerError(f"topology {given.name!r} is not placed; pass world_size (--world-size)")
    return spec, given.place(world)


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
        unit_balanced = balanced and not is_int(unit_raf)
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


def _build_partial_units(spec: ModelSpec, groups: list[list[int]]) -> tuple[list[UnitPlan], list[UnitGeom], list]:
    """Units of a partial plan (root first): whole parameters, nothing padded, no placements."""
    per_block, root_params = _block_params(spec)
    members = [(_ROOT_NAME, ("",), root_params, True)]
    members += [(_unit_name(spec, g), tuple(spec.blocks[b].fqn for b in g), [i for b in g for i in per_block[b]], False)
                for g in groups]
    units, geoms = [], []
    for name, fqns, idx, is_root in members:
        numel = sum(spec.params[i].numel for i in idx)
        units.append(UnitPlan(name=name, module_fqns=fqns, param_fqns=tuple(spec.params[i].fqn for i in idx),
                              numel=numel, padded_numel=numel, reshard_after_forward=False))
        geoms.append(UnitGeom(padded_numel=numel, real_by_position=np.asarray([numel], dtype=np.int64),
                              reshard_after_forward=False, is_root=is_root))
    return units, geoms, []


# ---- candidates ----------------------------------------------------------------------------
def _shard_sizes(topo: Topology) -> list[tuple[str, int]]:
    """(strategy, shard size): a node, a site, the world; deduplicated, largest group last."""
    rpn, nps = topo.ranks_per_node, topo.nodes_per_site
    world = topo.world_size
    out: dict[int, str] = {}
    for name, size in (("hsdp-node", rpn), ("hsdp-site", rpn * nps), ("fsdp", world)):
        out.setdefault(size, name)
    if world in out:
        out[world] = "fsdp"
    return [(name, size) for size, name in sorted(out.items())]


def _candidates(topo: Topology, config: PlannerConfig) -> list[Candidate]:
    out = _sharded_candidates(topo, config) if config.param_sharding != "replicated" else []
    # a partial plan exchanges across the world every step: not with a reconciliation period (the
    # config refuses param_sharding="replicated" with one)
    if config.param_sharding != "sharded" and reconcile_site_size(topo, config) is None:
        out += _partial_candidates(topo, config)
    return out


def _partial_candidates(topo: Topology, config: PlannerConfig) -> list[Candidate]:
    """The partial candidate (shards of a node, replicas across nodes) where the config allows it.

    Left out silently when ``param_sharding`` is ``None``; when it is ``"replicated"`` a topology
    or option that rules it out is an error naming the fix.
    """
    world, rpn = topo.world_size, topo.ranks_per_node
    problem = None
    if world // rpn < 2:
        problem = (f"needs at least 2 nodes (gradients and optimizer state shard inside a node, then across "
                   f"nodes), but {topo.name!r} places all {world} ranks on one node; use more ranks, "
                   "--ranks-per-node, or param_sharding 'sharded'")
    elif config.shard_size is not None and config.shard_size != rpn:
        problem = (f"shards inside a node ({rpn} ranks), which shard_size = {config.shard_size} contradicts; "
                   f"leave shard_size None or set it to {rpn}")
    elif not config.allow_state_sharding or config.reshard_after_forward not in (None, False):
        problem = "is ruled out by allow_state_sharding or reshard_after_forward"  # the config refuses these
    if problem is None:
        return [Candidate(strategy="partial", shard_size=rpn, reshard_after_forward=False, state_sharded=True,
                          param_sharding="replicated")]
    if config.param_sharding == "replicated":
        raise PlannerError(f"param_sharding = 'replicated' {problem}")
    return []


def _sharded_candidates(topo: Topology, config: PlannerConfig) -> list[Candidate]:
    out = []
    world, rpn = topo.world_size, topo.ranks_per_node
    sizes = _shard_sizes(topo)
    site = reconcile_site_size(topo, config)
    if site is not None:  # the site is the sharding domain; shard_size is checked to be it
        sizes = [(name, s) for name, s in sizes if s == site]
    elif config.shard_size is not None:
        if world % config.shard_size:
            raise PlannerError(f"shard_size = {config.shard_size} does not divide the world size {world}; "
                               f"use a divisor such as {topo.ranks_per_node} (one node) or {world}")
        chosen = dict((s, name) for name, s in sizes).get(config.shard_size, "hsdp")
        sizes = [("fsdp" if config.shard_size == world else chosen, config.shard_size)]
    # with a reconciliation the replicate axis crosses sites only every K steps: no state sharding across it
    state_sharding = config.allow_state_sharding and site is None
    for strategy, s in sizes:
        rafs: list[bool | int] = [True, False]
        if s == world and 1 < rpn < world:
            rafs.append(rpn)
        if config.reshard_after_forward is not None:
            rafs = [_checked_raf(config.reshard_after_forward, s, topo)]
        for raf in rafs:
            for sharded in ((False, True) if state_sharding and s < world else (False,)):
                label = strategy + ("-hpz" if is_int(raf) else "")
                out.append(Candidate(strategy=label, shard_size=s, reshard_after_forward=raf, state_sharded=sharded))
    return out


def _checked_raf(raf: bool | int, shard_size: int, topo: Topology) -> bool | int:
    """An int reshard_after_forward must be a block of consecutive ranks inside one node."""
    if isinstance(raf, bool):
        return raf
    rpn = topo.ranks_per_node
    if shard_size % raf or rpn % raf or raf >= shard_size:
        raise PlannerError(
            f"reshard_after_forward = {raf} must divide the node size {rpn} and the shard size {shard_size} "
            f"and be smaller than it (FSDP2 reshards onto blocks of consecutive ranks, which must share a "
            f"node); use {rpn if rpn < shard_size and shard_size % rpn == 0 else True}")
    return raf


def _exchanges(topo: Topology, cand: Candidate) -> bool:
    """Whether ``cand`` exchanges updated parameters across replicas (the two-stage schedule's subject)."""
    return topo.world_size // cand.shard_size >= 2 and (cand.state_sharded or cand.param_sharding == "replicated")


def _groupings(spec: ModelSpec, min_bytes: int, param_bytes: int) -> list[list[list[int]]]:
    """The distinct block groupings from ``min_bytes`` (the latency-bound size) down to one block per unit."""
    out: list[list[list[int]]] = []
    while True:
        groups = group_blocks(spec, min_bytes, param_bytes)
        if groups not in out:
            out.append(groups)
        if min_bytes <= 1:
            return out
        min_bytes = max(1, min_bytes // 2)


def _overlapped_s(topo: Topology, config: PlannerConfig, cand: Candidate, units: list[UnitPlan],
                  evaluation: Evaluation) -> tuple[float, float]:
    """Predicted exposed communication of a step with these units: the phases off the replicate axis
    as the cost model sums them, plus the two-stage schedule's exposed time of the replicate-axis
    exchanges as the candidate's executor runs them (reduce-scatters under backward, updated
    parameters under the rest of backward and the next forward; :mod:`cpdpkit.planner.schedule`),
    on the config's compute model; and how long after backward the last exchange ends (the tie-break:
    when the root unit's exchange alone sets the exposed time, finer units still leave less traffic
    for the next forward)."""
    model = compute_model(config)
    timings = [unit_timing(u.name, u.numel, model["tokens_per_rank"], model["flops_per_s"]) for u in units]
    sched = exchange_schedule(units, timings, topo, config, cand.shard_size)
    off_axis = sum(p.time_s for p in evaluation.comm if p.axis != "replicate")
    return off_axis + sched.exposed_s, max(s.end_s for s in sched.slots) - sched.backward_s


def _auto_min_unit_bytes(topo: Topology, shard_size: int) -> int:
    """The unit size where a shard-axis collective's fixed cost equals its bandwidth term:
    ``p·(α + o/(p-1))·B`` (``o`` the tier's ``collective_overhead_s``; ``p·α·B`` without it), since an
    all-gather of ``n`` bytes costs ``(p-1)α + o`` fixed and ``(p-1)/p·n/B`` for the bytes."""
    tier = topo.tier_of(range(shard_size))
    if tier is None:
        return 1
    fixed_per_step = tier.latency_s + tier.collective_overhead_s / max(1, shard_size - 1)
    return max(1, int(shard_size * fixed_per_step * tier.bandwidth_bytes_per_s))


def _mesh(topo: Topology, shard_size: int) -> MeshPlan:
    world = topo.world_size
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
    if cand.param_sharding == "replicated":
        notes.append(
            "partially sharded data parallelism: parameters are replicated on every rank (no placements, nothing "
            "padded); each unit's gradient is reduce-scattered inside the node, then across nodes, every rank "
            "updates its 1/world slice of the optimizer state, and the updated slices are all-gathered back "
            "across nodes, then inside the node. FSDP2 and apply_plan cannot run it; train with "
            f"cpdpkit.shard.PartialShardExecutor for {format_bytes(rb.peak_bytes)} per rank (plain DDP "
            f"{format_bytes(rb.fsdp2_peak_bytes)})")
    elif cand.state_sharded:
        notes.append(
            "optimizer state is sharded across the replicate axis; FSDP2 alone cannot execute that (its HSDP "
            "all-reduces gradients and keeps the full shard's state on every replica): train with "
            f"cpdpkit.shard.TwoStageExecutor for {format_bytes(rb.peak_bytes)} per rank; apply_plan alone "
            f"applies the mesh, units and placements only ({format_bytes(rb.fsdp2_peak_bytes)} per rank)")
    if config.memory_budget_bytes is not None and rb.fsdp2_peak_bytes > config.memory_budget_bytes >= rb.peak_bytes:
        notes.append("this plan fits the memory budget only with "
                     + ("gradients and optimizer state sharded" if cand.param_sharding == "replicated"
                        else "optimizer-state sharding"))
    if evaluation.reconciliation is not None:
        notes.append(_reconcile_note(evaluation))
    notes.append("activations are not modeled; keep room for them beside peak_memory_bytes")
    return notes


def _reconcile_note(evaluation: Evaluation) -> str:
    rec = evaluation.reconciliation
    assert rec is not None
    return (f"CPDP across sites: each site shards the model over its {evaluation.candidate.shard_size} ranks; the "
            f"replicate axis ({rec.num_ranks} sites, {rec.tier}) carries nothing on a local step (apply_plan shards "
            f"over the site only; wrap the optimizer in PeriodicSyncOptimizer(group=mesh['replicate'].get_group(), "
            f"period={rec.period})) and every {rec.period} steps a "
            f"reconciliation: gradient all-reduce and parameter average of each rank's shard, "
            f"{format_bytes(rec.wire_bytes_per_rank)} per rank in {_fmt_s(rec.time_s)} "
            f"({_fmt_s(rec.amortised_s_per_step)}/step); SlowMo's anchor and slow momentum ({rec.anchor_dtype}) add "
            f"{format_bytes(rec.slowmo_state_bytes)} per rank, included in the peak")


def _evaluate_all(spec: ModelSpec, topo: Topology, config: PlannerConfig,
                  candidates: list[Candidate], *, balanced: bool, merge: bool) -> list[tuple[Evaluation, Any]]:
    model = CostModel(topo)
    reconciling = reconcile_site_size(topo, config) is not None
    results = []
    for cand in candidates:
        min_bytes = config.min_unit_bytes or _auto_min_unit_bytes(topo, cand.shard_size)
        choices = [group_blocks(spec, min_bytes if merge else 1, config.param_bytes)]
        if merge and config.min_unit_bytes is None and _exchanges(topo, cand):
            choices = _groupings(spec, min_bytes, config.param_bytes)
        scored = []
        for groups in choices:
            if cand.param_sharding == "replicated":
                built = _build_partial_units(spec, groups)
            else:
                built = _build_units(spec, groups, cand.shard_size, balanced=balanced,
                                     raf=cand.reshard_after_forward)
            evaluation = evaluate(model, built[1], cand, config)
            score = _overlapped_s(topo, config, cand, built[0], evaluation) if len(choices) > 1 else (0.0, 0.0)
            scored.append((*score, len(scored), evaluation, built))
        # least predicted exposed time; among groupings within 1 % of it, the one whose link is free soonest
        # after backward (least exchange traffic left for the next forward), then the coarsest
        least = min(x[0] for x in scored)
        close = [x for x in scored if x[0] <= least * (1 + _TIME_TIE_FRAC) + 1e-9]
        *_, evaluation, built = min(close, key=lambda x: (x[1], x[2]))
        if evaluation is not scored[0][3]:  # the strategy is chosen as at the latency-bound size, its units for overlap
            evaluation = replace(evaluation, ranking_time_s=scored[0][3].time_s)
        if reconciling:
            evaluation = reconciled(model, built[1], evaluation, config)
        results.append((evaluation, built))
    return results


def _to_plan(spec: ModelSpec, topo: Topology, config: PlannerConfig, evaluation: Evaluation, built: Any,
             *, notes: list[str] | None = None, candidates: tuple[CandidateSummary, ...] = (),
             reason: str = "") -> ShardingPlan:
    cand = evaluation.candidate
    units, _, placements = built
    world = topo.world_size
    replicas = world // cand.shard_size
    partial = cand.param_sharding == "replicated"
    if partial:
        state = StateSharding(axis="world", num_partitions=world, executed_by_fsdp2=False)
    else:
        state = StateSharding(axis="replicate" if cand.state_sharded else None,
                              num_partitions=replicas if cand.state_sharded else 1,
                              executed_by_fsdp2=not cand.state_sharded)
    plan = ShardingPlan(
        model_name=spec.name, strategy=cand.label, world_size=world, topology=topo, config=config,
        mesh=_mesh(topo, cand.shard_size), units=tuple(units), placements=tuple(placements), state_sharding=state,
        rank_bytes=evaluation.rank_bytes, comm=evaluation.comm,
        all_gather_order=() if partial else tuple(_all_gather_order(units)),
        notes=tuple(notes if notes is not None else _notes(cand, evaluation, config)),
        param_sharding=cand.param_sharding, candidates=candidates, choice_reason=reason,
        reconciliation=evaluation.reconciliation,
    )
    return replace(plan, schedule=plan_two_stage(plan))


def _budget_error(spec: ModelSpec, topo: Topology, config: PlannerConfig, results: list) -> PlannerError:
    budget = config.memory_budget_bytes
    assert budget is not None, "called only when a budget ruled every candidate out"
    leanest = min((ev for ev, _ in results), key=lambda ev: ev.rank_bytes.peak_bytes)
    rb = leanest.rank_bytes
    states = spec.numel * config.state_bytes_per_param
    partial = leanest.candidate.param_sharding == "replicated"
    msg = (f"memory budget {format_bytes(budget)} per rank is too small for {spec.name} on {topo.world_size} "
           f"ranks: the leanest plan ({leanest.candidate.label}) needs {format_bytes(rb.peak_bytes)} per rank "
           f"(model states {format_bytes(rb.peak_bytes - rb.buffer_bytes)} + {'' if partial else 'FSDP2 '}buffers "
           f"{format_bytes(rb.buffer_bytes)}); ")
    if partial:  # only when param_sharding = "replicated": its replicated parameters do not shrink with ranks
        room = budget - rb.buffer_bytes - rb.padded_param_bytes
        if room <= 0:
            return PlannerError(msg + "its replicated parameters and buffers alone exceed it on any number of ranks; "
                                      f"raise --memory-budget to at least {format_bytes(rb.peak_bytes)} or use "
                                      "param_sharding 'sharded'")
        states = spec.numel * (config.grad_bytes + config.optim_state_bytes_per_param)
        return PlannerError(msg + f"raise --memory-budget to at least {format_bytes(rb.peak_bytes)} or use about "
                                  f"{ceil_div(states, room)} ranks or more")
    room = budget - rb.buffer_bytes
    if room <= 0:
        return PlannerError(msg + f"the buffers alone exceed it on any number of ranks; raise --memory-budget "
                                  f"to more than {format_bytes(rb.buffer_bytes)}")
    rpn = topo.ranks_per_node
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
    fastest = min(ev.ranking_s for ev, _ in fitting)
    close = [r for r in fitting if r[0].ranking_s <= fastest * (1 + _TIME_TIE_FRAC) + 1e-12]
    # A tie keeps parameters sharded: partial wins only when it is more than 1 % faster than every
    # sharded plan that fits (in practice: when memory rules out the sharded plans as fast as it),
    # because its executor is not FSDP2 and existing users of the default plan run FSDP2-style plans.
    pool = [r for r in close if r[0].candidate.param_sharding == "sharded"] or close
    leanest = lambda r: (r[0].rank_bytes.peak_bytes, r[0].ranking_s)  # noqa: E731
    best = min(pool, key=leanest)
    summaries = tuple(_summary(r[0], budget, chosen=r is best) for r in results)
    kept = min(close, key=leanest) is not best  # a leaner partial plan as fast was passed over
    reason = _choice_reason(summaries, budget, num_close=len(pool) if kept else len(close), tie_kept_sharded=kept)
    return _to_plan(spec, topo, config, best[0], best[1], candidates=summaries, reason=reason)


def _summary(evaluation: Evaluation, budget: int | None, *, chosen: bool) -> CandidateSummary:
    cand, peak = evaluation.candidate, evaluation.rank_bytes.peak_bytes
    return CandidateSummary(strategy=cand.label, shard_size=cand.shard_size,
                            reshard_after_forward=cand.reshard_after_forward, state_sharded=cand.state_sharded,
                            param_sharding=cand.param_sharding, time_s=evaluation.ranking_s, peak_bytes=peak,
                            fits_budget=budget is None or peak <= budget, chosen=chosen)


# ---- why this candidate ----------------------------------------------------------------------
def _fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _name(c: CandidateSummary) -> str:
    return c.strategy if c.param_sharding == "replicated" else f"{c.strategy} raf={c.reshard_after_forward}"


def _speed(c: CandidateSummary, ref: CandidateSummary) -> str:
    """``c``'s time against ``ref``'s: "3.1 % slower", "as fast"..."""
    if ref.time_s <= 0:
        return "as fast" if c.time_s <= 0 else f"{_fmt_s(c.time_s)} slower"
    pct = (c.time_s - ref.time_s) / ref.time_s * 100
    if abs(pct) < 0.05:
        return "as fast"
    return f"{abs(pct):.1f} % {'slower' if pct > 0 else 'faster'}"


def _memory(c: CandidateSummary, ref: CandidateSummary) -> str:
    diff = c.peak_bytes - ref.peak_bytes
    if diff == 0:
        return "the same memory"
    return f"{format_bytes(abs(diff))} {'more' if diff > 0 else 'less'}"


def _choice_reason(cands: tuple[CandidateSummary, ...], budget: int | None, *, num_close: int,
                   tie_kept_sharded: bool) -> str:
    """One sentence: why the chosen candidate won, and what the nearest alternatives would cost."""
    chosen = next(c for c in cands if c.chosen)
    fit = [c for c in cands if c.fits_budget]
    where = f"that fit {format_bytes(budget)}" if budget is not None else "(no memory budget)"
    if len(cands) == 1:
        head = (f"the only candidate (param_sharding={chosen.param_sharding!r})"
                + (f", and it fits {format_bytes(budget)}" if budget is not None else ""))
    elif len(fit) == 1:
        head = f"the only one of the {len(cands)} candidates {where}"
    elif chosen.time_s <= min(c.time_s for c in fit):
        head = f"fastest of the {len(fit)} candidates {where}"
    else:
        head = (f"leanest of the {num_close} {'sharded-parameter ' if tie_kept_sharded else ''}candidates within "
                f"{_TIME_TIE_FRAC * 100:g} % of the fastest of the {len(fit)} {where}")
    parts = [f"{head} ({_fmt_s(chosen.time_s)}/step, {format_bytes(chosen.peak_bytes)} peak)"]
    told = [chosen]
    if tie_kept_sharded:  # a partial plan as fast (within 1 %) was passed over: say so first
        tied = min((c for c in fit if c.param_sharding == "replicated"), key=lambda c: c.time_s)
        parts.append(f"{_name(tied)} is {_speed(tied, chosen)} and needs {_memory(tied, chosen)}, but within "
                     f"{_TIME_TIE_FRAC * 100:g} % parameters stay sharded (param_sharding='replicated' picks it)")
        told.append(tied)
    runner_up = min((c for c in fit if c not in told), key=lambda c: (c.time_s, c.peak_bytes), default=None)
    if runner_up is not None:
        parts.append(f"{_name(runner_up)} is {_speed(runner_up, chosen)} and needs {_memory(runner_up, chosen)}")
        told.append(runner_up)
    leanest = min(fit, key=lambda c: (c.peak_bytes, c.time_s))
    if leanest not in told and leanest.peak_bytes < chosen.peak_bytes:
        parts.append(f"{_name(leanest)} is leaner by {_memory(chosen, leanest).removesuffix(' more')} "
                     f"but {_speed(leanest, chosen)}")
        told.append(leanest)
    # what memory would buy: the leanest of the fastest candidates over the budget (as fast or faster)
    over = [c for c in cands if not c.fits_budget and c.time_s <= chosen.time_s * (1 + _TIME_TIE_FRAC)]
    top = min((c.time_s for c in over), default=0.0) * (1 + _TIME_TIE_FRAC)
    faster = min((c for c in over if c.time_s <= top), key=lambda c: c.peak_bytes, default=None)
    if faster is not None:
        parts.append(f"{_name(faster)} would be {_speed(faster, chosen)} but needs {format_bytes(faster.peak_bytes)}, "
                     "over the budget")
        told.append(faster)
    other = [c for c in cands if c.param_sharding != chosen.param_sharding]
    if other and not any(c in told for c in other):  # always say how the other kind of plan fared
        best = min(other, key=lambda c: (not c.fits_budget, c.time_s, c.peak_bytes))
        if best.fits_budget:
            parts.append(f"{_name(best)} is {_speed(best, chosen)} and needs {_memory(best, chosen)}")
        else:
            parts.append(f"{_name(best)} needs {format_bytes(best.peak_bytes)}, over the budget")
    return "; ".join(parts)


def fsdp2_default_plan(model: Any, topology: Topology | str, *, world_size: int | None = None,
                       config: PlannerConfig | None = None, ranks_per_node: int | None = None) -> ShardingPlan:
    """FSDP2's default for the same inputs: every block a unit, ``Shard(0)`` everywhere, HSDP
    with shards inside a node (plain FSDP on one node), no state sharding. Ignores the budget
    and ``reconcile_period`` (FSDP2's HSDP all-reduces across its replicate axis every step)."""
    config = replace(config or PlannerConfig(), reconcile_period=None)
    spec, topo = resolve_inputs(model, topology, world_size, ranks_per_node)
    s = topo.ranks_per_node
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
    out["choice_reason"] = plan.choice_reason
    out["baseline"] = baseline.summary()
    out["baseline"]["fits_budget"] = _fits(baseline)
    return out


def _fits(plan: ShardingPlan) -> bool | None:
    budget = plan.config.memory_budget_bytes
    return None if budget is None else plan.rank_bytes.peak_bytes <= budget
