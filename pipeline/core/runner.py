"""Orders callbacks, builds the per-hook dispatch tables once, and checks the data flow.

Order: ``(priority, tier, registration order)`` with tier CORE < USER < GLOBAL. A hook a callback
does not override is not in its table, so it costs nothing at dispatch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

from pipeline.core.hooks import Tier, TrainingCallback
from pipeline.core.lifecycle import EPOCH_HOOK_ORDER, HOOK_NAMES
from pipeline.core.registry import GlobalHandle, global_callbacks, register_global_callback

__all__ = ["CallbackOrderError", "CallbackRunner", "GlobalHandle", "Handler", "register_global_callback"]

Handler = Callable[[Any], None]


class CallbackOrderError(ValueError):
    """A callback that reads a slot is ordered before the callback that writes it."""


@dataclass(frozen=True)
class Entry:
    callback: TrainingCallback
    tier: Tier
    seq: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.callback.priority, int(self.tier), self.seq)


class CallbackRunner:
    def __init__(
        self,
        callbacks: Sequence[TrainingCallback] = (),
        *,
        include_global: bool = True,
        validate: bool = True,
    ) -> None:
        entries = [Entry(cb, cb.tier, i) for i, cb in enumerate(callbacks)]
        if include_global:
            local = {id(cb) for cb in callbacks}
            entries += [
                Entry(cb, Tier.GLOBAL, i) for i, cb in enumerate(global_callbacks()) if id(cb) not in local
            ]
        self.entries: tuple[Entry, ...] = tuple(sorted(entries, key=lambda e: e.key))
        self.callbacks: tuple[TrainingCallback, ...] = tuple(e.callback for e in self.entries)
        if validate:
            check_data_flow(self.entries)
        # Nanoseconds spent in each callback (by position), for the per-epoch timing event.
        self.ns: list[int] = [0] * len(self.callbacks)
        seen: set[str] = set()
        self._labels: list[str] = []
        for i, cb in enumerate(self.callbacks):
            self._labels.append(cb.name if cb.name not in seen else f"{cb.name}#{i}")
            seen.add(cb.name)
        self.failed_in: tuple[str, str] | None = None
        self.current: TrainingCallback | None = None  # the callback whose hook is running, for attribution
        self._tables: dict[str, tuple[tuple[int, Handler], ...]] = {
            hook: tuple(
                (i, getattr(cb, hook)) for i, cb in enumerate(self.callbacks) if hook in cb.overridden_hooks()
            )
            for hook in HOOK_NAMES
        }
        self._dispatchers = {hook: self.dispatcher(hook) for hook in HOOK_NAMES}

    def table(self, hook: str) -> tuple[tuple[int, Handler], ...]:
        """``(callback position, bound hook)`` pairs in dispatch order."""
        return self._tables[hook]

    def has(self, hook: str) -> bool:
        return bool(self._tables[hook])

    def dispatcher(self, hook: str) -> Handler | None:
        """The function that fires ``hook`` on its callbacks (timed, attributed to ``current``), or
        None when no callback overrides it. Built once, so per-batch dispatch does no lookups."""
        table = self._tables[hook]
        if not table:
            return None
        ns, callbacks = self.ns, self.callbacks

        def dispatch(ctx: Any) -> None:
            for i, fn in table:
                self.current = callbacks[i]
                t0 = perf_counter_ns()
                try:
                    fn(ctx)
                except BaseException:
                    self.failed_in = (callbacks[i].name, hook)
                    self.current = None
                    raise
                ns[i] += perf_counter_ns() - t0
            self.current = None

        return dispatch

    def fire(self, hook: str, ctx: Any) -> None:
        dispatch = self._dispatchers[hook]
        if dispatch is not None:
            dispatch(ctx)

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


def _last_epoch_hook(cb: TrainingCallback) -> str | None:
    hooks = [h for h in cb.overridden_hooks() if h in EPOCH_HOOK_ORDER]
    return max(hooks, key=EPOCH_HOOK_ORDER.__getitem__) if hooks else None


def check_data_flow(entries: Sequence[Entry]) -> None:
    """Refuse an order in which a reader of a slot runs before its writer in the same epoch.

    A callback reads its slots on, and has written them by, the last per-epoch hook it overrides.
    The reader runs first when that hook comes earlier in the epoch, or it is the same hook and the
    reader is ordered earlier. A reader with no writer at all is fine: it gets ``None``.
    """
    position = {id(e.callback): n for n, e in enumerate(entries)}
    problems: list[str] = []
    for reader in entries:
        r_hook = _last_epoch_hook(reader.callback)
        if r_hook is None:
            continue
        for slot in reader.callback.reads:
            for writer in entries:
                if writer is reader or slot not in writer.callback.writes:
                    continue
                w_hook = _last_epoch_hook(writer.callback)
                if w_hook is None:
                    continue
                r_at = (EPOCH_HOOK_ORDER[r_hook], position[id(reader.callback)])
                w_at = (EPOCH_HOOK_ORDER[w_hook], position[id(writer.callback)])
                if r_at < w_at:
                    r, w = reader.callback, writer.callback
                    problems.append(
                        f"{r.name} (priority {r.priority}) reads slot {slot.name!r} in {r_hook}, "
                        f"but its writer {w.name} (priority {w.priority}) only writes it in {w_hook}, "
                        f"after {r.name} has run; give {r.name} a priority above {w.priority} "
                        f"or {w.name} one below {r.priority}"
                    )
    if problems:
        raise CallbackOrderError("callback order breaks the data flow:\n  " + "\n  ".join(problems))
