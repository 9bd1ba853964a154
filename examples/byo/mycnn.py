"""A researcher's own model: a small CNN for small grayscale images (here scikit-learn's 8x8 digits).

raysim calls ``small_cnn(input_shape, num_classes, **model.params)``; a config may call it because it is marked with
``@raysim.model_factory`` (a config names no unmarked function). The module has ``features`` (image ->
embedding) and ``classifier`` (embedding -> logits), so prototype methods (FedProto) use the embedding without any
further declaration. ``Net`` (below) has no such attributes: FedAvg takes it as it is, and for FedProto the config
names its embedding layer (``model.embedding: fc1``).
"""
import torch
import torch.nn as nn

import raysim


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, channels: int = 16, embed_dim: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
            nn.Linear(2 * channels * 4, embed_dim), nn.ReLU())
        self.classifier = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


@raysim.model_factory
def small_cnn(input_shape, num_classes, channels: int = 16, embed_dim: int = 32) -> nn.Module:
    return SmallCNN(input_shape[0], num_classes, channels, embed_dim)


class Net(nn.Module):
    """A plain model with its own forward: conv, fc1 (the embedding), dropout, fc2."""

    def __init__(self, in_channels: int, side: int, num_classes: int, hidden: int = 32):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * side * side, hidden)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@raysim.model_factory
def net(input_shape, num_classes, hidden: int = 32) -> nn.Module:
    return Net(input_shape[0], input_shape[-1], num_classes, hidden)
