"""The compute rate behind the sharding suite's planner input (``RANK_FLOPS_PER_S`` in
cpdpkit/bench/sharding/suite.py): gpt-tiny's forward, backward and AdamW step at the suite's batch
(4 sequences of 32 tokens) on one thread, as 6 x parameters x tokens FLOPs per step (the planner's
compute model). The suite runs 4 ranks on 2 cores, so a rank gets about half of the printed rate.

    python benchmarks/sharding_rank_flops.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cpdpkit.bench.models.gpt import TinyGPT, gpt_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = gpt_preset("gpt-tiny")
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    numel = sum(p.numel() for p in model.parameters())

    def step() -> None:
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(json.dumps({"params": numel, "tokens": x.numel(), "median_step_s": median,
                      "flops_per_s_one_thread": 6 * numel * x.numel() / median}))


if __name__ == "__main__":
    main()
