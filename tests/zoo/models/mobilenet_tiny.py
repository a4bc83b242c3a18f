"""torchvision's MobileNetV2 structure, re-created small: inverted residuals with depthwise
convolutions, BatchNorm and `ReLU6(inplace=True)`."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([nn.ReLU6(inplace=True)] if act else []))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int = 4) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.conv = nn.Sequential(conv_bn(cin, hidden, 1), conv_bn(hidden, hidden, 3, stride, groups=hidden),
                                  conv_bn(hidden, cout, 1, act=False))

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 8, 3, 2), InvertedResidual(8, 8, 1), InvertedResidual(8, 16, 2),
                                      InvertedResidual(16, 16, 1))
        self.classifier = nn.Linear(16, 10)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def build_model():
    return MobileNet()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 3, 16, 16, generator=g),)


def example_target():
    return torch.arange(4) % 10


def loss_fn(output, target):
    return F.cross_entropy(output, target)
