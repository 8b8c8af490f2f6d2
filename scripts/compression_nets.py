"""The tiny models both compression comparisons against DeepSpeed 0.17.6 train: the
hand-written fixture cases (tests/compression_models.py, recorded by
scripts/make_ds_compression_fixtures.py) and the generated differential cases
(scripts/diff_compression_runner.py). Plain torch only, so either side's Python imports it;
the module and layer names are the ones the cases' compression configs target."""
from __future__ import annotations

import torch
from torch import nn


class CNN(nn.Module):
    """conv1 -> bn1 -> conv2 -> mean over the image -> fc: channel pruning of conv1 cuts bn1 and
    conv2's inputs with it."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.conv2(h))
        return self.fc(h.mean(dim=(2, 3)))


class Stack(nn.Module):
    """A stack of residual layers between an input and an output module, for layer reduction."""

    def __init__(self, depth: int = 4):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(depth))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.relu(layer(h)) + h
        return self.head(h)
