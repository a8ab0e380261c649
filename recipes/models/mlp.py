"""Tiny multi-layer perceptron: the smallest model worth compiling."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear-GELU-Linear-...-Linear classifier.

    ``sizes`` lists every width from input to output, e.g. ``(16, 64, 64, 4)``
    gives ``fc1, act1, fc2, act2, fc3``. The last Linear has no activation so
    its outputs are logits.
    """

    def __init__(self, sizes: Sequence[int], bias: bool = True) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"need at least input and output sizes, got {tuple(sizes)}")
        self.sizes = tuple(sizes)
        n_linear = len(sizes) - 1
        for i, (d_in, d_out) in enumerate(zip(sizes, sizes[1:]), start=1):
            self.add_module(f"fc{i}", nn.Linear(d_in, d_out, bias=bias))
            if i < n_linear:
                self.add_module(f"act{i}", nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy for ``batch = (x, y)`` with ``x`` (B, in) and class ids ``y`` (B,)."""
    x, y = batch
    return F.cross_entropy(model(x), y)
