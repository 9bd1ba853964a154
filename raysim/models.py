"""Model zoo (the building blocks, Dropout and SplitModel, are in :mod:`raysim.layers`; user models are adapted by
:mod:`raysim.adapt`). Every model is ``body`` (feature extractor -> embedding of size ``embed_dim``) + ``head``
(classifier on the embedding), so prototype methods (embedding), FedPer / LG-FedAvg (body vs head split) and
heterogeneous clients (different bodies, one embedding size) share one interface:

    logits, z = model(x, return_embedding=True)
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn as nn

from raysim.adapt import build_user_model, resolve_factory
from raysim.config import ArchSpec, ModelConfig
from raysim.errors import ConfigError
from raysim.layers import (Dropout, SplitModel, dropout_masks_of, num_parameters, replay_masks,
                           set_dropout_generator)
from raysim.config.registry import MODELS
from raysim import modelstate as _modelstate

# a live model's weights in and out without nn.Module's generic state-dict code (raysim.modelstate; methods use them)
live_state, load_live = _modelstate.live_state, _modelstate.load_live


def cnn_mnist_body(in_channels: int, out_channels: int, embed_dim: int, input_hw: int,
                   conv_dropout: float = 0.5) -> nn.Sequential:
    """FedProto's CNNMnist feature extractor (official ``lib/models/models.py``): conv 1->10 k5, pool, relu;
    conv 10->oc k5, dropout2d, pool, relu; fc -> embed_dim, relu (the prototype, taken before dropout). Standard
    layers in a Sequential (no forward of its own), so every executor — the loop, vmap, the grouped form — runs
    the same layers; the parameters keep their names (conv1, conv2, fc1)."""
    from collections import OrderedDict

    side = ((input_hw - 4) // 2 - 4) // 2
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(in_channels, 10, kernel_size=5)), ("pool1", nn.MaxPool2d(2)), ("relu1", nn.ReLU()),
        ("conv2", nn.Conv2d(10, out_channels, kernel_size=5)), ("drop", Dropout(conv_dropout, channelwise=True)),
        ("pool2", nn.MaxPool2d(2)), ("relu2", nn.ReLU()), ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(out_channels * side * side, embed_dim)), ("relu3", nn.ReLU())]))


def cnn_mnist(input_shape, num_classes, out_channels: int = 20, embed_dim: int = 50, dropout: float = 0.5,
              conv_dropout: float = 0.5) -> SplitModel:
    """``dropout``: the head's dropout; ``conv_dropout``: the Dropout2d after conv2 (both FedProto's 0.5)."""
    if input_shape[-1] < 16:
        raise ConfigError("model.arch", f"cnn_mnist needs images of at least 16x16, got {tuple(input_shape)}; use mlp or cnn_small")
    for name, p in (("dropout", dropout), ("conv_dropout", conv_dropout)):
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"model.params.{name}", f"must be in [0, 1), got {p}")
    body = cnn_mnist_body(input_shape[0], out_channels, embed_dim, input_shape[-1], conv_dropout)
    return SplitModel(body, nn.Sequential(Dropout(dropout), nn.Linear(embed_dim, num_classes)), embed_dim)


def mlp(input_shape, num_classes, hidden: int = 64, embed_dim: int = 32) -> SplitModel:
    d = 1
    for s in input_shape:
        d *= s
    body = nn.Sequential(nn.Flatten(), nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim), nn.ReLU())
    return SplitModel(body, nn.Linear(embed_dim, num_classes), embed_dim)


def cnn_small(input_shape, num_classes, channels: int = 16, embed_dim: int = 32) -> SplitModel:
    """A two-conv CNN for small images (8x8 digits, synthetic)."""
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(channels * 4, embed_dim), nn.ReLU())
    return SplitModel(body, nn.Linear(embed_dim, num_classes), embed_dim)


# -- heterogeneous zoo for 1x28x28 (any small image): four genuinely different feature extractors, one embedding
# size (default 50, FedProto's), and one head structure (Dropout -> Linear, as cnn_mnist's), so prototype methods and
# LG-FedAvg (which averages heads) work across the zoo. The HtFE idea of FedTGP (Zhang et al., AAAI 2024) at MNIST
# scale: a plain CNN, a residual net, an inverted-residual (MobileNetV2-style) net, and FedProto's CNN.

def _zoo_head(embed_dim: int, num_classes: int, dropout: float) -> nn.Module:
    return nn.Sequential(Dropout(dropout), nn.Linear(embed_dim, num_classes))


def cnn4(input_shape, num_classes, channels: int = 32, hidden: int = 256, embed_dim: int = 50,
         dropout: float = 0.0) -> SplitModel:
    """The 4-layer CNN of FedAvg / HtFLlib ("FedAvgCNN": conv5-pool, conv5-pool, fc, fc), narrowed for CPUs:
    conv in->c k5, ReLU, pool; conv c->2c k5, ReLU, pool; fc -> hidden, ReLU; fc -> embed_dim, ReLU (the embedding)."""
    side = input_shape[-1]
    if side < 12:
        raise ConfigError("model.arch", f"cnn4 needs images of at least 12x12, got {tuple(input_shape)}")
    out_side = ((side - 4) // 2 - 4) // 2
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], channels, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(2 * channels * out_side * out_side, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim), nn.ReLU())
    return SplitModel(body, _zoo_head(embed_dim, num_classes, dropout), embed_dim)


def resnet_small(input_shape, num_classes, width: int = 16, blocks: int = 1, embed_dim: int = 50,
                 dropout: float = 0.0) -> SplitModel:
    """A small ResNet built from torchvision's ``BasicBlock`` (ResNet-18's block), adapted to 28x28 inputs the usual
    CIFAR way: a 3x3 stem without max-pool, three stages of ``blocks`` blocks at widths w, 2w, 4w (strides 1, 2, 2),
    global average pooling, then fc -> embed_dim, ReLU."""
    from torchvision.models.resnet import BasicBlock

    layers: list[nn.Module] = [nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    inplanes = width
    for i, planes in enumerate((width, 2 * width, 4 * width)):
        for b in range(blocks):
            stride = 2 if (i > 0 and b == 0) else 1
            down = None
            if stride != 1 or inplanes != planes:
                down = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))
            layers.append(BasicBlock(inplanes, planes, stride=stride, downsample=down))
            inplanes = planes
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, embed_dim), nn.ReLU()]
    return SplitModel(nn.Sequential(*layers), _zoo_head(embed_dim, num_classes, dropout), embed_dim)


def mobilenet_small(input_shape, num_classes, width: int = 16, expand: int = 4, embed_dim: int = 50,
                    dropout: float = 0.0) -> SplitModel:
    """A MobileNetV2-style net from torchvision's ``InvertedResidual`` blocks (1x1 expand, 3x3 depthwise, 1x1 linear
    projection, residual where shapes allow): stem 3x3 stride 2 -> w (as MobileNetV2's); blocks (w, s1), (1.5w, s2), (1.5w, s1), (2w, s2),
    (2w, s1); 1x1 conv -> 4w; global average pooling; fc -> embed_dim, ReLU."""
    from torchvision.models.mobilenetv2 import InvertedResidual

    w1, w2 = int(1.5 * width), 2 * width
    layers: list[nn.Module] = [nn.Conv2d(input_shape[0], width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU6()]
    cin = width
    for cout, stride in ((width, 1), (w1, 2), (w1, 1), (w2, 2), (w2, 1)):
        layers.append(InvertedResidual(cin, cout, stride, expand))
        cin = cout
    layers += [nn.Conv2d(cin, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width), nn.ReLU6(),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, embed_dim), nn.ReLU()]
    return SplitModel(nn.Sequential(*layers), _zoo_head(embed_dim, num_classes, dropout), embed_dim)


def fedavg_cnn(input_shape, num_classes, embed_dim: int = 512) -> SplitModel:
    """PFLlib's / HtFLlib's ``FedAvgCNN`` at full width (for 1x28x28: ``dim=1024``): conv in->32 k5, ReLU, max-pool 2;
    conv 32->64 k5, ReLU, max-pool 2; fc 64*4*4=1024 -> 512, ReLU (the embedding); head: a bare Linear 512 -> C."""
    side = input_shape[-1]
    if side < 12 or input_shape[-2] < 12:
        raise ConfigError("model.arch", f"fedavg_cnn needs images of at least 12x12, got {tuple(input_shape)}")
    oh, ow = (((input_shape[-2] - 4) // 2 - 4) // 2), (((side - 4) // 2 - 4) // 2)
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64 * oh * ow, embed_dim), nn.ReLU())
    return SplitModel(body, nn.Linear(embed_dim, num_classes), embed_dim)


def mlp1(input_shape, num_classes, hidden: int = 200) -> SplitModel:
    """IFCA's Rotated-MNIST model (Ghosh et al. 2020, official ``mnist/train_cluster_mnist.py``): 784-200-10 with one
    ReLU hidden layer; the embedding is the hidden layer."""
    d = 1
    for s in input_shape:
        d *= s
    body = nn.Sequential(nn.Flatten(), nn.Linear(d, hidden), nn.ReLU())
    return SplitModel(body, nn.Linear(hidden, num_classes), hidden)


def protonet(input_shape, num_classes, channels: int = 32, hidden: int = 128, embed_dim: int = 64) -> SplitModel:
    """The PN-ICFL seed's prototypical network, "3 conv + 2 fc" (layer widths are not given there; ours are chosen
    small for CPUs): three conv3x3(pad 1)-ReLU-maxpool2 blocks, fc -> hidden, ReLU, fc -> embed_dim (the embedding
    f_theta(x), no ReLU: prototypes live in R^d as in Snell et al.). The head (one linear layer) is what the seed adds
    for the end-to-end baselines; PN-ICFL never uses it."""
    h, w = input_shape[-2], input_shape[-1]
    for _ in range(3):
        h, w = h // 2, w // 2
    if h < 1 or w < 1:
        raise ConfigError("model.arch", f"protonet needs images of at least 8x8, got {tuple(input_shape)}")
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(channels * h * w, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim))
    return SplitModel(body, nn.Linear(embed_dim, num_classes), embed_dim)


def lenet(input_shape, num_classes, embed_dim: int = 84) -> SplitModel:
    """LeNet-5 (LeCun et al. 1998), as MAFML's seed deploys it on Rotated MNIST: conv 1->6 k5 (padding 2 for 28x28,
    so the classic 32x32 geometry), relu, max-pool 2; conv 6->16 k5, relu, max-pool 2; fc 400->120, relu;
    fc 120->embed_dim (84), relu (the embedding); head fc embed_dim->classes. 61,706 parameters at 28x28, 10 classes."""
    if input_shape[-1] < 12:
        raise ConfigError("model.arch", f"lenet needs images of at least 12x12, got {tuple(input_shape)}")
    pad = 2 if input_shape[-1] == 28 else 0
    h, w = input_shape[-2] + 2 * pad, input_shape[-1] + 2 * pad
    oh, ow = ((h - 4) // 2 - 4) // 2, ((w - 4) // 2 - 4) // 2
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], 6, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(16 * oh * ow, 120), nn.ReLU(), nn.Linear(120, embed_dim), nn.ReLU())
    return SplitModel(body, nn.Linear(embed_dim, num_classes), embed_dim)


# -- the ImageNet-size networks of MAFML's PACS experiment (seed 003, Table 2: ResNet18, ResNet34, AlexNet, VGG11 on
# 3 x 224 x 224). The layer structure is torchvision's (``torchvision.models.resnet18`` etc., random init as
# torchvision's ``weights=None``), given the engine's body/head split: the body ends in the embedding (the pooled
# features for ResNets, the second 4096-wide hidden layer for AlexNet and VGG), the head is the final Linear. The
# parameter names match torchvision's under ``body.`` (``fc`` / ``classifier.6`` is ``head``), so a user with local
# torchvision weights can map them across. Dropout is :class:`Dropout` (per-client generators). Widths are parameters
# only so tests can build small copies; the defaults are torchvision's.

def _min_side(input_shape, side: int, arch: str) -> None:
    if min(input_shape[-2], input_shape[-1]) < side:
        raise ConfigError("model.arch", f"{arch} needs images of at least {side}x{side}, got {tuple(input_shape)} "
                                        f"(for PACS: data.dataset_params.size >= {side})")


class _ResNetBody(nn.Module):
    """torchvision's ResNet up to its global average pooling (no ``fc``): stem conv 7x7 stride 2 + BN + ReLU +
    max-pool 3x3 stride 2, four stages of ``BasicBlock`` at widths w, 2w, 4w, 8w (strides 1, 2, 2, 2), pooled and
    flattened to 8w features."""

    def __init__(self, in_channels: int, blocks: tuple, width: int):
        from torchvision.models.resnet import BasicBlock

        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = width
        for k, (n, planes) in enumerate(zip(blocks, (width, 2 * width, 4 * width, 8 * width))):
            stride = 1 if k == 0 else 2
            layers = []
            for b in range(n):
                down = None
                if b == 0 and (stride != 1 or inplanes != planes):
                    down = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(planes))
                layers.append(BasicBlock(inplanes, planes, stride=stride if b == 0 else 1, downsample=down))
                inplanes = planes
            setattr(self, f"layer{k + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)


def _resnet(input_shape, num_classes, blocks, width) -> SplitModel:
    if width < 1:
        raise ConfigError("model.params.width", f"must be >= 1, got {width}")
    body = _ResNetBody(input_shape[0], blocks, width)
    return SplitModel(body, nn.Linear(8 * width, num_classes), 8 * width)


def resnet18(input_shape, num_classes, width: int = 64) -> SplitModel:
    """ResNet-18 (He et al. 2016) as torchvision builds it: [2, 2, 2, 2] basic blocks; embedding = the 512 pooled
    features (8 x ``width``), head = fc. 11,180,103 parameters for 7 classes."""
    return _resnet(input_shape, num_classes, (2, 2, 2, 2), width)


def resnet34(input_shape, num_classes, width: int = 64) -> SplitModel:
    """ResNet-34 as torchvision builds it: [3, 4, 6, 3] basic blocks; embedding = the 512 pooled features."""
    return _resnet(input_shape, num_classes, (3, 4, 6, 3), width)


class _ConvBody(nn.Module):
    """``features`` -> adaptive average pooling -> flatten -> ``classifier`` (the hidden layers, up to the
    embedding): torchvision's AlexNet / VGG minus the final Linear."""

    def __init__(self, features: nn.Module, pool: int, classifier: nn.Module):
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        self.classifier = classifier

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def alexnet(input_shape, num_classes, hidden: int = 4096, dropout: float = 0.5) -> SplitModel:
    """AlexNet as torchvision builds it (Krizhevsky 2014, "one weird trick"): conv 11x11/4 64, pool, conv 5x5 192,
    pool, conv 3x3 384, 256, 256, pool, adaptive pool 6x6; classifier Dropout, fc 9216 -> hidden, ReLU, Dropout,
    fc hidden -> hidden, ReLU (the embedding); head fc hidden -> classes. Needs images of at least 63x63."""
    _min_side(input_shape, 63, "alexnet")
    for name, v in (("hidden", hidden),):
        if v < 1:
            raise ConfigError(f"model.params.{name}", f"must be >= 1, got {v}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError("model.params.dropout", f"must be in [0, 1), got {dropout}")
    features = nn.Sequential(
        nn.Conv2d(input_shape[0], 64, kernel_size=11, stride=4, padding=2), nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(),
        nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(kernel_size=3, stride=2))
    classifier = nn.Sequential(Dropout(dropout), nn.Linear(256 * 6 * 6, hidden), nn.ReLU(),
                               Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU())
    return SplitModel(_ConvBody(features, 6, classifier), nn.Linear(hidden, num_classes), hidden)


def vgg11(input_shape, num_classes, width: int = 64, hidden: int = 4096, dropout: float = 0.5,
          batch_norm: bool = False) -> SplitModel:
    """VGG-11 (Simonyan & Zisserman 2015, configuration A) as torchvision builds it: 3x3 convs at w, M, 2w, M, 4w,
    4w, M, 8w, 8w, M, 8w, 8w, M (``batch_norm``: BN after each conv, torchvision's vgg11_bn), adaptive pool 7x7;
    classifier fc 8w*49 -> hidden, ReLU, Dropout, fc hidden -> hidden, ReLU (the embedding); head Dropout, fc hidden
    -> classes; torchvision's initialisation. Needs images of at least 32x32."""
    _min_side(input_shape, 32, "vgg11")
    for name, v in (("width", width), ("hidden", hidden)):
        if v < 1:
            raise ConfigError(f"model.params.{name}", f"must be >= 1, got {v}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError("model.params.dropout", f"must be in [0, 1), got {dropout}")
    layers: list[nn.Module] = []
    cin = input_shape[0]
    for v in (1, "M", 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        layers.append(nn.Conv2d(cin, v * width, kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(v * width))
        layers.append(nn.ReLU())
        cin = v * width
    classifier = nn.Sequential(nn.Linear(cin * 7 * 7, hidden), nn.ReLU(), Dropout(dropout),
                               nn.Linear(hidden, hidden), nn.ReLU())
    model = SplitModel(_ConvBody(nn.Sequential(*layers), 7, classifier),
                       nn.Sequential(Dropout(dropout), nn.Linear(hidden, num_classes)), hidden)
    for m in model.modules():  # torchvision's initialisation
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.constant_(m.bias, 0)
    return model


ARCHS: dict[str, Callable[..., SplitModel]] = {"cnn_mnist": cnn_mnist, "mlp": mlp, "cnn_small": cnn_small,
                                               "cnn4": cnn4, "resnet_small": resnet_small,
                                               "mobilenet_small": mobilenet_small, "fedavg_cnn": fedavg_cnn,
                                               "mlp1": mlp1, "protonet": protonet, "lenet": lenet,
                                               "resnet18": resnet18, "resnet34": resnet34, "alexnet": alexnet,
                                               "vgg11": vgg11}

# The heterogeneous zoo for 1x28x28 inputs (assign with model.per_client + assign: cycle | blocks | list | tier).
ZOO_28 = ("cnn_mnist", "cnn4", "resnet_small", "mobilenet_small")


def arch_params(name: str) -> list[str]:
    return list(inspect.signature(ARCHS[name]).parameters)[2:]


def build_model(spec: ArchSpec, input_shape, num_classes, path: str = "model") -> nn.Module:
    """A zoo model, or the user's (a registered name or an import path ``package.module:factory``, adapted by
    :mod:`raysim.adapt`: a SplitModel, or a WholeModel when its embedding is unknown)."""
    if spec.arch not in ARCHS:
        return build_user_model(resolve_factory(spec.arch, f"{path}.arch", ARCHS), spec, input_shape, num_classes,
                                path)
    if getattr(spec, "embedding", None) is not None:
        raise ConfigError(f"{path}.embedding", f"{spec.arch} is a zoo model with its own body/head split; "
                                               f"embedding is for user models")
    allowed = arch_params(spec.arch)
    for k in spec.params:
        if k not in allowed:
            raise ConfigError(f"{path}.params.{k}", f"unknown parameter for {spec.arch}; allowed: {', '.join(allowed)}")
    return ARCHS[spec.arch](tuple(input_shape), num_classes, **spec.params)


def client_archs(cfg: ModelConfig, num_clients: int) -> list[ArchSpec]:
    """The architecture of every client (heterogeneous by list, cycle or contiguous blocks)."""
    emb = getattr(cfg, "embedding", None)
    if cfg.per_client is None:
        return [ArchSpec(cfg.arch, dict(cfg.params), emb)] * num_clients
    specs = [ArchSpec(s.arch, dict(s.params), emb) if s.embedding is None and emb is not None and s.arch not in ARCHS
             else s for s in cfg.per_client]
    if cfg.assign == "list":
        if len(specs) != num_clients:
            raise ConfigError("model.per_client", f"assign=list needs one entry per client ({num_clients}), got {len(specs)}")
        return specs
    if cfg.assign == "cycle":
        return [specs[i % len(specs)] for i in range(num_clients)]
    if cfg.assign == "tier":
        return [specs[cfg.tiers[i % len(cfg.tiers)]] for i in range(num_clients)]
    # blocks: FedProto "mh" (18/20/22 channels for clients 0-6 / 7-13 / 14-19 of 20)
    per = -(-num_clients // len(specs))
    return [specs[min(i // per, len(specs) - 1)] for i in range(num_clients)]


def arch_key(spec: ArchSpec) -> str:
    emb = getattr(spec, "embedding", None)
    return spec.arch + repr(sorted(spec.params.items())) + ("" if emb is None else f"@{emb}")


def register_model(name: str, factory) -> None:
    """Register a model factory under ``name`` (then ``model.arch: name``): ``"module.path:factory"`` or the
    callable itself, ``factory(input_shape, num_classes, **model.params) -> nn.Module``. The name travels to every
    runner (raysim.config.registry)."""
    if name in ARCHS or ":" in name:
        raise ValueError(f"cannot register a model as {name!r}: a zoo name or an import path")
    MODELS[name] = factory


__all__ = ["ARCHS", "ZOO_28", "Dropout", "SplitModel", "arch_key", "arch_params", "build_model", "client_archs",
           "dropout_masks_of", "num_parameters", "register_model", "replay_masks", "set_dropout_generator"]
