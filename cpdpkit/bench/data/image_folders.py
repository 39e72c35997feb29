"""TinyImageNet (or any ImageFolder of RGB images) from disk, for ``cpdpkit bench --dataset tinyimagenet``.

Nothing is downloaded. ``--data-dir DIR`` is the folder holding ``tiny-imagenet-200/`` or that
folder itself, in one of two layouts:

* TinyImageNet's own: ``train/<wnid>/images/*.JPEG`` and ``val/images/*.JPEG`` labelled by
  ``val/val_annotations.txt`` (tab-separated: file name, wnid, box); ``test/`` has no labels and
  is not read. The validation set is the test set, as usual for TinyImageNet.
* a generic ImageFolder: ``train/<class>/*`` and ``val/<class>/*`` (files found recursively,
  torchvision's image extensions).

Classes are the sorted names of ``train/``'s sub-folders (torchvision's ImageFolder order), so
TinyImageNet's 200 wnids map to labels 0..199. Images are decoded with Pillow, converted to RGB
(TinyImageNet has some greyscale JPEGs), resized to 64x64 when they are not (bilinear), and
normalised with TinyImageNet's channel mean and std. The whole set is held in memory as float32,
like CIFAR-100: 100,000 training images take 4.9 GB per rank. Each split is held dealt
round-robin over the classes (so its first N images are balanced across classes), and ``quick``
keeps the first 2,000 of each and decodes only those.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from cpdpkit._text_file import read_text_file
from cpdpkit.bench.data.dataset import Dataset, check_dataset_packages
from cpdpkit.errors import ConfigError

__all__ = ["IMAGE_SIDE", "LAYOUTS", "TINY_IMAGENET_MEAN", "TINY_IMAGENET_STD", "find_tiny_imagenet",
           "load_tiny_imagenet"]

IMAGE_SIDE = 64
TINY_IMAGENET_MEAN = (0.4802, 0.4481, 0.3975)
TINY_IMAGENET_STD = (0.2302, 0.2265, 0.2262)
_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_QUICK_IMAGES = 2000
LAYOUTS = ("tiny-imagenet-200/train/<wnid>/images/*.JPEG with val/images/*.JPEG and val/val_annotations.txt, "
           "or an ImageFolder train/<class>/*, val/<class>/*")


def find_tiny_imagenet(data_dir: str | Path | None) -> tuple[str, Path]:
    """``(layout, folder)`` of TinyImageNet under ``data_dir`` (``"tiny-imagenet"`` or ``"imagefolder"``)."""
    if data_dir is None:
        raise ConfigError(f"--dataset tinyimagenet needs --data-dir: the folder holding {LAYOUTS}")
    root = Path(data_dir)
    for folder in (root / "tiny-imagenet-200", root):
        train, val = folder / "train", folder / "val"
        if not (train.is_dir() and val.is_dir()):
            continue
        if (val / "val_annotations.txt").is_file():
            return "tiny-imagenet", folder
        if any(p.is_dir() for p in val.iterdir()):
            return "imagefolder", folder
    raise ConfigError(f"--data-dir {str(data_dir)!r} holds no TinyImageNet (looked for {LAYOUTS}): extract "
                      "tiny-imagenet-200.zip there")


def _images_under(folder: Path) -> list[Path]:
    found = []
    for dirpath, _, names in os.walk(folder):
        found += [Path(dirpath) / n for n in names if n.lower().endswith(_EXTENSIONS)]
    return sorted(found)


def _train_files(folder: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    classes = sorted(p.name for p in (folder / "train").iterdir() if p.is_dir())
    if not classes:
        raise ConfigError(f"{folder / 'train'} has no class folders: expected train/<class>/ with images in each")
    files = []
    for label, name in enumerate(classes):
        images = _images_under(folder / "train" / name)
        if not images:
            raise ConfigError(f"{folder / 'train' / name} holds no images ({', '.join(_EXTENSIONS)}): "
                              "remove the folder or add its images")
        files += [(path, label) for path in images]
    return classes, files


def _val_files(folder: Path, layout: str, classes: list[str]) -> list[tuple[Path, int]]:
    index = {name: label for label, name in enumerate(classes)}
    val = folder / "val"
    if layout == "imagefolder":
        pairs = [(path, p.name) for p in sorted(val.iterdir()) if p.is_dir() for path in _images_under(p)]
    else:
        pairs = []
        for n, line in enumerate(_annotations(val / "val_annotations.txt").splitlines(), 1):
            fields = line.split("\t")
            if len(fields) < 2:
                if line.strip():
                    raise ConfigError(f"{val / 'val_annotations.txt'} line {n} is not 'file<TAB>wnid...': "
                                      "re-extract it")
                continue
            pairs.append((val / "images" / fields[0], fields[1]))
    files = []
    for path, name in pairs:
        if name not in index:
            raise ConfigError(f"{path} is labelled {name!r}, which is not a class of {folder / 'train'}: "
                              "the train and val folders must have the same classes")
        files.append((path, index[name]))
    if not files:
        raise ConfigError(f"{val} holds no labelled images: expected {LAYOUTS}")
    return files


def _annotations(path: Path) -> str:
    # TinyImageNet's val_annotations.txt is 10,000 lines (about 0.4 MB)
    return read_text_file(path, what="annotations file", max_bytes=64 << 20, error=ConfigError, fix="re-extract it")


def _balanced_first(files: list[tuple[Path, int]], limit: int) -> list[tuple[Path, int]]:
    """The first ``limit`` files dealt round-robin over the classes (each class's files in order)."""
    seen: dict[int, int] = {}
    ranked = []
    for path, label in files:
        ranked.append((seen.get(label, 0), label, path))
        seen[label] = seen.get(label, 0) + 1
    return [(path, label) for _, label, path in sorted(ranked)[:limit]]


def _decode(files: list[tuple[Path, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image, UnidentifiedImageError  # checked by load_tiny_imagenet

    pixels = np.empty((len(files), IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    for i, (path, _) in enumerate(files):
        try:
            with Image.open(path) as img:
                rgb = img.convert("RGB")
                if rgb.size != (IMAGE_SIDE, IMAGE_SIDE):
                    rgb = rgb.resize((IMAGE_SIDE, IMAGE_SIDE), Image.Resampling.BILINEAR)
                pixels[i] = np.asarray(rgb)
        # Pillow's documented errors for a broken or hostile file (a NUL in a listed name: ValueError)
        except (UnidentifiedImageError, OSError, ValueError, TypeError, SyntaxError, EOFError,
                Image.DecompressionBombError) as exc:
            why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise ConfigError(f"{path} is not a readable image ({why}): remove or re-extract it") from None
    mean = np.asarray(TINY_IMAGENET_MEAN, dtype=np.float32)
    std = np.asarray(TINY_IMAGENET_STD, dtype=np.float32)
    x = torch.empty(len(files), 3, IMAGE_SIDE, IMAGE_SIDE)
    for start in range(0, len(files), 4096):  # chunks: no second full-size float copy
        chunk = pixels[start : start + 4096].astype(np.float32) / 255.0
        x[start : start + 4096] = torch.from_numpy(((chunk - mean) / std).transpose(0, 3, 1, 2))
    return x, torch.tensor([label for _, label in files], dtype=torch.int64)


def load_tiny_imagenet(data_dir: str | Path | None, *, quick: bool = False) -> Dataset:
    """TinyImageNet (or an ImageFolder) under ``data_dir`` as a :class:`~cpdpkit.bench.data.Dataset`."""
    check_dataset_packages("tinyimagenet")  # pillow decodes the images: the extra to install, before any reading
    layout, folder = find_tiny_imagenet(data_dir)
    classes, train = _train_files(folder)
    val = _val_files(folder, layout, classes)
    limit = _QUICK_IMAGES if quick else max(len(train), len(val))
    train, val = _balanced_first(train, limit), _balanced_first(val, limit)
    (x_train, y_train), (x_test, y_test) = _decode(train), _decode(val)
    return Dataset("tinyimagenet", x_train, y_train, x_test, y_test, len(classes))
