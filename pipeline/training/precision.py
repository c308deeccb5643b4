"""Mixed precision: ``"32"``, ``"bf16-mixed"`` (autocast, no scaling) or ``"16-mixed"`` (a ``GradScaler``:
gradients unscaled right after backward, so callbacks see true ones; an overflow skips that batch's step)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = ["PRECISIONS", "PrecisionPolicy"]

PRECISIONS: tuple[str, ...] = ("32", "bf16-mixed", "16-mixed")


class PrecisionPolicy:
    """The autocast context and the loss scaler of one run."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
        self.device = device
        self._dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

    @property
    def enabled(self) -> bool:
        return self._dtype is not None

    def autocast(self) -> AbstractContextManager[Any]:
        if self._dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._dtype)

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, stepping: bool) -> bool:
        """Backward of ``loss`` (scaled under fp16, unscaled on a stepping batch); False on an overflow."""
        scaler = self.scaler
        if scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
            return True
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        if not stepping:
            return True
        scaler.unscale_(optimizer)
        state = scaler._per_optimizer_states[id(optimizer)]  # what unscale_ found, per device
        # GradScaler.step reads the same flags on the host; reading them here costs no extra sync.
        finite = not any(bool(v.item()) for v in state["found_inf_per_device"].values())
        if not finite:
            scaler.update()  # shrink the scale; the step is skipped through the step context
        return finite

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()
