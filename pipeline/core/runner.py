"""Orders callbacks by ``(priority, tier, registration order)``, builds the per-hook dispatch tables once,
and checks each callback's definition, the slots' data flow and that a callback writes only its slots."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

from fsmtrain.core.checks import SlotWriteError, check_callback
from fsmtrain.core.context import Slot
from fsmtrain.core.hooks import Tier, TrainingCallback
from fsmtrain.core.lifecycle import EPOCH_HOOK_ORDER, HOOK_NAMES, HOOKS, HookScope
from fsmtrain.core.registry import callbacks_for_run

__all__ = ["CallbackOrderError", "CallbackRunner", "Handler"]

Handler = Callable[[Any], None]


class CallbackOrderError(ValueError):
    """A callback that reads a slot is ordered before the callback that writes it."""


@dataclass(frozen=True)
class Entry:
    callback: TrainingCallback
    tier: Tier
    seq: int


class CallbackRunner:
    def __init__(self, callbacks: Sequence[TrainingCallback] = (), *, include_global: bool = True,
                 validate: bool = True) -> None:
        entries = [Entry(cb, cb.tier, i) for i, cb in enumerate(callbacks)]
        if include_global:  # each run its own copies (fsmtrain.core.registry)
            local = frozenset(id(cb) for cb in callbacks)
            entries += [Entry(cb, Tier.GLOBAL, i) for i, cb in enumerate(callbacks_for_run(local))]
        self.entries = tuple(sorted(entries, key=lambda e: (e.callback.priority, int(e.tier), e.seq)))
        self.callbacks: tuple[TrainingCallback, ...] = tuple(e.callback for e in self.entries)
        for cb in self.callbacks:
            check_callback(cb, TrainingCallback)
        if validate:
            check_data_flow(self.entries)
        # By identity: callbacks need not hash.
        self._writes = {id(cb): frozenset(s.name for s in cb.writes) for cb in self.callbacks}
        self.ns: list[int] = [0] * len(self.callbacks)  # time spent in each callback, for the timing event
        names = [cb.name for cb in self.callbacks]
        self._labels = [n if n not in names[:i] else f"{n}#{i}" for i, n in enumerate(names)]
        self.failed_in: tuple[str, str] | None = None
        self.current: TrainingCallback | None = None  # the callback whose hook is running, for attribution
        step_written = {s.name for cb in self.callbacks for s in cb.writes if s.per_step}
        hooks = [_dispatched(cb, step_written) for cb in self.callbacks]
        self._tables: dict[str, tuple[tuple[int, Handler], ...]] = {
            hook: tuple((i, getattr(cb, hook)) for i, cb in enumerate(self.callbacks) if hook in hooks[i])
            for hook in HOOK_NAMES}
        self._dispatchers = {hook: self.dispatcher(hook) for hook in HOOK_NAMES}

    @property
    def may_stop_immediately(self) -> bool:
        """Some callback declares it may request an immediate stop (multi-process runs then agree per batch)."""
        return any(cb.may_stop_immediately for cb in self.callbacks)

    def table(self, hook: str) -> tuple[tuple[int, Handler], ...]:
        """``(callback position, bound hook)`` pairs in dispatch order."""
        return self._tables[hook]

    def has(self, hook: str) -> bool:
        return bool(self._tables[hook])

    def dispatcher(self, hook: str) -> Handler | None:
        """The function that fires ``hook`` on its callbacks (timed, attributed to ``current``); None for none."""
        table = self._tables[hook]
        if not table:
            return None
        ns, callbacks = self.ns, self.callbacks

        def dispatch(ctx: Any) -> None:
            outer = self.current  # a hook may dispatch another (checkpoint -> on_save_checkpoint)
            for i, fn in table:
                self.current = callbacks[i]
                t0 = perf_counter_ns()
                try:
                    fn(ctx)
                except BaseException:
                    self.failed_in = (callbacks[i].name, hook)
                    self.current = outer
                    raise
                ns[i] += perf_counter_ns() - t0
            self.current = outer

        return dispatch

    def fire(self, hook: str, ctx: Any) -> None:
        dispatch = self._dispatchers[hook]
        if dispatch is not None:
            dispatch(ctx)

    def check_write(self, slot: Slot[Any]) -> None:
        """Refuse a write by the running callback to a slot it did not declare (outside a hook: no check)."""
        cb = self.current
        if cb is None:
            return
        allowed = self._writes.get(id(cb))
        if allowed is None or slot.name in allowed:
            return
        hook = _running_hook(cb)
        declared = ", ".join(repr(n) for n in sorted(allowed)) or "none"
        raise SlotWriteError(
            f"{cb.name}.{hook} wrote slot {slot.name!r}, which {cb.name} does not declare in `writes` "
            f"(declared: {declared}); add it, e.g. writes = (..., Slot({slot.name!r})), so the runner can "
            f"order its readers after {cb.name}")

    def take_timings(self) -> dict[str, float]:
        """Seconds per callback since the last call (names made unique by position)."""
        out = {label: ns / 1e9 for label, ns in zip(self._labels, self.ns, strict=True)}
        self.ns[:] = [0] * len(self.ns)  # in place: the dispatchers hold this list
        return out

    def describe(self) -> list[dict[str, Any]]:
        """The resolved order, for the run log and the diagrams."""
        return [
            {"name": e.callback.name, "priority": e.callback.priority, "tier": e.tier.name.lower(),
             "hooks": list(e.callback.overridden_hooks())}
            for e in self.entries
        ]


def _running_hook(cb: TrainingCallback) -> str:
    """Which of ``cb``'s hooks is on the stack (only looked up to word an error)."""
    frame = inspect.currentframe()
    hooks = cb.overridden_hooks()
    while frame is not None:
        if frame.f_code.co_name in hooks and frame.f_locals.get("self") is cb:
            return frame.f_code.co_name
        frame = frame.f_back
    return "<hook>"


def _epoch_hooks(cb: TrainingCallback) -> list[str]:
    """The per-epoch hooks ``cb`` overrides, in the order they fire within an epoch."""
    return sorted((h for h in cb.overridden_hooks() if h in EPOCH_HOOK_ORDER), key=EPOCH_HOOK_ORDER.__getitem__)


_STEP_HOOKS = frozenset(h.name for h in HOOKS if h.scope is HookScope.STEP)


def _dispatched(cb: TrainingCallback, step_written: set[str]) -> tuple[str, ...]:
    """``cb``'s hooks to dispatch: a reader of per-step slots nobody writes has its step hooks left out."""
    hooks, reads = cb.overridden_hooks(), {s.name for s in cb.reads if s.per_step}
    return hooks if not reads or reads & step_written else tuple(h for h in hooks if h not in _STEP_HOOKS)


def _read_hooks(r: TrainingCallback, per_step: bool) -> list[str]:
    """The epoch hooks where ``r`` may read a slot (a per-step slot: its step hooks; else the others)."""
    hooks = _epoch_hooks(r)
    if not any(s.per_step for s in r.reads):
        return hooks
    return [h for h in hooks if (h in _STEP_HOOKS) == per_step]


def check_data_flow(entries: Sequence[Entry]) -> None:
    """Refuse an order in which a slot's reader may run before its writer in an epoch: the reader's earliest
    epoch hook must run after the writer's latest, by ``(hook position, dispatch position)``."""
    problems: list[str] = []
    for r_at, reader in enumerate(entries):
        r = reader.callback
        if not _epoch_hooks(r):
            continue
        read_names = {s.name for s in r.reads}
        for w_at, writer in enumerate(entries):
            w = writer.callback
            w_hooks = _epoch_hooks(w)
            if w is r or not w_hooks:
                continue
            for slot in w.writes:
                r_hooks = _read_hooks(r, slot.per_step)
                if not r_hooks or not (slot.name in read_names or r.reads_every_slot):
                    continue
                if (EPOCH_HOOK_ORDER[r_hooks[0]], r_at) <= (EPOCH_HOOK_ORDER[w_hooks[-1]], w_at):
                    problems.append(_order_problem(r, r_hooks[0], w, w_hooks[-1], slot.name))
    if problems:
        raise CallbackOrderError("callback order breaks the data flow:\n  " + "\n  ".join(problems))


def _order_problem(r: TrainingCallback, r_hook: str, w: TrainingCallback, w_hook: str, slot: str) -> str:
    every = " (it reads every slot)" if r.reads_every_slot and slot not in {s.name for s in r.reads} else ""
    head = f"{r.name} (priority {r.priority}) reads slot {slot!r}{every} in {r_hook}"
    if r_hook == w_hook:
        return (f"{head}, but its writer {w.name} (priority {w.priority}) only writes it in {w_hook}, "
                f"after {r.name} has run; give {r.name} a priority above {w.priority} "
                f"or {w.name} one below {r.priority}")
    return (f"{head}, which runs before its writer {w.name} (priority {w.priority}) may write it in {w_hook} "
            f"(every epoch hook a callback overrides counts as a place where it may read or write); "
            f"read it only in {w_hook} with a priority above {w.priority} (or a later hook), moving or "
            f"splitting off {r.name}'s earlier epoch hooks, or have {w.name} write it before {r_hook}")
