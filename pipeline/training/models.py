"""Small built-in models and metrics the shipped example configs name by dotted path."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["ACTIVATIONS", "MLP", "accuracy"]

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "silu": nn.SiLU,
}


class MLP(nn.Module):
    """A fully connected network ``in_features -> hidden... -> out_features`` (``hidden`` empty: a
    linear model), with ``dropout`` after every hidden activation."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        hidden: Sequence[int] = (64, 64),
        activation: str = "relu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers.append(nn.Linear(width, h))
            layers.append(ACTIVATIONS[activation]())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fraction of rows whose arg-max class equals ``target`` (a validation metric, 0-d tensor)."""
    return (output.argmax(dim=-1) == target).float().mean()
