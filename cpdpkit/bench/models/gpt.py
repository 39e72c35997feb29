"""A small GPT-style language model and generated token data for ``cpdpkit bench sharding``.

Plain ``torch.nn``: token + position embeddings, ``num_layers`` pre-norm blocks (causal
multi-head self-attention, 4x GELU MLP) in ``blocks`` (a ``ModuleList``, so the planner sees
each block as a unit), a final norm and an untied output head. Sizes are presets small enough
for a few CPU cores (:data:`GPT_PRESETS`).

The data is generated from a seed: a random first-order Markov chain over the vocabulary
(each token has a few likely successors), so the loss can fall below ``log(vocab)``. Step
``i``'s global batch is a function of ``(seed, i)`` only; rank ``r`` takes rows
``[r·B, (r+1)·B)``, so every strategy sees exactly the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cpdpkit.errors import ConfigError

__all__ = ["GPTConfig", "GPT_PRESETS", "TinyGPT", "gpt_preset", "token_batch"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ConfigError(f"d_model {self.d_model} must be a multiple of num_heads {self.num_heads}")

    @property
    def num_params(self) -> int:
        d, v = self.d_model, self.vocab_size
        block = 4 * d * d + 4 * d + 8 * d * d + 5 * d + 4 * d  # attn (qkv+proj), mlp, 2 norms
        return 2 * v * d + self.seq_len * d + self.num_layers * block + 2 * d


GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(d_model=128, num_heads=4, num_layers=4),  # ~0.86 M parameters
    "gpt-small": GPTConfig(d_model=192, num_heads=6, num_layers=6),  # ~2.8 M parameters
    "gpt-micro": GPTConfig(d_model=64, num_heads=4, num_layers=2, seq_len=16),  # ~0.13 M (tests)
}


def gpt_preset(name: str) -> GPTConfig:
    if name not in GPT_PRESETS:
        raise ConfigError(f"unknown model {name!r} for cpdpkit bench sharding: choose one of {', '.join(GPT_PRESETS)}")
    return GPT_PRESETS[name]


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _transitions(cfg: GPTConfig, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * seed + 1)
    logits = torch.randn(cfg.vocab_size, cfg.vocab_size, generator=g) * 3.0
    return torch.softmax(logits, dim=1)


def token_batch(cfg: GPTConfig, *, seed: int, step: int, global_batch: int, rank: int,
                batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(inputs, targets)`` of step ``step`` (each ``(batch_size, seq_len)`` int64)."""
    probs = _transitions(cfg, seed)
    g = torch.Generator().manual_seed(1_000_003 * seed + step)
    seqs = torch.empty(global_batch, cfg.seq_len + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(cfg.vocab_size, (global_batch,), generator=g)
    for t in range(1, cfg.seq_len + 1):
        seqs[:, t] = torch.multinomial(probs[seqs[:, t - 1]], 1, generator=g).squeeze(1)
    rows = seqs[rank * batch_size:(rank + 1) * batch_size]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

