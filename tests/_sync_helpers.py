"""Helpers the compression and fragments tests share: the training loop on ``sync_reference``'s batches, the
largest difference of two parameter lists, and the reference quantisers (plain tensors, no cpdpkit code)."""

from __future__ import annotations

import math

import torch
from torch import nn

from sync_reference import batch

__all__ = ["train", "max_diff", "int8_reference", "topk_reference", "flat_grads"]


def train(opt: torch.optim.Optimizer, model: nn.Module, rank: int, steps: range) -> None:
    """Steps ``steps`` of MSE on rank ``rank``'s batches."""
    for n in steps:
        opt.zero_grad()
        x, y = batch(rank, n)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def int8_reference(p: torch.Tensor, block: int = 256) -> torch.Tensor:
    """What int8 with per-block scales max|p|/127 keeps of ``p`` (zero-padded to whole blocks)."""
    n = p.numel()
    padded = torch.cat([p, p.new_zeros(-n % block)]).view(-1, block)
    scale = padded.abs().max(dim=1, keepdim=True).values / 127.0
    q = torch.where(scale > 0, torch.round(padded / torch.where(scale > 0, scale, 1.0)), 0.0)
    return (q * scale).reshape(-1)[:n]


def topk_reference(p: torch.Tensor, frac: float) -> torch.Tensor:
    """What top-k (k = ⌈frac·n⌉ largest magnitudes, int8 values with one scale) keeps of ``p``."""
    k = math.ceil(frac * p.numel())
    idx = p.abs().argsort(descending=True)[:k]
    scale = p[idx].abs().max() / 127.0
    out = torch.zeros_like(p)
    out[idx] = torch.round(p[idx] / scale) * scale
    return out


def flat_grads(models: list[nn.Module], n: int, *, reverse: bool = False) -> list[torch.Tensor]:
    """Each simulated worker r's MSE gradient at step ``n`` on its batch, flattened in parameter order (``reverse``:
    in reverse order, DDP's bucket layout)."""
    out = []
    for r, model in enumerate(models):
        params = list(model.parameters())
        for p in params:
            p.grad = None
        x, y = batch(r, n)
        nn.functional.mse_loss(model(x), y).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in (reversed(params) if reverse else params)]))
    return out
