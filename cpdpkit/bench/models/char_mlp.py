"""``--model char-mlp``: the next-character model of the ``stdlib-text`` data set (:mod:`cpdpkit.bench.data.text`)."""

from __future__ import annotations

from torch import nn

__all__ = ["CharMLP"]


class CharMLP(nn.Module):
    """Embed each of the context's characters, then two hidden layers and a linear head."""

    def __init__(self, context_len: int, num_classes: int, *, embed_dim: int = 32, hidden: int = 256,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Embedding(num_classes, embed_dim)
        self.body = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout),
            nn.Linear(context_len * embed_dim, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU(),
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.head(self.body(self.embed(x)))
