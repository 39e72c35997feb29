"""Models for ``cpdpkit bench``: a small CNN, ResNet-50 with a CIFAR stem (ours), and torchvision's
ResNet-18/50 and ViT-S when installed; ``char-mlp`` for the ``stdlib-text`` data set (:mod:`cpdpkit.bench.data.text`);
``cnn1d``, the MNIST-1D paper's 1-D CNN, for ``mnist1d`` (:mod:`cpdpkit.bench.data.mnist1d`)."""

from __future__ import annotations

import importlib.util

from torch import nn

from cpdpkit.bench.models.char_mlp import CharMLP
from cpdpkit.bench.models.cnn1d import ConvBase1D
from cpdpkit.bench.models.resnet_cifar import resnet50_cifar
from cpdpkit.errors import ConfigError

__all__ = ["MODELS", "build_model", "check_model_available"]

MODELS = ("cnn", "resnet18", "resnet50", "vit-s", "resnet50-cifar", "char-mlp", "cnn1d")
_TORCHVISION = ("resnet18", "resnet50", "vit-s")


class SmallCNN(nn.Module):
    """Two 3x3 convolutions, a pooling and two linear layers; works on 8x8 to 32x32 inputs."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(),
                                  nn.Linear(64, num_classes))

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.head(self.features(x))


def check_model_available(name: str) -> None:
    """Raise a ConfigError for an unknown model or a torchvision model without torchvision."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    if name in _TORCHVISION and importlib.util.find_spec("torchvision") is None:
        raise ConfigError(
            f"model {name!r} needs torchvision, which is not installed: pip install torchvision "
            "(matching your torch), or use --model cnn"
        )


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    check_model_available(name)
    if (name == "char-mlp") != (len(input_shape) == 1):  # character ids are (T,), images (C, H, W)
        if name == "char-mlp":
            raise ConfigError(f"model 'char-mlp' reads character ids (--dataset stdlib-text), not inputs of "
                              f"shape {input_shape}: use --model cnn")
        raise ConfigError(f"model {name!r} needs images, but the data set holds character ids: use --model char-mlp")
    if name == "char-mlp":
        return CharMLP(input_shape[0], num_classes)
    if (name == "cnn1d") != (len(input_shape) == 2):  # 1-D sequences are (1, L), images (C, H, W)
        if name == "cnn1d":
            raise ConfigError(f"model 'cnn1d' reads 1-D sequences (--dataset mnist1d), not inputs of shape "
                              f"{input_shape}: use --model cnn")
        raise ConfigError(f"model {name!r} needs images, but the data set holds 1-D sequences: use --model cnn1d")
    if name == "cnn1d":
        return ConvBase1D(num_classes, length=input_shape[-1])
    channels = input_shape[0]
    if name == "cnn":
        return SmallCNN(channels, num_classes)
    if name == "resnet50-cifar":  # ours (cpdpkit.bench.models.resnet_cifar): no torchvision needed
        return resnet50_cifar(num_classes, in_channels=channels)
    import torchvision

    if name in ("resnet18", "resnet50"):
        model = getattr(torchvision.models, name)(num_classes=num_classes)
        if channels != 3:
            model.conv1 = nn.Conv2d(channels, 64, 7, 2, 3, bias=False)
        return model
    side = input_shape[-1]
    patch = 4 if side % 4 == 0 else 2
    vit = torchvision.models.VisionTransformer(  # ViT-S: 12 layers, 6 heads, width 384
        image_size=side, patch_size=patch, num_layers=12, num_heads=6, hidden_dim=384,
        mlp_dim=1536, num_classes=num_classes,
    )
    if channels != 3:
        vit.conv_proj = nn.Conv2d(channels, 384, patch, patch)
    return vit
