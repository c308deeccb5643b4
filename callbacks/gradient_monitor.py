"""Global gradient norm per optimizer step, reduced on the device and read once per epoch."""

from __future__ import annotations

import math

import torch

from fsmtrain.core.context import EpochContext, RunContext, StepContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback
from fsmtrain.core.slots import MAX_GRAD_NORM
from fsmtrain.training.sharding import global_norm, is_sharded_tensor

__all__ = ["GradientMonitorCallback"]


def _fold_on_host(
    state: list[float], norms: list[float], batches: list[int], threshold: float
) -> tuple[float, float, float, float]:
    """:meth:`GradientMonitorCallback._fold` on the host: ``norms`` into ``state`` (max, its batch,
    count over, first over); a NaN counts as the max and as over, so it is never hidden."""
    max_norm, argmax, over, first = state
    if not norms:
        return max_norm, argmax, over, first
    nan_at = next((i for i, v in enumerate(norms) if v != v), None)
    seg_arg = nan_at if nan_at is not None else max(range(len(norms)), key=norms.__getitem__)
    seg_max = norms[seg_arg]
    if not seg_max <= max_norm:
        max_norm, argmax = seg_max, float(batches[seg_arg])
    flagged = [b for b, v in zip(batches, norms, strict=True) if not v <= threshold]
    if flagged and first < 0:
        first = float(flagged[0])
    return max_norm, argmax, over + len(flagged), first


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for a 0-d index tensor without the host read plain indexing would do."""
    return values.index_select(0, index.reshape(1)).reshape(())


class GradientMonitorCallback(TrainingCallback):
    """The epoch's max norm into slot ``max_grad_norm``, and a warning naming the batch when a norm exceeds
    ``warn_threshold``. Norms go into a device buffer, folded on the device when full (running max, its
    batch, the count over, the first over) and read once at epoch end."""

    priority = 12
    tier = Tier.CORE
    # Needs live gradients: a replay feeds the recorded max_grad_norm instead (fsmtrain.tools.replay).
    replay = ReplaySupport.DRY
    writes = (MAX_GRAD_NORM,)
    buffer_size = 256
    flat_max_elements = 1 << 16  # 256 KB of float32 gradients: one copy of them costs less than 10 us (CPU)

    def __init__(self, warn_threshold: float = 1e4) -> None:
        if not isinstance(warn_threshold, (int, float)) or isinstance(warn_threshold, bool) or warn_threshold <= 0:
            raise ValueError(f"warn_threshold must be a number > 0, got {warn_threshold!r}")
        self.warn_threshold = float(warn_threshold)
        self._params: list[torch.Tensor] = []
        self._device: torch.device | None = None
        self._dtype = torch.float32
        self._grad_dtype: torch.dtype | None = None
        self._flat = False  # the norm of all gradients concatenated (see _allocate)
        self._buf = torch.zeros(0)
        self._slots: list[torch.Tensor] = []  # views of the buffer's slots, made once
        self._batches: list[int] = []  # host-side batch index of each filled buffer slot
        self._state = torch.zeros(4, dtype=torch.float64)  # the running fold, in the four views below
        self._max, self._argmax, self._over, self._first_over = self._state.unbind()
        self._steps = 0

    def on_train_begin(self, run: RunContext) -> None:
        run.emit("callback_settings", source=self.name, settings={"warn_threshold": self.warn_threshold})
        self._params = [p for p in run.model.parameters() if p.requires_grad] if run.model is not None else []

    def _allocate(self, grad: torch.Tensor) -> None:
        # Norms are taken in at least float32: an fp16 gradient of norm 1e5 (fp16 ends at 65504) is finite.
        dev = self._device = grad.device
        self._grad_dtype, self._dtype = grad.dtype, torch.promote_types(grad.dtype, torch.float32)
        # Small models on one device: one copy of all gradients and one norm, two kernels. get_total_norm's four
        # (foreach norms, stack, norm, copy) take 3x their host time (45 against 15 us on CPU tensors), which a
        # small model's step pays in full on CUDA, where it is host-bound.
        self._flat = (not is_sharded_tensor(grad) and all(p.device == dev for p in self._params)
                      and sum(p.numel() for p in self._params) <= self.flat_max_elements)
        self._buf = torch.zeros(self.buffer_size, dtype=self._dtype, device=dev)
        self._slots = list(self._buf.unbind())
        self._state = torch.zeros(4, dtype=torch.float64, device=dev)
        self._max, self._argmax, self._over, self._first_over = self._state.unbind()
        self._reset()

    def _reset(self) -> None:
        self._state.fill_(-1.0)  # below any norm (the first step becomes the max), and no batch
        self._over.zero_()
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
        first = grads[0]
        if first.dtype is not self._grad_dtype or first.device != self._device:
            if self._steps:
                self._fold()
            self._allocate(first)
        k = len(self._batches)
        if is_sharded_tensor(first):  # FSDP: the global norm across the shards
            self._slots[k].copy_(global_norm(grads))
        elif self._flat:
            flat = torch.cat([g.reshape(-1) for g in grads])
            torch.linalg.vector_norm(flat, 2.0, dtype=self._dtype, out=self._slots[k])
        elif self._grad_dtype is self._dtype:  # one fused kernel per device and dtype on CUDA
            self._slots[k].copy_(torch.nn.utils.get_total_norm(grads, 2.0))
        else:  # fp16/bf16 gradients: each norm taken in float32, so a norm past 65504 stays finite
            norms = [torch.linalg.vector_norm(g, 2.0, dtype=self._dtype) for g in grads]
            torch.linalg.vector_norm(torch.stack(norms), 2.0, out=self._slots[k])
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
        n = len(self._batches)
        state = torch.cat([self._state, self._buf[:n].double()]).tolist()  # the one host read of the epoch
        max_norm, argmax, over, first = _fold_on_host(state[:4], state[4:], self._batches, self.warn_threshold)
        self._batches.clear()
        epoch.set(MAX_GRAD_NORM, max_norm)
        if over > 0:
            epoch.warn(
                self.name,
                f"gradient norm exceeded {self.warn_threshold:g} in {int(over)} of {self._steps} optimizer steps "
                f"of epoch {epoch.number}, first at batch {int(first)}; max {max_norm:.4g} at batch {int(argmax)}",
                epoch=epoch.index, batch=int(first), max_batch=int(argmax), max_grad_norm=max_norm,
                count=int(over), finite=math.isfinite(max_norm),
            )
