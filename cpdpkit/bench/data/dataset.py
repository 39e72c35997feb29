"""The record every ``cpdpkit bench`` data set loads into (:mod:`cpdpkit.bench.data` and its loaders).

Its own module so that the loaders (``text``, ``image_folders``) and ``data``, which dispatches to
them, all import it and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["CIFAR_MEAN", "CIFAR_STD", "Dataset"]

# per-channel statistics of CIFAR-100's training images (normalisation; augmentation pads with the mean)
CIFAR_MEAN = np.array([0.5071, 0.4865, 0.4409], dtype=np.float32)
CIFAR_STD = np.array([0.2673, 0.2564, 0.2762], dtype=np.float32)


@dataclass(frozen=True)
class Dataset:
    """Tensors of one data set, images as (N, C, H, W) float32 (text: (N, T) int64 character ids)
    and labels as int64; ``info`` says what it was built from (e.g. a corpus hash), for results."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    info: dict = field(default_factory=dict)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])
