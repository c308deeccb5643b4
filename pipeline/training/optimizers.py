"""Several named optimizers and schedulers acting as one for the engine and its checkpoints; a manual step
(:func:`manual_step`) gets them by name and steps them itself."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch

from fsmtrain.core.lifecycle import PROGRAM
from fsmtrain.training.step import step_name

__all__ = ["NamedOptimizers", "NamedSchedulers", "check_manual", "check_manual_driver", "is_manual", "manual_step",
           "optimizers_of", "skipped_hooks"]

F = TypeVar("F", bound=Callable[..., Any])


def manual_step(fn: F) -> F:
    """Declare ``fn(model, batch, optimizers)`` a manual step: it runs its own backward and optimizer steps
    (``optimizers`` by name; ``optimizer`` for a run's one), and the engine's are left out."""
    fn.manual_optimization = True  # type: ignore[attr-defined]
    return fn


def is_manual(fn: Any) -> bool:
    return getattr(fn, "manual_optimization", False) is True


class NamedOptimizers(torch.optim.Optimizer):
    """``optimizers`` by name; their parameter groups are this one's, so the lr and clipping see them all."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        owner: dict[int, str] = {}
        for name, opt in optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, NamedOptimizers):
                raise TypeError(f"optimizer {name!r} must be a torch.optim.Optimizer, got {type(opt).__name__}")
            for p in (p for g in opt.param_groups for p in g["params"]):
                if owner.setdefault(id(p), name) != name:
                    raise ValueError(f"optimizers {owner[id(p)]!r} and {name!r} share a parameter: each parameter "
                                     "is stepped by one optimizer")
        if not optimizers:
            raise ValueError("NamedOptimizers needs at least one optimizer")
        self.optimizers = dict(optimizers)
        super().__init__([p for o in self.optimizers.values() for g in o.param_groups for p in g["params"]], {})
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.optimizers[name]

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        for opt in self.optimizers.values():
            opt.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        saved = state_dict.get("optimizers")
        if not isinstance(saved, Mapping) or set(saved) != set(self.optimizers):
            raise ValueError(f"the checkpoint holds optimizers {sorted(saved or ())}; this run has "
                             f"{sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(saved[name])


def optimizers_of(optimizer: Any) -> dict[str, Any]:
    """The optimizers by name: several named ones, or the one (named ``optimizer``)."""
    if isinstance(optimizer, NamedOptimizers):
        return dict(optimizer.optimizers)
    return {} if optimizer is None else {"optimizer": optimizer}


class NamedSchedulers:
    """Schedulers by the name of their optimizer, stepped together once an epoch."""

    def __init__(self, schedulers: Mapping[str, Any]) -> None:
        for name, s in schedulers.items():
            if not callable(getattr(s, "step", None)):
                raise TypeError(f"scheduler {name!r} must have a step() method, got {type(s).__name__}")
        self.schedulers = dict(schedulers)

    def __getitem__(self, name: str) -> Any:
        return self.schedulers[name]

    def step(self, value: float | None = None) -> None:
        for s in self.schedulers.values():
            if not isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
                s.step()
            elif value is not None:
                s.step(value)

    def state_dict(self) -> dict[str, Any]:
        return {name: s.state_dict() for name, s in self.schedulers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, s in self.schedulers.items():
            s.load_state_dict(state[name])


# The hooks a manual step leaves out with the work they surround (the table's skip-flagged hooks).
SKIPPED_HOOKS: tuple[str, ...] = tuple(s.name for s in PROGRAM if s.skip is not None and s.action is None)


def skipped_hooks(step: Any, callbacks: Iterable[Any]) -> list[str]:
    """For a manual ``step``: each callback that needs a hook it leaves out, as ``Name (hooks)``."""
    if not is_manual(step):
        return []
    found = [(cb, [h for h in cb.overridden_hooks() if h in SKIPPED_HOOKS]) for cb in callbacks]
    return [f"{type(cb).__name__} ({', '.join(hooks)})" for cb, hooks in found if hooks]


def check_manual(step: Any, callbacks: Iterable[Any], world_size: int) -> None:
    """A manual step's limits, checked when the run is built: one process, no callback on the hooks it skips."""
    if not is_manual(step):
        return
    name = step_name(step)
    if world_size > 1:
        raise ValueError(f"the manual step {name} runs its own backward and optimizer steps, which DDP's gradient "
                         f"averaging does not reach: it trains on one process (this run has {world_size})")
    needing = skipped_hooks(step, callbacks)
    if needing:
        raise ValueError(f"the manual step {name} runs its own backward and optimizer steps, so the hooks around "
                         f"them never fire; callbacks that need them: {'; '.join(needing)} (leave them out; "
                         "default_callbacks=False leaves out the built-in gradient monitor)")


def check_manual_driver(step: Any, fp16: bool, validates_with_it: bool) -> None:
    """What the driver cannot do for a manual step: fp16's loss scaling, or validate with it."""
    if fp16:
        raise ValueError(f"the manual step {step_name(step)} runs its own backward, without fp16's loss scaling: use "
                         "precision '32' or 'bf16-mixed'")
    if validates_with_it:
        raise ValueError(f"the manual step {step_name(step)} steps optimizers: validation needs its own val_step")
