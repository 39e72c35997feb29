"""A tiny script for tests/test_launch.py: a few emulated all-reduces, optionally a failing rank."""

import sys

import torch
import torch.distributed as dist

import cpdpkit

info = cpdpkit.init_distributed()
x = torch.ones(1024)
for _ in range(2):
    dist.all_reduce(x)
print(f"rank={info.rank} world={info.world_size} backend={info.backend} "
      f"topology={info.topology.name if info.topology else None} sum={x[0].item():g} args={sys.argv[1:]}")
if "--fail-rank" in sys.argv and info.rank == int(sys.argv[sys.argv.index("--fail-rank") + 1]):
    raise ValueError(f"rank {info.rank} was told to fail")
dist.destroy_process_group()
