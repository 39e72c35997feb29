"""The record every ``cpdpkit bench`` data set loads into (:mod:`cpdpkit.bench.data` and its loaders).

Its own module so that the loaders (``text``, ``image_folders``) and ``data``, which dispatches to
them, all import it and not each other.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import numpy as np
import torch

from cpdpkit.errors import ConfigError

__all__ = ["CIFAR_MEAN", "CIFAR_STD", "Dataset", "DATASET_PACKAGES", "check_dataset_packages"]

# the data sets that need a package beyond the core dependencies: (module, package, cpdpkit extra)
DATASET_PACKAGES = {"digits": ("sklearn", "scikit-learn", "data"), "tinyimagenet": ("PIL", "pillow", "data"),
                    "mnist1d": ("mnist1d", "mnist1d", "mnist1d")}


def check_dataset_packages(dataset: str) -> None:
    """A ConfigError naming the extra to install when ``dataset`` needs a package that is missing (one line,
    before any rank starts; the loaders call it too)."""
    if dataset not in DATASET_PACKAGES:
        return
    module, package, extra = DATASET_PACKAGES[dataset]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"--dataset {dataset} needs the {package} package, which is not installed: pip install "
                          f"'cpdpkit[{extra}]' (make setup installs it)")

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
