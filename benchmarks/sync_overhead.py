"""PeriodicSyncOptimizer's own cost: local-step overhead and one reconciliation vs the floor.

    python benchmarks/sync_overhead.py [--nproc 2] [--hidden 1024] [--repeats 30]

Launches itself under torch's launcher (torchrun --standalone, a free port) and prints one
JSON object:

* ``local_step``: median time of a local step (zero_grad, forward, backward, step) with the
  wrapper (``cpdp``, K large) and with the bare inner optimizer, interleaved trial by trial;
  goal: overhead <= 2 %.
* ``reconciliation``: the parameter averaging of a reconciliation (``average_parameters()``)
  against the physical floor, one flat all-reduce (SUM) of the same bytes; goal <= 1.1x. An
  average also needs a division pass over the bytes, which that floor skips, so the ratio to
  gloo's own averaging all-reduce (``ReduceOp.AVG``, a SUM then a division) is given too. Also,
  informative: the extra time of a whole reconciliation step over a local step, against
  flat all-reduces of its bytes (parameters; gradients too for cpdp, whose gradient
  all-reduce overlaps backward) -- this one also absorbs the ranks' compute skew.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GOAL_LOCAL_OVERHEAD = 0.02
GOAL_RECONCILE_RATIO = 1.1


def _model(hidden: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _step(model, opt, x, y) -> float:
    import torch

    start = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - start


def _local_overhead(args, x, y) -> dict:
    import torch

    from cpdpkit.sync import PeriodicSyncOptimizer

    bare_model, wrapped_model = _model(args.hidden), _model(args.hidden)
    bare = torch.optim.SGD(bare_model.parameters(), lr=0.01, momentum=0.9)
    wrapped = PeriodicSyncOptimizer(
        torch.optim.SGD(wrapped_model.parameters(), lr=0.01, momentum=0.9),
        model=wrapped_model, strategy="cpdp", period=10**9)
    for _ in range(3):
        _step(bare_model, bare, x, y), _step(wrapped_model, wrapped, x, y)
    t_bare, t_wrapped = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        t_bare.append(_step(bare_model, bare, x, y))
        t_wrapped.append(_step(wrapped_model, wrapped, x, y))
    b, w = statistics.median(t_bare), statistics.median(t_wrapped)
    return {"bare_step_s": b, "wrapped_step_s": w, "overhead": w / b - 1.0,
            "goal_overhead": GOAL_LOCAL_OVERHEAD, "meets_goal": w / b - 1.0 <= GOAL_LOCAL_OVERHEAD}


def _floor_s(num_bytes_list: list[int], repeats: int) -> float:
    import torch
    import torch.distributed as dist

    tensors = [torch.ones(n // 4) for n in num_bytes_list]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _reconcile_cost(args, strategy: str, x, y) -> dict:
    """Time the reconciliation alone (opt.average_parameters(), the averaging a localsgd
    reconciliation runs) against flat all-reduces of the same bytes, and the whole extra
    time of a reconciliation step over a local step (which also absorbs rank skew)."""
    import torch
    import torch.distributed as dist

    from cpdpkit.sync import PeriodicSyncOptimizer

    period = 2
    model = _model(args.hidden)
    opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                model=model, strategy=strategy, period=period)
    local, recon = [], []
    for n in range(1, 2 * args.repeats + 5):
        dist.barrier()
        t = _step(model, opt, x, y)
        if n > 4:
            (recon if n % period == 0 else local).append(t)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = torch.ones(param_bytes // 4)
    contenders = {
        "ours": opt.average_parameters,
        "floor_sum": lambda: dist.all_reduce(flat),
        "floor_avg": lambda: dist.all_reduce(flat, op=dist.ReduceOp.AVG),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for i in range(args.repeats + 5):  # interleaved, alternating order: noise hits all alike
        order = list(contenders.items())
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            t = timed(fn)
            if i >= 5:  # warm-up
                times[name].append(t)
    ours = statistics.median(times["ours"])
    floor_params = statistics.median(times["floor_sum"])
    floor_avg = statistics.median(times["floor_avg"])
    sets = [param_bytes, param_bytes] if strategy == "cpdp" else [param_bytes]
    floor_step = _floor_s(sets, args.repeats)
    extra = statistics.median(recon) - statistics.median(local)
    ratio = ours / floor_params
    return {"strategy": strategy, "param_bytes": param_bytes,
            "param_average_s": ours, "floor_s": floor_params, "ratio": ratio,
            "goal_ratio": GOAL_RECONCILE_RATIO, "meets_goal": ratio <= GOAL_RECONCILE_RATIO,
            "floor_avg_s": floor_avg, "ratio_vs_avg_floor": ours / floor_avg,
            "step": {"bytes": sum(sets), "local_step_s": statistics.median(local),
                     "reconcile_step_s": statistics.median(recon), "extra_s": extra,
                     "floor_s": floor_step, "ratio": extra / floor_step}}


def worker(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.manual_seed(1 + dist.get_rank())
    x, y = torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))
    result = {"world_size": dist.get_world_size(), "hidden": args.hidden,
              "param_bytes": sum(p.numel() * 4 for p in _model(args.hidden).parameters()),
              "local_step": _local_overhead(args, x, y),
              "reconciliation": [_reconcile_cost(args, s, x, y) for s in ("localsgd", "cpdp")]}
    if dist.get_rank() == 0:
        print(json.dumps(result, indent=2), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", __file__, "--worker", "--hidden", str(args.hidden),
           "--batch", str(args.batch), "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
