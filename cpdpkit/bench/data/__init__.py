"""Data sets for ``cpdpkit bench``: bundled digits, generated synthetic data, CIFAR-100 on disk.

Nothing is downloaded. ``digits`` is scikit-learn's bundled 8x8 handwritten digits;
``synthetic`` is generated from a seed; ``cifar100`` reads a copy already on disk in either
official layout: ``cifar-100-python/{train,test}`` (pickled dicts, read with an unpickler that
admits only numpy arrays and builtins) or ``cifar-100-binary/{train,test}.bin`` (fixed-size
records: coarse label, fine label, 3072 pixel bytes). ``tinyimagenet`` reads TinyImageNet (or any
ImageFolder) on disk: :mod:`cpdpkit.bench.data.image_folders`. ``stdlib-text`` is next-character
prediction on Python's own standard library (:mod:`cpdpkit.bench.data.text`). ``mnist1d`` is MNIST-1D
generated offline by the ``mnist1d`` package (:mod:`cpdpkit.bench.data.mnist1d`).

The train/test split is fixed (it never depends on the run's seed), so every strategy and
every seed sees the same held-out set.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import torch

from cpdpkit.bench.data.dataset import CIFAR_MEAN, CIFAR_STD, Dataset, check_dataset_packages
from cpdpkit.bench.data.image_folders import load_tiny_imagenet
from cpdpkit.bench.data.mnist1d import load_mnist1d
from cpdpkit.bench.data.text import load_stdlib_text
from cpdpkit.errors import ConfigError

__all__ = ["DATASETS", "Dataset", "load_dataset", "find_cifar100"]

DATASETS = ("digits", "synthetic", "cifar100", "tinyimagenet", "stdlib-text", "mnist1d")
_CIFAR_RECORD = 2 + 3072


def _split(name: str, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> Dataset:
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(12345))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    return Dataset(name, x[:cut], y[:cut], x[cut:], y[cut:], num_classes)


def _digits() -> Dataset:
    check_dataset_packages("digits")
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - 0.3) / 0.4
    return _split("digits", x, torch.tensor(data.target, dtype=torch.int64), 10)


def _synthetic(quick: bool) -> Dataset:
    """Ten Gaussian clusters around random 1x12x12 prototypes (learnable, not trivial)."""
    g = torch.Generator().manual_seed(2024)
    num = 1000 if quick else 4000
    prototypes = torch.randn(10, 1, 12, 12, generator=g)
    y = torch.randint(0, 10, (num,), generator=g)
    x = prototypes[y] + 1.5 * torch.randn(num, 1, 12, 12, generator=g)
    return _split("synthetic", x, y, 10)


class _ArrayUnpickler(pickle.Unpickler):
    """Admits only what CIFAR's pickles hold: builtins and numpy arrays."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("builtins", "dict"), ("builtins", "list"),
        ("_codecs", "encode"),  # how protocol-2 pickles spell bytes objects
    }

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR-100 file")
        return super().find_class(module, name)


def find_cifar100(data_dir: str | Path) -> tuple[str, Path]:
    """``(layout, folder)`` of a CIFAR-100 copy under ``data_dir``, or a ConfigError."""
    root = Path(data_dir)
    for folder in (root, root / "cifar-100-python", root / "cifar-100-binary"):
        if (folder / "train").is_file() and (folder / "test").is_file():
            return "python", folder
        if (folder / "train.bin").is_file() and (folder / "test.bin").is_file():
            return "binary", folder
    raise ConfigError(
        f"--data-dir {str(data_dir)!r} holds no CIFAR-100 (looked for cifar-100-python/train and "
        "cifar-100-binary/train.bin): extract cifar-100-python.tar.gz or cifar-100-binary.tar.gz there"
    )


def _read_python(path: Path) -> tuple[np.ndarray, np.ndarray]:
    def bad(problem: str) -> ConfigError:
        one_line = " ".join(problem.split())[:200]  # pickle's own messages may span lines
        return ConfigError(f"{path} is not a CIFAR-100 python file ({one_line}): re-extract it")

    with path.open("rb") as fh:
        raw = fh.read()
    try:
        entry = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # noqa: BLE001 - broken bytes make pickle raise almost anything (its docs say so)
        raise bad(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
    if not isinstance(entry, dict) or b"data" not in entry or b"fine_labels" not in entry:
        raise bad(f"a {type(entry).__name__} without the keys b'data' and b'fine_labels'")
    try:
        data, labels = np.asarray(entry[b"data"]), np.asarray(entry[b"fine_labels"])
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # ragged or deeply nested lists
        raise bad(f"{type(exc).__name__}: {exc}") from None
    if data.dtype.kind not in "iu" or data.size == 0 or data.size % 3072 or data.min() < 0 or data.max() > 255:
        raise bad(f"b'data' is {data.dtype} of shape {data.shape}, expected N x 3072 pixel bytes (N >= 1)")
    return data.astype(np.uint8, copy=False).reshape(-1, 3, 32, 32), _checked_labels(path, labels, data.size // 3072)


def _checked_labels(path: Path, labels: np.ndarray, num_images: int) -> np.ndarray:
    """CIFAR-100's fine labels: one integer in 0..99 per image (a bad one would only fail in training)."""
    if labels.dtype.kind not in "iu" or labels.shape != (num_images,) or labels.min() < 0 or labels.max() > 99:
        raise ConfigError(f"{path}: the fine labels are {labels.dtype} of shape {labels.shape}, expected "
                          f"{num_images} integers in 0..99 (one per image): re-extract it")
    return labels.astype(np.int64)


def _read_binary(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % _CIFAR_RECORD:
        raise ConfigError(
            f"{path} has {raw.size} bytes, not a multiple of CIFAR-100's {_CIFAR_RECORD}-byte "
            "records: re-extract it"
        )
    records = raw.reshape(-1, _CIFAR_RECORD)
    return records[:, 2:].reshape(-1, 3, 32, 32), _checked_labels(path, records[:, 1], len(records))


def _cifar100(data_dir: str | Path, quick: bool) -> Dataset:
    layout, folder = find_cifar100(data_dir)
    read = _read_python if layout == "python" else _read_binary
    sets = []
    for split in ("train", "test"):
        images, labels = read(folder / (split if layout == "python" else f"{split}.bin"))
        if quick:
            images, labels = images[:2000], labels[:2000]
        x = (images.astype(np.float32) / 255.0 - CIFAR_MEAN[:, None, None]) / CIFAR_STD[:, None, None]
        sets.append((torch.from_numpy(x), torch.from_numpy(labels)))
    (xtr, ytr), (xte, yte) = sets
    return Dataset("cifar100", xtr, ytr, xte, yte, 100)


def load_dataset(name: str, *, data_dir: str | Path | None = None, quick: bool = False) -> Dataset:
    """Load data set ``name`` (see module docstring)."""
    if name == "digits":
        return _digits()
    if name == "synthetic":
        return _synthetic(quick)
    if name == "cifar100":
        if data_dir is None:
            raise ConfigError("--dataset cifar100 needs --data-dir: the folder holding cifar-100-python/")
        return _cifar100(data_dir, quick)
    if name == "tinyimagenet":  # or any ImageFolder: cpdpkit.bench.data.image_folders
        return load_tiny_imagenet(data_dir, quick=quick)
    if name == "stdlib-text":  # next-character prediction on Python's stdlib: cpdpkit.bench.data.text
        return load_stdlib_text(quick=quick)
    if name == "mnist1d":  # generated offline (never downloaded), cached in data_dir: cpdpkit.bench.data.mnist1d
        return load_mnist1d(data_dir, quick=quick)
    raise ConfigError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
