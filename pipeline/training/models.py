"""Small built-in models, metrics and steps the shipped example configs name by dotted path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits as bce

from fsmtrain.training.optimizers import manual_step

__all__ = ["ACTIVATIONS", "GAN", "MLP", "accuracy", "gan_step", "gan_val_step"]

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


class MLP(nn.Module):
    """A fully connected network ``in_features -> hidden... -> out_features`` (``hidden`` empty: a
    linear model), with ``dropout`` after every hidden activation."""

    def __init__(self, in_features: int, out_features: int, hidden: Sequence[int] = (64, 64),
                 activation: str = "relu", dropout: float = 0.0) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), ACTIVATIONS[activation]()]
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


class GAN(nn.Module):
    """A ``generator`` (noise of ``latent`` features to ``features``) and a ``discriminator`` (a logit
    per row); ``forward`` is the discriminator's score of real rows (what predict gives)."""

    def __init__(self, features: int = 2, latent: int = 4, hidden: Sequence[int] = (32,)) -> None:
        super().__init__()
        self.latent = latent
        self.generator = MLP(latent, features, hidden)
        self.discriminator = MLP(features, 1, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.discriminator(x)
        return out


def _gan_losses(model: GAN, real: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fake = model.generator(noise)
    d_real, d_fake = model.discriminator(real), model.discriminator(fake.detach())
    d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
    g_score = model.discriminator(fake)
    return d_loss, bce(g_score, torch.ones_like(g_score))


@manual_step
def gan_step(model: GAN, batch: torch.Tensor,
             optimizers: Mapping[str, torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """One GAN step on a batch of real rows: the discriminator (optimizer ``disc``), then the
    generator (``gen``), each with its own backward and step."""
    losses: list[torch.Tensor] = []
    for name, which in (("disc", 0), ("gen", 1)):
        losses.append(_gan_losses(model, batch, torch.randn(batch.shape[0], model.latent, device=batch.device))[which])
        optimizers[name].zero_grad(set_to_none=True)
        losses[-1].backward()  # type: ignore[no-untyped-call]
        optimizers[name].step()
    d_loss, g_loss = losses
    return {"loss": (d_loss + g_loss).detach(), "d_loss": d_loss.detach(), "g_loss": g_loss.detach()}


def gan_val_step(model: GAN, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Both losses on real rows and the same noise every time (the global RNG is left alone)."""
    noise = torch.randn(batch.shape[0], model.latent, generator=torch.Generator().manual_seed(0)).to(batch.device)
    d_loss, g_loss = _gan_losses(model, batch, noise)
    return {"loss": d_loss + g_loss, "output": model(batch)}
