"""A small training job that checkpoints, for tests/test_launch_restart.py and tests/test_checkpoint.py.

    cpdpkit launch --nproc-per-node 2 --max-restarts 1 tests/data/restart_train.py OUT [--kill-rank 1
        --kill-step 17] [--steps 60] [--every 8] [--setups ddp,localsgd,...] [--clean-first CLEAN]

Several setups train side by side, step by step (one job, one launch): each a tiny MLP with dropout
(draws from torch's global RNG) on data drawn from the global RNG too, so a resumed run only
matches if the checkpoint restored the RNG; each with its own optimizer and ``Checkpointer`` in
``OUT/ckpt/<setup>`` (period K=4 after 2 warm-up steps, so the checkpoints at multiples of 8 fall
mid-period, 2 steps after a reconciliation). With ``--kill-step S`` the rank ``--kill-rank``
SIGKILLs itself in step S (after the first setup's step) on the first attempt only
(``TORCHELASTIC_RESTART_COUNT == 0``); ``--kills R:S,R:S,...`` (benchmarks/kill_resume_soak.py) is
several kills, the i-th in attempt i (its steps increasing). Every rank writes ``OUT/final-rank<R>.pt``: per setup the
final parameters (local values) and the step it resumed from, and the restart count. With
``--clean-first CLEAN`` the first attempt's ranks (fresh processes) first train an uninterrupted run
into ``CLEAN`` (the reference, without a launch of its own), then ``OUT``'s run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SETUPS: dict[str, dict[str, Any] | None] = {
    "ddp": {"strategy": "ddp"},
    "localsgd": {"strategy": "localsgd", "warmup_steps": 2},
    "slowmo": {"strategy": "slowmo", "warmup_steps": 2},
    "cpdp": {"strategy": "cpdp", "warmup_steps": 2},
    "cpdp-overlap": {"strategy": "cpdp", "warmup_steps": 2, "overlap_steps": 3},
    "two-stage": None,  # TwoStageExecutor over a (replicate 2, shard 1) plan
}
PERIOD = 4


def make_model() -> nn.Module:
    torch.manual_seed(1234)  # the same start on every rank (the executor does not broadcast)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1),
                         nn.Sequential(nn.Linear(32, 32), nn.Tanh()), nn.Linear(32, 4))


def _two_stage(model: nn.Module) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from cpdpkit.planner import PlannerConfig, plan_sharding
    from cpdpkit.shard.executor import TwoStageExecutor

    config = PlannerConfig(param_dtype="float32", grad_dtype="float32", optim_state_bytes_per_param=8,
                           min_unit_bytes=1000)
    with torch.device("meta"):
        shape_only = make_model()
    plan = plan_sharding(shape_only, "wan", world_size=dist.get_world_size(), config=config)
    assert plan.mesh.shape == (dist.get_world_size(), 1) and plan.state_sharding.axis == "replicate", plan.mesh
    mesh = init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=("replicate", "shard"))
    return TwoStageExecutor(model, plan, lambda groups: torch.optim.AdamW(groups, lr=0.01), mesh=mesh)


def build(name: str) -> tuple[nn.Module, Any]:
    """``(model, optimizer or executor)`` of one setup."""
    from cpdpkit.sync import PeriodicSyncOptimizer

    model = make_model()
    options = SETUPS[name]
    if options is None:
        return model, _two_stage(model)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    period = None if options.get("strategy") == "ddp" else PERIOD  # ddp has no period
    return model, PeriodicSyncOptimizer(inner, model=model, period=period, **options)


def train_step(model: nn.Module, opt: Any) -> None:
    x, y = torch.randn(16, 8), torch.randn(16, 4)  # the global RNG: restored with the checkpoint
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def final_params(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    if hasattr(opt, "wait_exchanges"):
        opt.wait_exchanges()
    elif hasattr(opt, "flush"):
        opt.flush()
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


def run(out: Path, *, steps: int, every: int, setups: list[str],
        kills: tuple[tuple[int, int], ...] = ()) -> dict[str, Any]:
    """Train every setup to ``steps``, resuming each from its checkpoint folder; what this rank saw."""
    from cpdpkit.checkpoint import Checkpointer

    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_rank, kill_step = kills[restart] if restart < len(kills) else (None, None)  # attempt i: the i-th kill
    runs = []
    for name in setups:
        model, opt = build(name)
        runs.append((name, model, opt, Checkpointer(out / "ckpt" / name, every=every, timeout_s=60)))
    torch.manual_seed(1000 + rank)  # each rank its own data and dropout; restore() overwrites this
    starts = {name: ckpt.restore(model=model, optimizer=opt) for name, model, opt, ckpt in runs}
    assert len(set(starts.values())) == 1, starts
    for step in range(next(iter(starts.values())) + 1, steps + 1):
        for i, (_name, model, opt, ckpt) in enumerate(runs):
            train_step(model, opt)
            if step == kill_step and rank == kill_rank and i == 0:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.maybe_save(step, model=model, optimizer=opt)
    result = {"restart": restart, "starts": starts,
              "params": {name: final_params(model, opt) for name, model, opt, _ in runs}}
    print(f"rank {rank} attempt {restart} resumed from {starts} and trained to step {steps}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--kills", default="", help="RANK:STEP,...: attempt i kills RANK in STEP (i-th pair)")
    parser.add_argument("--clean-first", default=None,
                        help="on the first attempt, first train an uninterrupted run into this folder (its own "
                             "checkpoints and final-rank<R>.pt), then OUT's run; later attempts skip it")
    args = parser.parse_args()
    kills = tuple(tuple(int(n) for n in pair.split(":")) for pair in args.kills.split(",") if pair)
    if args.kill_step is not None:
        kills = ((args.kill_rank, args.kill_step), *kills)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if args.clean_first and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        clean = Path(args.clean_first)
        result = run(clean, steps=args.steps, every=args.every, setups=args.setups.split(","))
        torch.save(result, clean / f"final-rank{dist.get_rank()}.pt")
        dist.barrier()
    out = Path(args.out)
    result = run(out, steps=args.steps, every=args.every, setups=args.setups.split(","),
                 kills=kills)
    torch.save(result, out / f"final-rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
