"""Training a sharding plan: the torch runtime behind :mod:`cpdpkit.planner`'s plans.

:mod:`cpdpkit.planner` decides (pure Python, no torch); this package executes what it decided:

* :func:`apply_plan` applies a plan with FSDP2's ``fully_shard`` (the mesh, the units, the
  ``Shard(dim)`` placements); optimizer state sharded across the replicate axis needs an executor.
* :class:`TwoStageExecutor`: FSDP2 inside a replica, the gradient shards reduce-scattered across
  replicas, each rank's optimizer slice updated and the updated slices all-gathered back in two
  stages (during backward, and what cannot finish in time during the next forward).
* :class:`PartialShardExecutor`: the same slice pipeline for ``param_sharding="replicated"``
  plans (parameters replicated, gradients and optimizer state sharded over the world, node first).

Both executors share the slice pipeline (``_slices``), its schedule (``_slice_schedule``) and
their checkpoint state (``_executor_state``). This package sits above ``planner`` in the
layering (it imports the planner, never the reverse) and imports torch at module level.
"""

from __future__ import annotations

from cpdpkit.shard.apply import apply_plan
from cpdpkit.shard.executor import TwoStageExecutor, optimizer_state_bytes
from cpdpkit.shard.partial import PartialShardExecutor

__all__ = ["PartialShardExecutor", "TwoStageExecutor", "apply_plan", "optimizer_state_bytes"]
