"""Mixed precision: what the driver runs its forward under, and how it scales the loss.

``"32"``: plain float32. ``"bf16-mixed"``: forward and loss under ``torch.autocast`` with bfloat16
(float32's range: no scaling). ``"16-mixed"``: float16 with a ``GradScaler``; gradients are unscaled
right after backward, so callbacks see true ones, and an overflow skips that batch's optimizer step
(``skip_optimizer_step``) and shrinks the scale. Weights stay float32; checkpoints carry the scaler.
"""

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
        self.scaler: torch.amp.GradScaler | None = None
        if precision == "16-mixed":
            self.scaler = torch.amp.GradScaler(device.type)

    @property
    def enabled(self) -> bool:
        return self._dtype is not None

    def autocast(self) -> AbstractContextManager[Any]:
        if self._dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._dtype)

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, stepping: bool) -> bool:
        """Backward of ``loss`` (scaled under fp16). On a stepping batch the gradients are then
        unscaled; returns False when they overflowed (the step must be skipped)."""
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
            return
        self.scaler.step(optimizer)
        self.scaler.update()
