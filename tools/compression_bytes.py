"""Bytes per step and rank of localsgd, slowmo and cpdp K=4 with each codec (2 gloo ranks, 40 steps).

Run: .venv/bin/python tools/compression_bytes.py (the table of docs/results.md, issue 24). The counts are
what PeriodicSyncOptimizer.stats counts: deterministic, independent of the machine's load.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _ranks import run_ranks  # noqa: E402  (the one rank starter)
from cpdpkit.sync import PeriodicSyncOptimizer  # noqa: E402

STEPS = 40


def job(rank: int, world: int) -> dict[tuple[str, str], float]:
    out = {}
    for strategy in ("localsgd", "slowmo", "cpdp"):
        for codec in ("none", "bf16", "int8", "topk:0.02"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 128))
            opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model=model,
                                        strategy=strategy, period=4, compression=codec, timeout_s=60)
            for n in range(1, STEPS + 1):
                g = torch.Generator().manual_seed(n * 7 + rank)
                opt.zero_grad()
                model(torch.randn(32, 64, generator=g)).square().mean().backward()
                opt.step()
            out[(strategy, codec)] = opt.stats.bytes_sent / STEPS
    return out


if __name__ == "__main__":
    result = run_ranks(job, 2, timeout_s=300)[0]
    print("| strategy K=4 | codec | bytes/step/rank | × none |")
    print("|---|---|---:|---:|")
    for (strategy, codec), value in result.items():
        print(f"| {strategy} | {codec} | {value:,.0f} | {value / result[(strategy, 'none')]:.3f} |")
