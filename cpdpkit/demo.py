"""A short data-parallel training run with PeriodicSyncOptimizer (``cpdpkit demo``).

Run under torch's launcher, one process per rank::

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m cpdpkit.demo \
        --strategy cpdp --period 4

Each rank trains a small MLP on its shard of scikit-learn's bundled handwritten digits,
then rank 0 prints the test accuracy and every rank's ``opt.stats`` as one JSON line
(``CPDPKIT_DEMO_RESULT {...}``) that ``cpdpkit demo`` turns into a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from cpdpkit.sync import STRATEGIES, PeriodicSyncOptimizer

__all__ = ["load_digits_split", "main"]

RESULT_TAG = "CPDPKIT_DEMO_RESULT"


def load_digits_split(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """scikit-learn's 8x8 digits (bundled, no download): 80 % train, 20 % test, in [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="cpdp")
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr, xte, yte = load_digits_split(args.seed)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = PeriodicSyncOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        model=model, strategy=args.strategy, period=args.period,
    )
    shard = torch.arange(rank, len(xtr), world)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch * world + rank)
        order = shard[torch.randperm(len(shard), generator=g)]
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i : i + args.batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
    wall_s = time.perf_counter() - start
    opt.average_parameters()  # one model to evaluate, whatever step training stopped at
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    row = {"rank": rank, "test_acc": acc, "wall_s": wall_s, **opt.stats.to_dict()}
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"{RESULT_TAG} " + json.dumps({"strategy": args.strategy, "period": args.period,
                                             "world_size": world, "ranks": rows}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
