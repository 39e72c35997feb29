"""Named settings of ``cpdpkit bench``: ``--preset paper`` is the CPDP paper's main setting.

A preset only changes defaults. Precedence, strongest first: an option given on the command line;
``--quick``'s reduced strategies, periods and epoch cap; the preset's ``--quick`` sizes (with
``--quick``); the preset's settings; :class:`~cpdpkit.bench.periodic.config.BenchConfig`'s defaults.

``paper`` (the abstract in ``shared/papers/cpdp-controlled-periodic-sync.txt``): ResNet-50 on
CIFAR-100 "in the main fixed learning-rate setting of 0.1", compared at K=2 and K=4 over a WAN
of 16.6 ms RTT (our ``wan`` topology), with ResNet-50/TinyImageNet as an additional experiment
(``--dataset tinyimagenet``). What the abstract does not state is taken from the common CIFAR
ResNet recipe: SGD momentum 0.9, 128 images per worker per step and random crop with 4 pixels of
padding plus horizontal flip (He et al. 2016), 200 epochs (the usual budget of PyTorch CIFAR
training scripts). The CIFAR stem (3x3 stride-1 first convolution, no max-pool) is that recipe's
ResNet-50 for 32x32 images; TinyImageNet's 64x64 images keep the same model. Weight decay, which
that recipe also uses (1e-4 to 5e-4), is not an option of the bench yet.

The data are never downloaded: the preset needs ``--data-dir``.

``mnist1d``: a workload where models overfit that fits this CPU (:mod:`cpdpkit.bench.data.mnist1d`):
MNIST-1D generated offline, its paper's 1-D CNN with shift augmentation, 4 emulated replicas split
over the two ``wan`` sites (2 per site), SGD momentum 0.9 at a fixed LR of 0.1, ``ddp``, ``localsgd``
and ``cpdp`` at K=4 over 3 seeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cpdpkit.errors import ConfigError

__all__ = ["PRESETS", "Preset", "apply_preset"]

# epochs of --preset mnist1d: training accuracy (unshifted) ~98 % and test accuracy flat by then
# (measured: docs/results.md, "MNIST-1D")
MNIST1D_EPOCHS = 100

_CIFAR100_LAYOUTS = ("cifar-100-python/{train,test} (python layout) or cifar-100-binary/{train,test}.bin "
                     "(binary layout)")
_DATA_NAMES = {"cifar100": "CIFAR-100", "tinyimagenet": "TinyImageNet"}


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Defaults for :class:`~cpdpkit.bench.periodic.config.BenchConfig`'s fields, and smaller ones for ``--quick``."""

    description: str
    settings: Mapping[str, Any]
    quick: Mapping[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "paper": Preset(
        description="the CPDP paper's main setting: ResNet-50 (CIFAR stem) on CIFAR-100 from --data-dir, LR 0.1 "
                    "fixed, momentum 0.9, 128 per worker, 200 epochs, crop+flip, K=2,4 over wan",
        settings={
            "model": "resnet50-cifar", "dataset": "cifar100", "lr": 0.1, "lr_schedule": "constant",
            "momentum": 0.9, "batch_size": 128, "epochs": 200, "periods": (2, 4), "topology": "wan",
            "augment": True,
        },
        # ResNet-50 on a CPU: about 0.2 s per image and step, so a smoke run needs very few images
        quick={"batch_size": 4, "max_images": 64},
    ),
    "mnist1d": Preset(
        description="a workload in the paper's regime on a CPU: MNIST-1D generated offline (4,000 train, 10,000 "
                    "test), the MNIST-1D paper's 1-D CNN with shift augmentation, 4 replicas over the two wan "
                    "sites, SGD momentum 0.9, LR 0.1 fixed, 32 per replica, ddp, localsgd and cpdp at K=4, 3 seeds",
        settings={
            "model": "cnn1d", "dataset": "mnist1d", "lr": 0.1, "lr_schedule": "constant", "momentum": 0.9,
            "batch_size": 32, "epochs": MNIST1D_EPOCHS, "periods": (4,), "topology": "wan", "world_size": 4,
            "augment": True, "strategies": ("ddp", "localsgd", "cpdp"), "seeds": 3,
        },
        quick={"epochs": 2, "seeds": 1},
    ),
}


def _missing_data_message(name: str, dataset: str) -> str:
    from cpdpkit.bench.data.image_folders import LAYOUTS

    layouts = _CIFAR100_LAYOUTS if dataset == "cifar100" else LAYOUTS
    return (f"--preset {name} reads {_DATA_NAMES[dataset]} from disk and downloads nothing: give --data-dir DIR, "
            f"the folder holding {layouts}")


def apply_preset(name: str, given: Mapping[str, Any], *, quick: bool) -> dict[str, Any]:
    """BenchConfig keyword arguments: preset ``name``'s settings (its ``--quick`` sizes too), ``given`` over them.

    ``given`` holds only the options the user gave. A ConfigError for an unknown preset, and for a
    data set read from disk without ``--data-dir``.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    args = {**preset.settings, **(preset.quick if quick else {}), **given}
    if args.get("dataset") in _DATA_NAMES and args.get("data_dir") is None:
        raise ConfigError(_missing_data_message(name, args["dataset"]))
    return args
