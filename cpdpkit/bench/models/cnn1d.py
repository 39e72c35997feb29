"""The MNIST-1D paper's 1-D CNN (``--model cnn1d``), for the ``mnist1d`` data set (:mod:`cpdpkit.bench.data.mnist1d`):
three strided 1-D convolutions of 25 channels and a linear head."""

from __future__ import annotations

from torch import nn

from cpdpkit.bench.data.mnist1d import SEQUENCE_LENGTH

__all__ = ["ConvBase1D"]


class ConvBase1D(nn.Module):
    """The MNIST-1D paper's CNN (module docstring)."""

    def __init__(self, num_classes: int = 10, channels: int = 25, length: int = SEQUENCE_LENGTH) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
        )
        out = length
        for kernel in (5, 3, 3):
            out = (out + 2 - kernel) // 2 + 1
        self.linear = nn.Linear(channels * out, num_classes)

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.linear(self.features(x).flatten(1))
