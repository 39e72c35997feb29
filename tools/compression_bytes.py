"""Bytes per step and rank of localsgd, slowmo and cpdp K=4 with each codec, and cpdp-overlap K=4 in fragments.

Run: .venv/bin/python tools/compression_bytes.py (the tables of docs/results.md, issue 24; 2 gloo ranks, 40
steps). The counts are what PeriodicSyncOptimizer.stats counts: deterministic, independent of the machine's load.
``max/step`` is the largest payload one step sent (per rank).
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
CODECS = ("none", "bf16", "int8", "topk:0.02")
# (row label, strategy, codec, overlap_steps, fragments)
RUNS = ([(s, s, c, 0, 1) for s in ("localsgd", "slowmo", "cpdp") for c in CODECS]
        + [("cpdp-overlap", "cpdp", c, 3, f) for f in (1, 4) for c in ("none", "int8")])


def job(rank: int, world: int) -> list[tuple[str, str, int, float, int]]:
    out = []
    for label, strategy, codec, overlap, fragments in RUNS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 128))
        opt = PeriodicSyncOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model=model,
                                    strategy=strategy, period=4, compression=codec, overlap_steps=overlap,
                                    fragments=fragments, timeout_s=60)
        most = 0
        for n in range(1, STEPS + 1):
            before = opt.stats.bytes_sent
            g = torch.Generator().manual_seed(n * 7 + rank)
            opt.zero_grad()
            model(torch.randn(32, 64, generator=g)).square().mean().backward()
            opt.step()
            most = max(most, opt.stats.bytes_sent - before)
        out.append((label, codec, fragments, opt.stats.bytes_sent / STEPS, most))
    return out


if __name__ == "__main__":
    rows = run_ranks(job, 2, timeout_s=300)[0]
    base = {(label, f): (value, most) for label, codec, f, value, most in rows if codec == "none"}
    print("| strategy K=4 | codec | fragments | bytes/step/rank | × none | max/step | × none's (F=1) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, codec, fragments, value, most in rows:
        ref_value, _ = base[(label, fragments)]
        _, ref_most = base[(label, 1)]
        print(f"| {label} | {codec} | {fragments} | {value:,.0f} | {value / ref_value:.3f} | {most:,} | "
              f"{most / ref_most:.3f} |")
