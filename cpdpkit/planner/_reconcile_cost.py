"""CPDP across sites over sharded training inside each site: the planner's reconciliation costs.

With ``PlannerConfig.reconcile_period = K`` on a topology of several sites, **the site is the
sharding domain and the WAN carries only periodic reconciliation**:

* the shard axis is a site (``S`` = ranks per site, consecutive ranks): FSDP2 shards parameters,
  gradients and optimizer state over the site's fast tiers, and no candidate shards across
  sites; the replicate axis (``R`` = number of sites) is the cross-site axis;
* nothing crosses the replicate axis on a local step (:func:`~cpdpkit.shard.apply_plan` shards
  such a plan over the mesh's ``shard`` sub-mesh only, and :class:`~cpdpkit.sync.PeriodicSyncOptimizer`
  with ``group=mesh["replicate"].get_group()`` and ``period=K`` synchronises across sites; FSDP2's own
  HSDP cannot skip its all-reduce and still assign gradients), so the per-step ``gradient all-reduce``
  phase is dropped, and no candidate shards optimizer state across the replicate axis (that would
  reduce-scatter and all-gather over the WAN every step), nor is the partial kind considered;
* every K-th step is a reconciliation. Each rank all-reduces its gradient shard over its
  cross-site group (the ``R`` ranks holding the same shard, one per site), one collective per
  unit as FSDP2's HSDP issues them, and averages its parameter shard over the same group (one
  flat all-reduce of the whole shard in ``param_dtype``, as SlowMo's averaging flattens it),
  priced by the network model for that group. The per-step cost is that reconciliation's time
  / K. Like every replicate-axis phase of the planner, one group is priced as if alone: the
  ``S`` cross-site groups of a site run at once over the site's uplink, which the emulator books
  first-come-first-served (``NetworkGroup.cost(op, n, concurrent=S)`` prices that: ``S`` times
  longer), so a plan's figures compare plans with and without a period on one footing;
* SlowMo keeps an anchor and a slow momentum of the rank's parameter shard in float32: each
  rank's optimizer bytes grow by ``2 × 4 ×`` its parameter elements, the peak by ``2 × 4 ×`` the
  padded shard (what the largest rank holds).

Collective times and bytes come from :meth:`cpdpkit.topology.Topology.group`, nothing else.
"""

from __future__ import annotations

from dataclasses import replace

from cpdpkit.planner._cost import CostModel, Evaluation, UnitGeom, comm_phase
from cpdpkit.planner.config import DTYPE_BYTES, PlannerConfig, PlannerError
from cpdpkit.planner.plan import CommPhase, RankBytes, Reconciliation
from cpdpkit.topology import Topology

__all__ = ["ANCHOR_DTYPE", "reconcile_site_size", "reconciled"]

ANCHOR_DTYPE = "float32"  # SlowMo's anchor and slow momentum (cpdpkit.sync requires float32 for low-precision params)
_SLOWMO_COPIES = 2  # the anchor and the slow momentum


def reconcile_site_size(topo: Topology, config: PlannerConfig) -> int | None:
    """Ranks per site when ``config`` reconciles across the sites of ``topo``; ``None`` without a period.

    Raises :class:`PlannerError` (one line) when the period cannot apply: one site, or a
    ``shard_size`` that is not the site.
    """
    k = config.reconcile_period
    if k is None:
        return None
    sites, site = topo.num_sites, topo.ranks_per_node * topo.nodes_per_site
    if sites < 2:
        raise PlannerError(f"reconcile_period = {k} reconciles across sites, but topology {topo.name!r} has one site "
                           f"({topo.world_size} ranks); leave reconcile_period None or use a topology of several "
                           "sites (multisite, wan, or a TOML with num_sites >= 2)")
    if config.shard_size is not None and config.shard_size != site:
        raise PlannerError(f"shard_size = {config.shard_size} contradicts reconcile_period = {k}: the shard axis is "
                           f"then a site of {topo.name!r} ({site} ranks); leave shard_size None or set it to {site}")
    return site


def _phase(name: str, group: tuple[int, int, int], model: CostModel, sizes: list[int]) -> CommPhase:
    phase = comm_phase(model, name, "all_reduce", "replicate", group, sizes)
    assert phase is not None  # at least two sites and one unit
    return phase


def _with_slowmo_state(rb: RankBytes, config: PlannerConfig) -> tuple[RankBytes, int]:
    """``rb`` with SlowMo's anchor and slow momentum added (optimizer bytes and both peaks)."""
    per_element = _SLOWMO_COPIES * DTYPE_BYTES[ANCHOR_DTYPE]
    pb = config.param_bytes
    largest = per_element * (rb.padded_param_bytes // pb)
    optim = tuple(o + per_element * (p // pb) for o, p in zip(rb.optim_bytes, rb.param_bytes))
    return replace(rb, optim_bytes=optim, peak_bytes=rb.peak_bytes + largest,
                   fsdp2_peak_bytes=rb.fsdp2_peak_bytes + largest), largest


def reconciled(model: CostModel, units: list[UnitGeom], evaluation: Evaluation, config: PlannerConfig) -> Evaluation:
    """``evaluation`` of a site-sharded candidate with its replicate axis reconciled every K steps."""
    cand = evaluation.candidate
    k = config.reconcile_period
    assert k is not None, "called for a reconciled candidate only"
    s, w = cand.shard_size, model.world_size
    assert not cand.state_sharded and cand.param_sharding == "sharded", cand  # the search never offers them
    cross_site = (0, w, s)  # shard position 0's group; every position's is the same shape
    chunks = [u.padded_numel // s for u in units]
    phases = (
        _phase("gradient all-reduce", cross_site, model, [n * config.grad_bytes for n in chunks]),
        _phase("parameter average", cross_site, model, [sum(chunks) * config.param_bytes]),
    )
    time_s = sum(p.time_s for p in phases)
    rank_bytes, slowmo = _with_slowmo_state(evaluation.rank_bytes, config)
    rec = Reconciliation(period=k, axis="replicate", tier=phases[0].tier, num_ranks=phases[0].num_ranks,
                         num_groups=s, phases=phases, wire_bytes_per_rank=sum(p.wire_bytes_per_rank for p in phases),
                         time_s=time_s, amortised_s_per_step=time_s / k, slowmo_state_bytes=slowmo,
                         anchor_dtype=ANCHOR_DTYPE)
    comm = tuple(p for p in evaluation.comm if p.axis != "replicate")  # nothing crosses sites on a local step
    return replace(evaluation, comm=comm, rank_bytes=rank_bytes, reconciliation=rec)
