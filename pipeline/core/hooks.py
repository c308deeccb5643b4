"""The callback base class: a callback overrides the hooks it cares about; every hook takes one
typed context (``lifecycle.HOOKS`` says where each fires and which context it gets)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from enum import Enum
from typing import Any, ClassVar

from fsmtrain.core.context import (
    CheckpointContext,
    EpochContext,
    FaultContext,
    RunContext,
    Slot,
    StepContext,
    ValStepContext,
)
from fsmtrain.core.lifecycle import HOOK_NAMES
from fsmtrain.core.registry import GlobalHandle, register_global_callback


def int_at_least(name: str, value: Any, minimum: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class Tier(int, Enum):
    """Tie-break between equal priorities: built-ins first, then the user's, then global ones."""

    CORE = 0
    USER = 1
    GLOBAL = 2


class ReplaySupport(str, Enum):
    """How a callback takes part in state replay (``fsmtrain.tools.replay``)."""

    FULL = "full"  # decides from contexts and slots alone: replays as it ran
    DRY = "dry"  # needs a live model/optimizer: runs with ``run.dry_run`` set and only records intent
    NONE = "none"  # cannot be replayed; replay refuses it by name


class TrainingCallback:
    priority: int = 50
    tier: ClassVar[Tier] = Tier.USER
    reads: ClassVar[tuple[Slot[Any], ...]] = ()
    writes: ClassVar[tuple[Slot[Any], ...]] = ()
    replay: ClassVar[ReplaySupport] = ReplaySupport.FULL
    reads_every_slot: ClassVar[bool] = False  # a logger of every slot: ordered after every writer
    # Several ranks: one that may stop immediately makes them agree per batch (else per epoch); a
    # ``rank_zero_only`` one writes what the run owns once (files, console, W&B).
    may_stop_immediately: ClassVar[bool] = False
    rank_zero_only: ClassVar[bool] = False
    works_sharded: ClassVar[bool] = True  # False: it needs whole parameters or gradients (refused under FSDP)

    def __init__(self, priority: int | None = None) -> None:
        """``priority`` overrides the class's for this instance; a subclass need not call this."""
        if priority is not None:
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise TypeError(f"priority must be an int, got {type(priority).__name__} {priority!r}")
            self.priority = priority

    @property
    def name(self) -> str:
        return type(self).__name__

    def overridden_hooks(self) -> tuple[str, ...]:
        """The hooks this callback's class overrides; only these are dispatched."""
        cls = type(self)
        return tuple(h for h in HOOK_NAMES if getattr(cls, h) is not getattr(TrainingCallback, h))

    @property
    def stateful(self) -> bool:
        return type(self).state_dict is not TrainingCallback.state_dict

    def monitored(self, epoch: EpochContext, key: str, consequence: str) -> float | None:
        """``epoch.metrics[key]``, or None with one warning per callback that the run lacks it."""
        value = epoch.metrics.get(key)
        if value is None and not getattr(self, "_missing_warned", False):
            self._missing_warned = True
            epoch.warn(self.name, f"monitored metric {key!r} is missing; {consequence}",
                       available=sorted(epoch.metrics))
        return value

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    # ``with MyCallback(): trainer.fit()`` registers it globally for the block.
    def __enter__(self) -> TrainingCallback:
        self._global_handle: GlobalHandle | None = register_global_callback(self)
        return self

    def __exit__(self, *exc: object) -> None:
        handle = getattr(self, "_global_handle", None)
        if handle is not None:
            handle.remove()
            self._global_handle = None

    def __repr__(self) -> str:
        return f"{self.name}(priority={self.priority})"

    # --- hooks (no-ops) --------------------------------------------------------------------
    def on_train_begin(self, run: RunContext) -> None: ...
    def on_load_checkpoint(self, ckpt: CheckpointContext) -> None: ...
    def on_train_epoch_begin(self, epoch: EpochContext) -> None: ...
    def on_batch_begin(self, step: StepContext) -> None: ...
    def on_before_forward(self, step: StepContext) -> None: ...
    def on_after_forward(self, step: StepContext) -> None: ...
    def on_before_backward(self, step: StepContext) -> None: ...
    def on_after_backward(self, step: StepContext) -> None: ...
    def on_before_optimizer_step(self, step: StepContext) -> None: ...
    def on_after_optimizer_step(self, step: StepContext) -> None: ...
    def on_before_zero_grad(self, step: StepContext) -> None: ...
    def on_train_step_end(self, step: StepContext) -> None: ...
    def on_val_begin(self, epoch: EpochContext) -> None: ...
    def on_val_batch_begin(self, step: ValStepContext) -> None: ...
    def on_val_batch_end(self, step: ValStepContext) -> None: ...
    def on_val_end(self, epoch: EpochContext) -> None: ...
    def on_before_scheduler_step(self, epoch: EpochContext) -> None: ...
    def on_epoch_end(self, epoch: EpochContext) -> None: ...
    def on_save_checkpoint(self, ckpt: CheckpointContext) -> None: ...
    def on_exception(self, fault: FaultContext) -> None: ...
    def on_train_end(self, run: RunContext) -> None: ...


_BOUND = "_fsmtrain_bound_to"  # the instance attribute naming the Trainer a callback serves
_trainers = itertools.count(1)


class CallbackBoundError(ValueError):
    """A callback instance that already served another Trainer was given to a new one."""


def bind_callbacks(callbacks: Sequence[TrainingCallback]) -> int:
    """Bind a Trainer's callback instances to it (returns the binding's number); one already bound
    to another Trainer is refused, since its attributes hold that run's state."""
    taken = [cb for cb in callbacks if getattr(cb, _BOUND, None) is not None]
    if taken:
        names = ", ".join(dict.fromkeys(str(cb.name) for cb in taken))
        cls = type(taken[0]).__name__
        raise CallbackBoundError(
            f"{names}: this callback instance already belongs to another Trainer, and its attributes hold that "
            f"run's state; give each Trainer its own instance (Trainer(..., callbacks=[{cls}(...)])), or register "
            f"it once with register_global_callback, which gives every run a fresh copy")
    number = next(_trainers)
    for cb in callbacks:
        with contextlib.suppress(AttributeError):  # __slots__ without a __dict__: nothing to mark it with
            object.__setattr__(cb, _BOUND, number)
    return number


def unbind_callbacks(callbacks: Sequence[TrainingCallback], number: int) -> None:
    """Undo :func:`bind_callbacks` (a Trainer whose construction failed never ran them)."""
    for cb in callbacks:
        if getattr(cb, _BOUND, None) == number:
            object.__delattr__(cb, _BOUND)


_missing = set(HOOK_NAMES) - set(vars(TrainingCallback))
assert not _missing, f"TrainingCallback lacks hooks {_missing}"
