"""Global gradient norm per optimizer step, reduced on the device and read once per epoch."""

from __future__ import annotations

import math

import torch

from pipeline.core.context import EpochContext, RunContext, StepContext
from pipeline.core.hooks import ReplaySupport, Tier, TrainingCallback
from pipeline.core.slots import MAX_GRAD_NORM

__all__ = ["GradientMonitorCallback"]


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for a 0-d index tensor without the host read plain indexing would do."""
    return values.index_select(0, index.reshape(1)).reshape(())


class GradientMonitorCallback(TrainingCallback):
    """Global L2 norm of all gradients at every optimizer step (before clipping, which runs at a
    higher priority on the same hook), per-epoch max into slot ``max_grad_norm``, and a warning
    naming the epoch and batch when a norm exceeds ``warn_threshold``.

    No host sync per batch. Each step writes its norm (one fused ``_foreach_norm`` and a
    ``vector_norm`` with ``out=``) into a preallocated device buffer of ``buffer_size`` slots; when
    the buffer is full, and at epoch end, it is folded into four preallocated 0-d device tensors:
    the running max, its batch index, the number of over-threshold steps and the first such batch.
    Those are read in one go at ``on_epoch_end``. Memory is fixed, whatever the epoch length.
    """

    priority = 12
    tier = Tier.CORE
    # Needs live gradients: a replay feeds the recorded max_grad_norm instead (pipeline.tools.replay).
    replay = ReplaySupport.DRY
    writes = (MAX_GRAD_NORM,)
    buffer_size = 256

    def __init__(self, warn_threshold: float = 1e4) -> None:
        if not isinstance(warn_threshold, (int, float)) or isinstance(warn_threshold, bool) or warn_threshold <= 0:
            raise ValueError(f"warn_threshold must be a number > 0, got {warn_threshold!r}")
        self.warn_threshold = float(warn_threshold)
        self._params: list[torch.Tensor] = []
        self._device: torch.device | None = None
        self._dtype = torch.float32
        self._buf = torch.zeros(0)
        self._batches: list[int] = []  # host-side batch index of each filled buffer slot
        self._max = torch.zeros(())
        self._argmax = torch.zeros((), dtype=torch.float64)
        self._over = torch.zeros((), dtype=torch.float64)
        self._first_over = torch.zeros((), dtype=torch.float64)
        self._steps = 0

    def on_train_begin(self, run: RunContext) -> None:
        # The threshold goes into the log, so a report can draw the epoch maxima against it.
        run.emit("callback_settings", source=self.name, settings={"warn_threshold": self.warn_threshold})
        model = run.model
        self._params = [p for p in model.parameters() if p.requires_grad] if model is not None else []

    def _allocate(self, grad: torch.Tensor) -> None:
        # Norms are taken in at least float32: an fp16 gradient of norm 1e5 (fp16 ends at 65504) is finite.
        self._device, self._dtype = grad.device, torch.promote_types(grad.dtype, torch.float32)
        dev = grad.device
        self._buf = torch.zeros(self.buffer_size, dtype=self._dtype, device=dev)
        self._max = torch.zeros((), dtype=torch.float64, device=dev)
        self._argmax = torch.zeros((), dtype=torch.float64, device=dev)
        self._over = torch.zeros((), dtype=torch.float64, device=dev)
        self._first_over = torch.zeros((), dtype=torch.float64, device=dev)
        self._reset()

    def _reset(self) -> None:
        self._max.fill_(-1.0)  # below any norm, so the first step always becomes the max
        self._argmax.fill_(-1.0)
        self._over.zero_()
        self._first_over.fill_(-1.0)
        self._batches.clear()

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        self._steps = 0
        if self._device is not None:
            self._reset()

    def on_after_backward(self, step: StepContext) -> None:
        if step.skip_optimizer_step:
            return  # an accumulation micro-batch: the norm is taken once, at the step
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return
        if self._device != grads[0].device or self._dtype != torch.promote_types(grads[0].dtype, torch.float32):
            if self._steps:
                self._fold()
            self._allocate(grads[0])
        k = len(self._batches)
        norms = torch._foreach_norm(grads, 2.0, dtype=self._dtype)
        torch.linalg.vector_norm(torch.stack(norms), 2.0, out=self._buf[k])
        self._batches.append(step.batch_index)
        self._steps += 1
        if k + 1 == self.buffer_size:
            self._fold()

    def _fold(self) -> None:
        """Reduce the filled part of the buffer into the running state, on the device."""
        n = len(self._batches)
        if n == 0:
            return
        seg = self._buf[:n].double()
        batches = torch.tensor(self._batches, dtype=torch.float64).to(self._max.device, non_blocking=True)
        seg_max, seg_arg = seg.max(0)  # a NaN norm is the max (max propagates NaN)
        # ``not (x <= y)`` is also true for NaN, so a non-finite norm is never hidden.
        better = torch.logical_not(seg_max <= self._max)
        self._max.copy_(torch.where(better, seg_max, self._max))
        self._argmax.copy_(torch.where(better, _take(batches, seg_arg), self._argmax))
        over = torch.logical_not(seg <= self.warn_threshold)
        first_here = _take(batches, over.to(torch.int8).argmax())  # argmax gives the first True
        self._first_over.copy_(torch.where((self._first_over < 0) & over.any(), first_here, self._first_over))
        self._over.add_(over.sum())
        self._batches.clear()

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if self._steps == 0:
            return
        self._fold()
        max_norm, argmax, over, first = torch.stack(
            [self._max, self._argmax, self._over, self._first_over]
        ).tolist()  # the one host read of the epoch
        epoch.set(MAX_GRAD_NORM, max_norm)
        if over > 0:
            epoch.warn(
                self.name,
                f"gradient norm exceeded {self.warn_threshold:g} in {int(over)} of {self._steps} optimizer steps "
                f"of epoch {epoch.number}, first at batch {int(first)}; max {max_norm:.4g} at batch {int(argmax)}",
                epoch=epoch.index, batch=int(first), max_batch=int(argmax), max_grad_norm=max_norm,
                count=int(over), finite=math.isfinite(max_norm),
            )
