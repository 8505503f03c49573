"""Models train.py offers beside torchvision's: AlexNet with batch normalisation, and the two
shapes of the Fashion-MNIST comparison (AlexNet-shaped and ResNet-shaped, sized for 2 cores).

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


class AlexNetShaped(nn.Module):
    """AlexNet's shape at 28x28: five convolutions (three max-pools), two wide hidden fully
    connected layers and the classifier, batch normalisation as in AlexNet-BN.

    What makes AlexNet AlexNet for communication is kept: almost every parameter sits in the
    fully connected layers (AlexNet: 58 of 61 M; here 97%), so its gradient is large against
    its compute and arrives in few, large tensors. The convolutions are narrow so that a step
    costs little compute on one core (README.md: how the sizes were chosen).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 16,
                 hidden: tuple = (2048, 1024), dropout: float = 0.5):
        super().__init__()
        w = width
        # AlexNet's strided first convolution and its two early pools bring 28x28 down to 3x3
        # before the three 3x3 convolutions, which then cost next to nothing.
        self.features = nn.Sequential(
            *_conv(in_channels, w, 5, 2, 2), nn.MaxPool2d(2),               # 28 -> 14 -> 7
            *_conv(w, 2 * w, 3, padding=1), nn.MaxPool2d(2),                # 7 -> 3
            *_conv(2 * w, 3 * w, 3, padding=1),
            *_conv(3 * w, 2 * w, 3, padding=1),
            *_conv(2 * w, 2 * w, 3, padding=1),
        )
        h1, h2 = hidden
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), *_fc(2 * w * 3 * 3, h1),
            nn.Dropout(dropout), *_fc(h1, h2),
            nn.Linear(h2, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def resnet_shaped(num_classes: int = 10, in_channels: int = 1, width: int = 16) -> nn.Module:
    """torchvision's ResNet-18 topology (its ResNet class and BasicBlock: 7x7 stride-2 stem,
    max-pool, four stages of two blocks, 1x1 projection shortcuts, average pool) with every
    stage `width / 64` as wide and an `in_channels` stem.

    What makes ResNet ResNet for communication is kept: 62 small tensors (convolutions and
    batch-norm pairs) and far more compute per parameter than AlexNet-shaped.
    """
    from torchvision.models.resnet import BasicBlock, ResNet

    # torchvision's ResNet builds 64-128-256-512 stages; it takes the stage widths from
    # `inplanes` and the block's expansion, so it is built full width and then narrowed by
    # rebuilding each stage with the same code at the narrower widths.
    model = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
    model.inplanes = width
    model.conv1 = nn.Conv2d(in_channels, width, 7, 2, 3, bias=False)
    model.bn1 = nn.BatchNorm2d(width)
    model.layer1 = model._make_layer(BasicBlock, width, 2)
    model.layer2 = model._make_layer(BasicBlock, 2 * width, 2, stride=2)
    model.layer3 = model._make_layer(BasicBlock, 4 * width, 2, stride=2)
    model.layer4 = model._make_layer(BasicBlock, 8 * width, 2, stride=2)
    model.fc = nn.Linear(8 * width, num_classes)
    for m in model.modules():  # torchvision's own initialisation, redone for the new layers
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return model


def alexnet_shaped(num_classes: int = 10, in_channels: int = 1) -> AlexNetShaped:
    """The Fashion-MNIST comparison's AlexNet-shaped model, randomly initialised."""
    return AlexNetShaped(num_classes=num_classes, in_channels=in_channels)


# --arch names train.py resolves here before asking torchvision. The shaped models take the
# data's channel count (`in_channels`); alexnet_bn is RGB ImageNet's.
ARCHS = {"alexnet_bn": alexnet_bn, "alexnet_shaped": alexnet_shaped,
         "resnet_shaped": resnet_shaped}
SHAPED = ("alexnet_shaped", "resnet_shaped")
