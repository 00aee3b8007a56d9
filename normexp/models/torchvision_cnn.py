"""The BatchNorm networks of DyT's Table 16 (arXiv 2503.10622, App. "Replacing BN with DyT"): torchvision's
ResNet-50 (He et al., CVPR 2016, arXiv 1512.03385) and VGG19-BN (Simonyan & Zisserman, ICLR 2015, arXiv
1409.1556), on torchvision's ``ResNet`` / ``VGG`` classes.

A seed gives torchvision's weights and parameter counts (tested); the constructors expose what torchvision
fixes (widths, stem, pooled grid, classifier width), so the ``_micro`` members are the same code at CPU size.
Every ``BatchNorm2d`` is a ``channels_first`` norm slot (``norm=dyt`` is DyT per channel, as Table 16);
``block`` is the bottleneck index (ResNet) or the VGG stage, ``num_heads`` 32 (GroupNorm's groups, Wu & He
2018, arXiv 1803.08494) or its largest divisor of the channels. ``residual_scales`` is ``layer*.*.bn3``; VGG
has no residual branch, so ``norm=skipinit`` refuses it. VGG's conv stack, torchvision's ``features``, is
named ``convs`` here (``features`` is the contract's method), so its state-dict keys are ``convs.{k}.*``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck
from torchvision.models.resnet import ResNet as TorchvisionResNet
from torchvision.models.vgg import VGG as TorchvisionVGG

from .base import CLASSIFICATION, DENSE_FEATURES, Backbone, NormContext
from .registry import register_size

GROUPS = 32  # GroupNorm's group count in ResNet-50 (Wu & He 2018); the head count handed to each slot


def conv_heads(channels: int) -> int:
    """32, or the largest divisor of ``channels`` below it; at least 1."""
    return next(h for h in range(min(GROUPS, channels), 0, -1) if channels % h == 0)


def torchvision_init(model: nn.Module) -> None:
    """torchvision's initialisation after construction (``ResNet.__init__`` / ``VGG.__init__``)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.Linear) and isinstance(model, TorchvisionVGG):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.constant_(m.bias, 0)


class _ConvSlots(Backbone):
    """Each BatchNorm slot's channels and block, recorded at construction (they outlive the placement)."""

    serves = frozenset({CLASSIFICATION, DENSE_FEATURES})
    _slot_channels: dict[str, int]
    _slot_blocks: dict[str, int | None]

    def _record_slots(self) -> None:
        self._slot_channels = {n: m.num_features for n, m in self.named_modules()
                               if isinstance(m, nn.BatchNorm2d)}
        self._slot_blocks = {n: self._block_of(n) for n in self._slot_channels}

    def _block_of(self, name: str) -> int | None:
        raise NotImplementedError

    def norm_context(self, name: str) -> NormContext:
        slot = name
        while slot not in self._slot_channels and "." in slot:  # a normalizer's own child (bn's ``.bn``)
            slot = slot.rpartition(".")[0]
        if slot not in self._slot_channels:
            raise KeyError(f"{type(self).__name__} has no norm slot '{name}'")
        return {"block": self._slot_blocks[slot], "num_heads": conv_heads(self._slot_channels[slot]),
                "layout": None, "num_prefix_tokens": 0, "pooled": False}


class ResNet(TorchvisionResNet, _ConvSlots):
    """torchvision's ResNet with the backbone contract; ``widths`` and the stem are arguments."""

    def __init__(self, layers: Sequence[int] = (3, 4, 6, 3), block: str = "bottleneck",
                 widths: Sequence[int] = (64, 128, 256, 512), stem_width: int = 64, stem_kernel: int = 7,
                 stem_stride: int = 2, stem_pool: bool = True, num_classes: int = 1000, in_chans: int = 3,
                 img_size: int | tuple[int, int] = 224, zero_init_residual: bool = False) -> None:
        nn.Module.__init__(self)  # torchvision's __init__ with its fixed values as arguments, in its order
        blocks = {"bottleneck": Bottleneck, "basic": BasicBlock}
        if block not in blocks:
            raise ValueError(f"ResNet block '{block}': one of {sorted(blocks)}")
        block_cls = blocks[block]
        if len(layers) != 4 or len(widths) != 4:
            raise ValueError(f"ResNet has 4 stages: got layers {list(layers)}, widths {list(widths)}")
        self.img_size = img_size  # any input size runs (global average pooling); recorded only
        self._norm_layer = nn.BatchNorm2d
        self.inplanes, self.dilation, self.groups, self.base_width = stem_width, 1, 1, 64
        self.conv1 = nn.Conv2d(in_chans, stem_width, kernel_size=stem_kernel, stride=stem_stride,
                               padding=stem_kernel // 2, bias=False)
        self.bn1 = nn.BatchNorm2d(stem_width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1) if stem_pool else nn.Identity()
        self.layer1 = self._make_layer(block_cls, widths[0], layers[0])
        self.layer2 = self._make_layer(block_cls, widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(block_cls, widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(block_cls, widths[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * block_cls.expansion, num_classes)
        torchvision_init(self)
        if zero_init_residual:  # torchvision's option (off by default and in its reference recipe)
            last = "bn3" if block_cls is Bottleneck else "bn2"
            for m in self.modules():
                if isinstance(m, block_cls):
                    nn.init.constant_(getattr(m, last).weight, 0)

        # the branch's last op before the addition (see the module docstring)
        self.residual_scales = ("layer*.*.bn3",) if block_cls is Bottleneck else ("layer*.*.bn2",)
        self.feature_channels = [w * block_cls.expansion for w in widths]
        first = stem_stride * (2 if stem_pool else 1)
        self.feature_strides = [first * 2 ** i for i in range(4)]
        self.block_offsets = [sum(layers[:i]) for i in range(4)]
        self._record_slots()

    def _block_of(self, name: str) -> int | None:
        m = re.match(r"layer(\d)\.(\d+)\.", name)
        return self.block_offsets[int(m.group(1)) - 1] + int(m.group(2)) if m else None

    def get_classifier(self) -> nn.Module:
        """The classifier, as timm's models name it (Fixup starts it at zero)."""
        return self.fc

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        maps = []
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = stage(x)
            maps.append(x)
        return maps


def vgg_layers(cfg: Sequence[int | str], in_chans: int = 3) -> nn.Sequential:
    """torchvision's ``make_layers(cfg, batch_norm=True)`` with the input channels as an argument."""
    layers: list[nn.Module] = []
    channels = in_chans
    for v in cfg:
        if v == "M":
            layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
        else:
            layers += [nn.Conv2d(channels, int(v), kernel_size=3, padding=1), nn.BatchNorm2d(int(v)),
                       nn.ReLU(inplace=True)]
            channels = int(v)
    return nn.Sequential(*layers)


# torchvision's cfgs["E"] (VGG19: 2-2-4-4-4 convs)
VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M")


class VGG(TorchvisionVGG, _ConvSlots):
    """torchvision's VGG-BN with the backbone contract; the pooled grid and classifier width are arguments."""

    residual_scales = ()  # a plain stack: no residual branch
    config_options = ("in_chans", "dropout")

    def __init__(self, cfg: Sequence[int | str] = VGG19, pool_size: int = 7, hidden: int = 4096,
                 dropout: float = 0.5, num_classes: int = 1000, in_chans: int = 3,
                 img_size: int | tuple[int, int] = 224) -> None:
        nn.Module.__init__(self)  # torchvision's __init__ with its fixed values as arguments, in its order
        self.img_size = img_size  # any input size runs (adaptive pooling); recorded only
        self.convs = vgg_layers(cfg, in_chans)  # torchvision's ``features`` (see the module docstring)
        self.avgpool = nn.AdaptiveAvgPool2d((pool_size, pool_size))
        width = [v for v in cfg if v != "M"][-1]
        self.classifier = nn.Sequential(
            nn.Linear(width * pool_size * pool_size, hidden), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )
        torchvision_init(self)
        # the maps after the last four max pools
        pools, channels, stride = [], 0, 1
        for v in cfg:
            if v == "M":
                stride *= 2
                pools.append((channels, stride))
            else:
                channels = int(v)
        if len(pools) < 4:
            raise ValueError(f"VGG: features() reads the maps after the last four max pools; cfg has "
                             f"{len(pools)}")
        self.feature_channels = [c for c, _ in pools[-4:]]
        self.feature_strides = [s for _, s in pools[-4:]]
        self._stage_of = {}
        stage = 0
        for i, v in enumerate(self.convs):
            self._stage_of[i] = stage
            stage += isinstance(v, nn.MaxPool2d)
        self._record_slots()

    def _block_of(self, name: str) -> int | None:
        return self._stage_of[int(name.split(".")[1])]

    def get_classifier(self) -> nn.Module:
        """The classifier's last layer, as timm's models name it."""
        return self.classifier[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """torchvision's ``VGG.forward`` (its ``features`` is ``convs`` here)."""
        x = self.avgpool(self.convs(x))
        return self.classifier(torch.flatten(x, 1))

    def features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The maps after the last four max pools, NCHW, at ``feature_strides``."""
        maps = []
        for layer in self.convs:
            x = layer(x)
            if isinstance(layer, nn.MaxPool2d):
                maps.append(x)
        return maps[-4:]


for _name, _build, _settings, _doc in [
    ("resnet50", ResNet, {"layers": (3, 4, 6, 3)}, "ResNet-50."),
    ("resnet50_micro", ResNet, {"layers": (1, 1, 1, 1), "widths": (16, 32, 64, 128), "stem_width": 16,
                                "stem_kernel": 3, "stem_stride": 1, "stem_pool": False, "img_size": 16},
     "The CPU member: one bottleneck a stage, 16-128 wide, a 3x3 stride-1 stem without pooling."),
    ("vgg19_bn", VGG, {"cfg": VGG19}, "VGG-19 with BatchNorm."),
    ("vgg19_bn_micro", VGG, {"cfg": (16, "M", 32, "M", 64, 64, "M", 128, 128, "M"), "pool_size": 1,
                             "hidden": 128, "img_size": 16},
     "The CPU member: six convolutions, 128-wide head."),
]:
    register_size(_name, _build, _settings, _doc)
