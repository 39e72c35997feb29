"""Process groups for hierarchical synchronisation (fast group inside a node, slow across)."""

from __future__ import annotations

import torch.distributed as dist

from cpdpkit.errors import ConfigError

__all__ = ["hierarchical_groups"]


def hierarchical_groups(
    ranks_per_node: int,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Create ``(fast_group, slow_group)`` for this rank; every rank must call it.

    The fast group holds the ``ranks_per_node`` consecutive ranks of this rank's node; the
    slow group holds the ranks with the same local index on every node (torchrun numbers
    ranks node by node). Pass them as ``fast_group=`` / ``slow_group=``.
    """
    world = dist.get_world_size()
    if ranks_per_node < 1 or world % ranks_per_node != 0:
        raise ConfigError(
            f"ranks_per_node={ranks_per_node} does not divide the world size {world}: "
            f"pass a divisor of {world}"
        )
    num_nodes = world // ranks_per_node
    fast, _ = dist.new_subgroups_by_enumeration(
        [list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(num_nodes)]
    )
    slow, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, world, ranks_per_node)) for i in range(ranks_per_node)]
    )
    return fast, slow
