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

from pipeline.context import StepContext
from pipeline.runner import CallbackRunner

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
        self.runner = runner
        self.actions = actions
        self.hooks = {h: bool(runner.table(h)) for h in STEP_HOOKS}
        self.hooked = any(self.hooks.values())

    def __call__(self, step: StepContext) -> None:
        hooks, fire, act = self.hooks, self.runner.fire, self.actions
        if hooks["on_before_forward"]:
            fire("on_before_forward", step)
        act.forward(step)
        if hooks["on_after_forward"]:
            fire("on_after_forward", step)
        if not step.skip_backward:
            if hooks["on_before_backward"]:
                fire("on_before_backward", step)
            act.backward(step)
            if hooks["on_after_backward"]:
                fire("on_after_backward", step)
        if not step.skip_optimizer_step:
            if hooks["on_before_optimizer_step"]:
                fire("on_before_optimizer_step", step)
            act.optimizer_step(step)
            if hooks["on_after_optimizer_step"]:
                fire("on_after_optimizer_step", step)
        if not step.skip_zero_grad:
            if hooks["on_before_zero_grad"]:
                fire("on_before_zero_grad", step)
            act.zero_grad(step)
        if hooks["on_train_step_end"]:
            fire("on_train_step_end", step)
