"""Exact validation metrics (torchmetrics' ``update``/``compute``/``reset``), updated per batch and computed
once per validation; across unpadded rank shards the value is the whole val set's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["ExactMetrics", "StatefulMetric"]


@runtime_checkable
class StatefulMetric(Protocol):
    def update(self, output: Any, target: Any) -> None: ...
    def compute(self) -> Any: ...
    def reset(self) -> None: ...


class ExactMetrics:
    """The run's stateful metrics, by name, on the run's device."""

    def __init__(self, metrics: Mapping[str, StatefulMetric], device: torch.device) -> None:
        self.metrics = {name: m.to(device) if isinstance(m, nn.Module) else m for name, m in metrics.items()}
        self.device = device

    def __bool__(self) -> bool:
        return bool(self.metrics)

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def update(self, output: Any, target: Any) -> None:
        for metric in self.metrics.values():
            metric.update(output, target)

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, metric in self.metrics.items():
            value = metric.compute()
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"metric {name!r} ({type(metric).__name__}) computed {shown}, not one number; "
                                 "give it the settings that reduce it to one (average='micro' or 'macro')")
            out[name] = float(value.item())
        return out

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each metric's accumulated state (torchmetrics' ``metric_state``), for a checkpoint."""
        return {name: {k: v.detach().clone() if isinstance(v, torch.Tensor) else list(v)
                       for k, v in getattr(m, "metric_state", {}).items()} for name, m in self.metrics.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        for name, values in state.items():
            for key, value in values.items():
                moved = [v.to(self.device) for v in value] if isinstance(value, list) else value.to(self.device)
                setattr(self.metrics[name], key, moved)
