"""Models train.py offers beside torchvision's: AlexNet with batch normalisation.

The large-batch ImageNet results GradientFlow compares itself with (You et al. 2017; Jia et al.
2018, batches of 32K-64K) trained AlexNet with batch normalisation in place of local response
normalisation: plain AlexNet does not train at those batch sizes even with LARS. torchvision's
`alexnet` has no normalisation at all, so `alexnet_bn` is torchvision's topology (same layer
shapes, 61 M weights) with a BatchNorm after every convolution and every hidden fully connected
layer, before its ReLU. Like torchvision's, it needs inputs of at least 63x63 pixels.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _conv(cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0) -> list:
    # No bias: the BatchNorm after it has its own shift.
    return [nn.Conv2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True)]


def _fc(cin: int, cout: int) -> list:
    return [nn.Linear(cin, cout, bias=False), nn.BatchNorm1d(cout), nn.ReLU(inplace=True)]


class AlexNetBN(nn.Module):
    """AlexNet (torchvision's layer shapes) with batch normalisation after each hidden layer."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = nn.Sequential(
            *_conv(3, 64, 11, 4, 2), nn.MaxPool2d(3, 2),
            *_conv(64, 192, 5, padding=2), nn.MaxPool2d(3, 2),
            *_conv(192, 384, 3, padding=1),
            *_conv(384, 256, 3, padding=1),
            *_conv(256, 256, 3, padding=1), nn.MaxPool2d(3, 2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), *_fc(256 * 6 * 6, 4096),
            nn.Dropout(dropout), *_fc(4096, 4096),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def alexnet_bn(num_classes: int = 1000) -> AlexNetBN:
    """AlexNet-BN, randomly initialised (PyTorch's default initialisation)."""
    return AlexNetBN(num_classes=num_classes)


# --arch names train.py resolves here before asking torchvision.
ARCHS = {"alexnet_bn": alexnet_bn}
