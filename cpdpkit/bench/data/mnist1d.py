"""MNIST-1D (Greydanus 2020) for ``cpdpkit bench --preset mnist1d``: generated offline, a 1-D CNN, shift.

The data come from the ``mnist1d`` package's ``make_dataset`` with its default generation arguments
(templates, padding, translation, noise, shear; seed 42) and a larger sample count: 4,000 training
and 10,000 test sequences of length 40 (``--quick``: 1,000 and 1,000), so one run's test accuracy
has a binomial standard error of at most 0.5 pp. ``get_dataset``, which downloads, is never called.
Generation takes ~10-20 s on a loaded 2-core machine, so the bench generates once per work folder
into ``<data_dir>/mnist1d-<train>-<test>-seed42.npz`` (written then renamed; read back with
``allow_pickle=False`` after a size check) and every rank reads that file. A run's ``dataset_info`` records
the arrays' sha256 and the versions of ``mnist1d``, numpy and scipy that generated them (:func:`data_digest`):
the same seed gives the same numbers only on the same data, and ``tests/test_bench_mnist1d.py`` checks the
generated data against recorded digests.

The model (:mod:`cpdpkit.bench.models.cnn1d`) is the MNIST-1D paper's CNN (its ``ConvBase``): three
1-D convolutions of 25 channels (kernel 5 stride 2, kernel 3 stride 2, kernel 3 stride 2, padding 1, ReLU)
and a linear layer from
25x5 to 10 classes (5,210 parameters). Shift augmentation (``--augment``) translates each training
sequence by a random offset in ``[-MAX_SHIFT, MAX_SHIFT]``, filling with zeros (the data's mean).
"""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from cpdpkit.bench.data.dataset import Dataset, check_dataset_packages
from cpdpkit.errors import ConfigError

__all__ = ["MAX_SHIFT", "MNIST1D_SIZES", "SEQUENCE_LENGTH", "check_mnist1d", "data_digest", "generator_versions",
           "load_mnist1d", "random_shift"]

MNIST1D_SIZES = {False: (4000, 10000), True: (1000, 1000)}  # (train, test) by --quick
MAX_SHIFT = 4
_SEED = 42
SEQUENCE_LENGTH = 40
_MAX_CACHE_BYTES = 64 * 1024 * 1024  # a cache holds (train + test) x 40 float32: ~2.2 MB at the sizes above


def check_mnist1d() -> None:
    """A ConfigError naming the fix when the ``mnist1d`` package is not installed (before any rank starts)."""
    check_dataset_packages("mnist1d")


def _generate(num_train: int, num_test: int) -> tuple[np.ndarray, ...]:
    check_mnist1d()
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.train_split, args.seed = num_train + num_test, num_train / (num_train + num_test), _SEED
    data = make_dataset(args)  # offline: templates in code, numpy draws from the seed
    return (data["x"].astype(np.float32), data["y"].astype(np.int64),
            data["x_test"].astype(np.float32), data["y_test"].astype(np.int64))


def generator_versions() -> dict[str, str]:
    """The versions of the packages whose code generates the data (``make_dataset``'s numpy draws, scipy's filters)."""
    return {name: metadata.version(name) for name in ("mnist1d", "numpy", "scipy")}


def data_digest(arrays: tuple[np.ndarray, ...]) -> str:
    """sha256 of ``(x, y, x_test, y_test)``'s bytes, in that order."""
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def _read(path: Path, num_train: int, num_test: int) -> tuple[np.ndarray, ...] | None:
    if path.stat().st_size > _MAX_CACHE_BYTES:
        raise ConfigError(f"{str(path)!r} is {path.stat().st_size} bytes, more than an MNIST-1D cache holds: "
                          "delete it and run again (it is regenerated)")
    with np.load(path, allow_pickle=False) as npz:
        arrays = tuple(npz[k] for k in ("x", "y", "x_test", "y_test"))
    shapes = [a.shape for a in arrays]
    if shapes != [(num_train, SEQUENCE_LENGTH), (num_train,), (num_test, SEQUENCE_LENGTH), (num_test,)]:
        raise ConfigError(f"{str(path)!r} holds arrays of shapes {shapes}, not MNIST-1D's: delete it and run again")
    return arrays


def load_mnist1d(data_dir: str | Path | None, *, quick: bool = False) -> Dataset:
    """MNIST-1D as (N, 1, 40) float32 sequences; cached in ``data_dir`` when given (module docstring)."""
    num_train, num_test = MNIST1D_SIZES[bool(quick)]
    cache = None if data_dir is None else Path(data_dir) / f"mnist1d-{num_train}-{num_test}-seed{_SEED}.npz"
    if cache is not None and cache.is_file():
        arrays = _read(cache, num_train, num_test)
    else:
        arrays = _generate(num_train, num_test)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp.npz")
            np.savez(tmp, x=arrays[0], y=arrays[1], x_test=arrays[2], y_test=arrays[3])
            os.replace(tmp, cache)
    x, y, x_test, y_test = (torch.from_numpy(a) for a in arrays)
    return Dataset("mnist1d", x.unsqueeze(1), y, x_test.unsqueeze(1), y_test, 10,
                   info={"generator": "mnist1d.make_dataset", "seed": _SEED, "train": num_train, "test": num_test,
                         "data_sha256": data_digest(arrays), "versions": generator_versions()})


def random_shift(x: torch.Tensor, generator: torch.Generator, *, max_shift: int = MAX_SHIFT) -> torch.Tensor:
    """Each (1, L) sequence of the batch ``x`` (N, 1, L) translated by a random offset, zero-filled (a new tensor)."""
    n, channels, length = x.shape
    offsets = torch.randint(-max_shift, max_shift + 1, (n,), generator=generator)
    src = torch.arange(length).view(1, length) - offsets.view(n, 1)  # out[i, :, j] = x[i, :, j - d_i]
    valid = ((src >= 0) & (src < length)).view(n, 1, length)
    index = src.clamp(0, length - 1).view(n, 1, length).expand(n, channels, length)
    return torch.where(valid, torch.gather(x, 2, index), torch.zeros((), dtype=x.dtype))
