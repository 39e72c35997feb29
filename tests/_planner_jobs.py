"""Multi-process jobs for tests/test_planner_apply.py: apply_plan vs plain FSDP2 numerics.

Each spawned rank starts its process group with ``cpdpkit.init_distributed`` through a
``file://`` rendezvous in the test's tmp dir (no port at all), on plain gloo or on the
emulated backend, trains the same model twice (plain FSDP2, then ``apply_plan``) and writes
what it saw to ``rank<R>.pt``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from _ranks import run_spawned
from cpdpkit.topology import Tier, TopologySpec

# The emulated case's links: two "sites" of two ranks, delays small enough to keep the test fast.
FAST_WAN = TopologySpec(
    name="fast-wan",
    tiers=(Tier(name="LAN", latency_s=20e-6, bandwidth_bytes_per_s=10e9),
           Tier(name="WAN", latency_s=200e-6, bandwidth_bytes_per_s=1e9)),
    intra_node_tier="LAN", inter_site_tier="WAN", ranks_per_node=None, nodes_per_site=1, num_sites=2,
)
NUM_STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 6)  # weight (6, 12): on 4 ranks dim 0 does not divide, dim 1 does
        self.fc2 = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.tanh(self.fc1(x))))


class Net(nn.Module):
    """Root parameters (embed, head, out) around four blocks; shapes that need padding or Shard(1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 12)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(12, 3)
        self.out = nn.Linear(3, 5)  # weight (5, 3): no dim divides 2 or 4 -> padded Shard(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.out(torch.relu(self.head(x)))


def make_net() -> Net:
    torch.manual_seed(1234)
    return Net()


def spawn(world_size: int, tmp_path: Path, cases: list[dict[str, Any]], *, emulated: bool,
          timeout_s: float = 100.0) -> list[dict[str, Any]]:
    out = tmp_path / f"w{world_size}{'emu' if emulated else 'gloo'}"
    out.mkdir()
    return run_spawned(_entry, (world_size, str(out), cases, emulated), world_size, out, timeout_s)


def init_rank(rank: int, world_size: int, out: str, *, emulated: bool) -> Any:
    """One thread per spawned rank; its process group through a ``file://`` rendezvous in ``out``
    (gloo, or the emulated backend over :data:`FAST_WAN`). Returns ``init_distributed``'s info."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from cpdpkit.emulator import init_distributed

    return init_distributed(backend=None if emulated else "gloo", topology=FAST_WAN if emulated else None,
                            init_method=f"file://{out}/store", rank=rank, world_size=world_size)


def finish_rank(rank: int, out: str, saved: dict[str, Any]) -> None:
    """Write what this rank saw as ``out/rank<R>.pt`` (what :func:`run_spawned` returns), then leave."""
    torch.save(saved, Path(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _entry(rank: int, world_size: int, out: str, cases: list[dict[str, Any]], emulated: bool) -> None:
    info = init_rank(rank, world_size, out, emulated=emulated)
    from cpdpkit.emulator import meter

    with meter() if emulated else contextlib.nullcontext() as m:
        results = [_run_case(rank, world_size, case) for case in cases]
    finish_rank(rank, out, {"backend": info.backend, "cases": results, "op_counts": m.op_counts if m else {}})


def _train(model: nn.Module, rank: int) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own batch
    for _ in range(NUM_STEPS):
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 5, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of an FSDP2 model, unsharded (``full_tensor``), by name."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _run_case(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cpdpkit.planner import ShardingPlan
    from cpdpkit.shard import apply_plan

    plain = make_net()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    for block in plain.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    plain_losses = _train(plain, rank)

    plan = ShardingPlan.from_dict(case["plan"])
    planned = make_net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_plan(planned, plan)
    planned_losses = _train(planned, rank)
    return {
        "name": case["name"],
        "plain_losses": plain_losses, "plan_losses": planned_losses,
        "plain_params": full_params(plain), "plan_params": full_params(planned),
        "placements": {n: str(p.placements) for n, p in planned.named_parameters()},
        "mesh_shape": tuple(p.device_mesh.shape for p in planned.parameters())[0],
        "warnings": [str(w.category.__name__) for w in caught],
    }
