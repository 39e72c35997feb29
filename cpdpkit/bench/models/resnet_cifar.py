"""ResNet-50 with a CIFAR stem: the CPDP paper's main model, written here so it needs no torchvision.

The bottleneck ResNet-50 of He et al. in torchvision's layout (v1.5: the stride sits on the 3x3
convolution of a block; the shortcut is a strided 1x1 convolution and a BatchNorm): stages of
[3, 4, 6, 3] bottleneck blocks of widths 64, 128, 256, 512 with expansion 4, so 2048 features
before the classifier. The stem is the usual one for 32x32 images: a 3x3 stride-1 convolution
and no max-pool (ImageNet's 7x7 stride-2 convolution and max-pool would leave a 1x1 map after
the third stage). With 100 classes it has 23,705,252 parameters: torchvision's
``resnet50(num_classes=100)`` has 23,712,932, and the 3x3 stem's conv1 has 1,728 instead of 9,408.
Initialisation follows torchvision (Kaiming-normal fan-out convolutions, BatchNorm weight 1 and
bias 0, torch's default for the classifier).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Bottleneck", "ResNetCifar", "resnet50_cifar"]

_RESNET50_BLOCKS = (3, 4, 6, 3)
_WIDTHS = (64, 128, 256, 512)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4; BatchNorm after each; identity or 1x1 shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNetCifar(nn.Module):
    """A bottleneck ResNet with a 3x3 stride-1 stem and no max-pool (see the module docstring)."""

    def __init__(self, blocks: tuple[int, ...] = _RESNET50_BLOCKS, *, num_classes: int = 100,
                 in_channels: int = 3) -> None:
        super().__init__()
        if len(blocks) != len(_WIDTHS) or any(n < 1 for n in blocks):
            raise ValueError(f"blocks must be {len(_WIDTHS)} counts >= 1 (ResNet-50: {_RESNET50_BLOCKS}), got {blocks}")
        self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        stages, channels = [], 64
        for i, (count, width) in enumerate(zip(blocks, _WIDTHS)):
            layer = []
            for j in range(count):
                layer.append(Bottleneck(channels, width, stride=2 if (i > 0 and j == 0) else 1))
                channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50_cifar(num_classes: int = 100, in_channels: int = 3) -> ResNetCifar:
    """ResNet-50 ([3, 4, 6, 3] bottlenecks) with the CIFAR stem; 23,705,252 parameters at 100 classes."""
    return ResNetCifar(_RESNET50_BLOCKS, num_classes=num_classes, in_channels=in_channels)
