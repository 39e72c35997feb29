"""What ``cpdpkit bench``'s worker does to the data before a step: augmentation and a size cap.

Augmentation is the CIFAR family's standard one, as torchvision's ``RandomCrop(side, padding=4)``
followed by ``RandomHorizontalFlip()``: pad each image by 4 pixels of black, take a random
``side x side`` window (offsets 0..8 in each direction, uniform), and mirror it left-right with
probability 1/2. The batches hold normalised images, so "black" is each channel's
``(0 - mean) / std`` for the data sets whose normalisation is known (CIFAR-100, TinyImageNet) and
0 (the mean) for the others. Only training batches are augmented, never the test set.
``mnist1d``'s 1-D sequences get a random shift instead (:func:`cpdpkit.bench.data.mnist1d.random_shift`).

The random draws come from a generator seeded by (run seed, epoch, rank) alone, so a run is
reproducible, every rank draws differently, and every strategy of one seed sees the same
augmented batches at the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cpdpkit.bench.data.dataset import CIFAR_MEAN, CIFAR_STD, Dataset
from cpdpkit.bench.data.image_folders import TINY_IMAGENET_MEAN, TINY_IMAGENET_STD
from cpdpkit.bench.data.mnist1d import random_shift

__all__ = ["CROP_PADDING", "IMAGE_DATASETS", "augment_generator", "black_fill", "epoch_augmenter", "first_images",
           "random_crop_flip"]

CROP_PADDING = 4
IMAGE_DATASETS = ("digits", "synthetic", "cifar100", "tinyimagenet")  # the data sets of (N, C, H, W) images
_AUGMENT_STREAM = 0x617567  # keeps these draws apart from any other stream seeded by (seed, epoch)
_NORMALISATION = {"cifar100": (CIFAR_MEAN, CIFAR_STD), "tinyimagenet": (TINY_IMAGENET_MEAN, TINY_IMAGENET_STD)}


def black_fill(dataset: str, channels: int) -> torch.Tensor:
    """Per-channel value of a black pixel after ``dataset``'s normalisation (0 where it is unknown)."""
    if dataset in _NORMALISATION:
        mean, std = (np.asarray(v, dtype=np.float32) for v in _NORMALISATION[dataset])
        if len(mean) == channels:
            return torch.from_numpy(-mean / std)
    return torch.zeros(channels)


def augment_generator(seed: int, epoch: int, rank: int) -> torch.Generator:
    """The generator of one rank's augmentation draws in one epoch of one seed's run."""
    state = np.random.SeedSequence([_AUGMENT_STREAM, seed, epoch, rank]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, *, padding: int = CROP_PADDING,
                     fill: torch.Tensor | None = None) -> torch.Tensor:
    """Random crop with ``padding`` (filled with ``fill`` per channel) and horizontal flip of a batch.

    ``x`` is (N, C, H, W); the result has the same shape and is a new tensor.
    """
    n, c, h, w = x.shape
    padded = torch.empty(n, c, h + 2 * padding, w + 2 * padding, dtype=x.dtype)
    padded[:] = (torch.zeros(c) if fill is None else fill).to(x.dtype).view(1, c, 1, 1)
    padded[:, :, padding : padding + h, padding : padding + w] = x
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator).tolist()
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator).tolist()
    flip = (torch.rand(n, generator=generator) < 0.5).tolist()
    out = torch.empty_like(x)
    for i in range(n):  # per-image slices: faster on a CPU than one gather with index tensors
        crop = padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
        out[i] = crop.flip(2) if flip[i] else crop
    return out


def epoch_augmenter(spec: Any, epoch: int, rank: int, channels: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The training-batch transform of one rank in one epoch of the run ``spec``; None without augmentation."""
    if not getattr(spec, "augment", False):
        return None
    generator = augment_generator(spec.seed, epoch, rank)
    if spec.dataset == "mnist1d":  # 1-D sequences: the MNIST-1D shift (cpdpkit.bench.data.mnist1d)
        return lambda x: random_shift(x, generator)
    fill = black_fill(spec.dataset, channels)
    return lambda x: random_crop_flip(x, generator, fill=fill)


def first_images(data: Dataset, max_images: int | None) -> Dataset:
    """``data`` with at most ``max_images`` training and ``max_images`` test images (the first ones)."""
    if max_images is None:
        return data
    return dataclasses.replace(data, x_train=data.x_train[:max_images], y_train=data.y_train[:max_images],
                               x_test=data.x_test[:max_images], y_test=data.y_test[:max_images])
