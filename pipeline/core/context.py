"""Typed contexts handed to hooks (run, epoch, step) and typed slots through which callbacks share values:
a callback never reaches into the trainer."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from fsmtrain.core.lifecycle import Phase
from fsmtrain.core.stop import StopReason, budget_end

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


UNBOUNDED_EPOCHS = 1 << 31  # max_epochs of a run that only max_steps ends


def epoch_number(index: int) -> int:
    """The epoch number a person reads (1-based); the log's ``epoch`` keeps the 0-based index."""
    return index + 1


def validation_label(at: Mapping[str, Any], *more: str, last_step: int | None = None) -> str:
    """``validation 4 (epoch 4, step 32)``: Optuna's step with its epoch and global step; an attribute
    without ``validation`` (an older study) is named by Optuna's ``last_step`` alone."""
    known = "validation" in at
    info = [f"{k} {at[k]}" for k in ("epoch", "step") if known and isinstance(at.get(k), int)] + list(more)
    return (f"validation {at['validation']}" if known else f"Optuna step {last_step}") + \
        (f" ({', '.join(info)})" if info else "")


@dataclass(frozen=True)
class Slot(Generic[T]):
    """A named, typed value one callback writes and others read, cleared when the next epoch begins. A
    ``per_step`` slot holds a step's values, left out of the epoch's record."""

    name: str
    doc: str = ""
    per_step: bool = False

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class EventSink(Protocol):
    """Where contexts send structured events (``fsmtrain.core.events.EventLog`` in a real run)."""

    fsync: str  # which lines are made durable as they are written: "commits", "every" or "never"

    def emit(self, event: str, *, level: str = "info", **fields: Any) -> bool | None:
        """Write one event; True only for a durable line whose fsync was deferred (``defer_sync``)."""

    def enabled_for(self, level: str) -> bool: ...

    def sync(self) -> None: ...


@dataclass(frozen=True)
class StopRequest:
    reason: StopReason
    source: str
    message: str
    immediate: bool
    epoch: int
    global_step: int
    phase: Phase


# The epoch metrics the engine and the driver write (a user's metric may not take these names).
BUILTIN_METRICS: frozenset[str] = frozenset({"lr", "train_loss", "val_loss"})


@dataclass
class EpochRecord:
    """One finished epoch as the history keeps it."""

    epoch: int
    metrics: dict[str, float]
    slots: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def train_loss(self) -> float:
        return self.metrics.get("train_loss", math.nan)

    @property
    def val_loss(self) -> float:
        return self.metrics.get("val_loss", math.nan)


@dataclass(eq=False, repr=False)
class RunContext:
    """State of one run. ``epoch``: the 0-based index of the current (or next) epoch."""

    run_id: str
    max_epochs: int
    events: EventSink
    _: KW_ONLY
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    run_dir: Any = None
    dry_run: bool = False  # replaying: no model, callbacks must not touch one
    max_steps: int | None = None  # the run also ends at this global step
    val_every_n_steps: int | None = None  # validation also inside an epoch, after every N-th global step
    validations: int = field(default=0, init=False)  # validations done (a resume continues the count)
    scaler: Any = field(default=None, init=False)  # mixed precision's loss scaler, checkpointed with the run
    exact_metrics: Any = field(default=None, init=False)  # the exact metrics' state, checkpointed with the run
    epoch: int = field(default=0, init=False)
    global_step: int = field(default=0, init=False)
    stop: StopRequest | None = field(default=None, init=False)
    pending_signal: int | None = field(default=None, init=False)  # set by a signal handler; the engine acts on it
    # A resumed run's position inside its first epoch (a checkpoint at a step); its first epoch takes it.
    resume_at: dict[str, Any] | None = field(default=None, init=False)
    # The driver's state of the epoch in progress (its sums so far), for a checkpoint at a step.
    epoch_state: Callable[[], dict[str, Any]] = field(default_factory=lambda: dict, init=False)
    history: list[EpochRecord] = field(default_factory=list, init=False)
    extras: dict[str, Any] = field(default_factory=dict, init=False)  # e.g. the Optuna trial, the run config
    # Set by the engine from its runner (the checkpoint store fires hooks through ``dispatch``).
    callbacks: tuple[Any, ...] = field(default=(), init=False)
    dispatch: Callable[[str, Any], None] = field(default_factory=lambda: lambda hook, ctx: None, init=False)
    slot_guard: Callable[[Slot[Any]], None] | None = field(default=None, init=False)
    _phase_of: Callable[[], Phase] = field(default_factory=lambda: lambda: Phase.CREATED, init=False)
    _slots: dict[str, Any] = field(default_factory=dict, init=False)
    _step_slots: set[str] = field(default_factory=set, init=False)

    def budget_left(self) -> bool:
        """Epochs remain, and steps too when ``max_steps`` is set."""
        return self.epoch < self.max_epochs and (self.max_steps is None or self.global_step < self.max_steps)

    @property
    def stop_reason(self) -> StopReason:
        """Why the run ends (so far): the stop requested, or the budget (epochs or max_steps) spent."""
        stop = self.stop
        return stop.reason if stop is not None else budget_end(self.max_epochs, self.max_steps, self.global_step)[0]

    def ends_after(self, index: int) -> bool:
        """At epoch ``index``'s end: it is the run's last (a stop, or the budget spent)."""
        return (self.stop is not None or index + 1 >= self.max_epochs
                or (self.max_steps is not None and self.global_step >= self.max_steps))

    @property
    def phase(self) -> Phase:
        """The lifecycle machine's state, read from the machine (kept nowhere else)."""
        return self._phase_of()

    def bind_phase(self, phase_of: Callable[[], Phase]) -> None:
        self._phase_of = phase_of

    def get(self, slot: Slot[T]) -> T | None:
        return cast("T | None", self._slots.get(slot.name))

    def set(self, slot: Slot[T], value: T) -> None:
        guard = self.slot_guard
        if guard is not None:
            guard(slot)
        if slot.per_step:
            self._step_slots.add(slot.name)
        self._slots[slot.name] = value

    def slot_values(self) -> dict[str, Any]:
        """The epoch's slot values (per-step slots left out)."""
        return {k: v for k, v in self._slots.items() if k not in self._step_slots}

    def clear_epoch_slots(self) -> None:
        self._slots.clear()

    def request_stop(self, reason: StopReason, source: str, message: str = "", immediate: bool = False) -> bool:
        """Ask the machine to stop; whether this request won (the first, unless a later one outranks it)."""
        current = self.stop
        accepted = current is None or (reason.outranks(current.reason) and self.phase is not Phase.TRAIN_END)
        if accepted:
            self.stop = StopRequest(reason, source, message, immediate or bool(current and current.immediate),
                                    self.epoch, self.global_step, self.phase)
        extra = {"overrides": current.reason.value} if accepted and current is not None else {}
        self.emit("stop_request", reason=reason.value, source=source, message=message, immediate=immediate,
                  accepted=accepted, **extra)
        return accepted

    def force_stop(self, reason: StopReason, source: str, message: str) -> None:
        """A fault overrides any earlier request: the run now ends for ``reason``."""
        self.stop = StopRequest(reason, source, message, True, self.epoch, self.global_step, self.phase)
        self.emit("stop_request", reason=reason.value, source=source, message=message, immediate=True, accepted=True)

    def emit(self, event: str, *, level: str = "info", **payload: Any) -> None:
        self.events.emit(event, level=level, phase=self.phase.value, epoch=self.epoch,
                         global_step=self.global_step, payload=payload)

    def emit_at_log_position(self, event: str, *, level: str = "info", defer_sync: bool = False,
                             **payload: Any) -> bool:
        """``emit`` from another thread: the line takes the position of the log's previous line. True when
        ``defer_sync`` left a durable line unsynced."""
        needs_sync = self.events.emit(event, level=level, phase=None, epoch=None, global_step=None,
                                      payload=payload, at_last_line=True, defer_sync=defer_sync)
        return needs_sync is True

    def warn(self, source: str, message: str, **data: Any) -> None:
        """A warning a person should see: logged as a ``warning`` event and on the console."""
        self.emit("warning", level="warning", source=source, message=message, **data)

    def best(self, key: str = "val_loss", mode: str = "min") -> float:
        values = [r.metrics[key] for r in self.history if key in r.metrics and math.isfinite(r.metrics[key])]
        return (min if mode == "min" else max)(values, default=math.nan)


class _Delegating:
    """Shared conveniences of epoch and step contexts: everything run-wide goes to ``run``."""

    run: RunContext

    def get(self, slot: Slot[T]) -> T | None:
        return self.run.get(slot)

    def set(self, slot: Slot[T], value: T) -> None:
        self.run.set(slot, value)

    def request_stop(self, reason: StopReason, source: str, message: str = "", immediate: bool = False) -> bool:
        return self.run.request_stop(reason, source, message, immediate)

    def warn(self, source: str, message: str, **data: Any) -> None:
        self.run.warn(source, message, **data)

    def emit(self, event: str, *, level: str = "info", **payload: Any) -> None:
        self.run.emit(event, level=level, **payload)


class EpochContext(_Delegating):
    """One epoch; ``metrics`` fill as it runs (``lr``, then ``train_loss``, then validation's)."""

    def __init__(self, run: RunContext, index: int) -> None:
        self.run = run
        self.index = index
        self.metrics: dict[str, float] = {}
        self.batches = 0
        self.resumed: dict[str, Any] | None = None  # where a resume continues it: {"batch", "epoch_state"}
        self.inside = False  # the validation in progress (or last) is one inside the epoch: batches remain

    @property
    def number(self) -> int:
        return epoch_number(self.index)

    @property
    def train_loss(self) -> float | None:
        return self.metrics.get("train_loss")

    @property
    def val_loss(self) -> float | None:
        return self.metrics.get("val_loss")

    @property
    def lr(self) -> float | None:
        return self.metrics.get("lr")


class StepContext(_Delegating):
    """One training batch; a skip flag leaves out backward, the optimizer step or zero_grad for it."""

    __slots__ = ("batch", "batch_index", "epoch", "last_batch", "loss", "output", "run", "skip_backward",
                 "skip_optimizer_step", "skip_zero_grad")

    def __init__(self, run: RunContext, epoch: EpochContext) -> None:
        self.run = run
        self.epoch = epoch
        self.reset(-1, None, False)

    def reset(self, batch_index: int, batch: Any, last_batch: bool) -> None:
        self.batch_index = batch_index
        self.batch = batch
        self.output: Any = None
        self.loss: torch.Tensor | None = None
        self.skip_backward = False
        self.skip_optimizer_step = False
        self.skip_zero_grad = False
        self.last_batch = last_batch


class ValStepContext(_Delegating):
    """One validation batch: after it, ``output`` and ``loss`` (detached) are set."""

    def __init__(self, run: RunContext, epoch: EpochContext) -> None:
        self.run = run
        self.epoch = epoch
        self.reset(-1, None)

    def reset(self, batch_index: int, batch: Any) -> None:
        self.batch_index = batch_index
        self.batch = batch
        self.output: Any = None
        self.loss: Any = None


@dataclass
class CheckpointContext:
    """Handed to ``on_save_checkpoint`` (fill ``state``) and ``on_load_checkpoint`` (read it)."""

    run: RunContext
    state: dict[str, Any]
    path: str | None = None


@dataclass
class FaultContext:
    """Handed to ``on_exception``: the exception that ended the run and where it struck."""

    run: RunContext
    exception: BaseException
    phase: Phase
