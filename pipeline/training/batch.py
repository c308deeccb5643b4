"""The per-batch body: the order of the step hooks around forward, backward, the optimizer step
and zero_grad. Written once; the torch driver runs it with real actions and replay with recorded
ones, so both fire the same hooks in the same order and honour the same skip flags::

    [on_before_forward] forward [on_after_forward]
    [on_before_backward] backward [on_after_backward]                    unless step.skip_backward
    [on_before_optimizer_step] optimizer step [on_after_optimizer_step]  unless step.skip_optimizer_step
    [on_before_zero_grad] zero_grad                                      unless step.skip_zero_grad
    [on_train_step_end]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.core.context import StepContext
from pipeline.core.runner import CallbackRunner

STEP_HOOKS: tuple[str, ...] = (
    "on_before_forward", "on_after_forward", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_after_optimizer_step", "on_before_zero_grad", "on_train_step_end",
)


def _nothing(step: StepContext) -> None:
    return None


@dataclass(frozen=True)
class StepActions:
    """What a driver does at each point of the body (replay does nothing but forward)."""

    forward: Callable[[StepContext], None]
    backward: Callable[[StepContext], None] = _nothing
    optimizer_step: Callable[[StepContext], None] = _nothing
    zero_grad: Callable[[StepContext], None] = _nothing


class BatchBody:
    """Runs one batch: ``actions`` in the fixed order, each hook only if a callback overrides it."""

    def __init__(self, runner: CallbackRunner, actions: StepActions) -> None:
        self.actions = actions
        self._hooks = tuple(runner.dispatcher(h) for h in STEP_HOOKS)
        self.hooked = any(d is not None for d in self._hooks)

    def __call__(self, step: StepContext) -> None:
        before_fwd, after_fwd, before_bwd, after_bwd, before_opt, after_opt, before_zero, step_end = self._hooks
        act = self.actions
        if before_fwd is not None:
            before_fwd(step)
        act.forward(step)
        if after_fwd is not None:
            after_fwd(step)
        if not step.skip_backward:
            if before_bwd is not None:
                before_bwd(step)
            act.backward(step)
            if after_bwd is not None:
                after_bwd(step)
        if not step.skip_optimizer_step:
            if before_opt is not None:
                before_opt(step)
            act.optimizer_step(step)
            if after_opt is not None:
                after_opt(step)
        if not step.skip_zero_grad:
            if before_zero is not None:
                before_zero(step)
            act.zero_grad(step)
        if step_end is not None:
            step_end(step)
