"""What a replay did (:class:`ReplayResult`), and the first event where its trace departs from a
recording's (:func:`compare_traces`), once :func:`normalize_event` dropped what may differ."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsmtrain.core.context import EpochRecord
from fsmtrain.core.engine import LAUNCH_FACTS
from fsmtrain.core.events import jsonable
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.result import TrainResult
from fsmtrain.core.stop import StopReason

__all__ = ["Divergence", "ReplayResult", "comparable_recorded", "compare_traces", "normalize_event"]

# What a comparison ignores: identity and wall-clock fields, and the run's setup (the replay's input).
_VOLATILE_KEYS = ("seq", "ts", "run_id", "prev", "seal")
_IGNORED_PAYLOAD: Mapping[str, tuple[str, ...]] = {
    "run_start": ("callbacks", "config", "strict", "seed", "resumed_from", "chain", "user_folders",
                  *sorted(LAUNCH_FACTS)),
    "callback_settings": ("settings",),  # configuration, like run_start's config: a what-if may change it
    "epoch": ("seconds", "phase_seconds", "callback_seconds"),
    "exception": ("traceback", "symptom"),  # where and how a collective broke is the machine's, not the run's
}
# Events the engine and the run context write themselves; other kinds come from callbacks.
_CORE_EVENTS = frozenset({"run_start", "transition", "stop_request", "epoch", "validation", "warning", "exception",
                          "result"})


@dataclass(frozen=True)
class Divergence:
    """The first event where two traces differ. ``expected``/``found`` are the normalized events
    (``None`` when that trace has already ended); ``seq`` is the recorded line's own ``seq``."""

    index: int
    expected: Mapping[str, Any] | None
    found: Mapping[str, Any] | None
    seq: int | None = None

    def describe(self) -> str:
        exp, got = ("end of trace" if e is None else json.dumps(e, sort_keys=True) for e in (self.expected, self.found))
        at = f"event #{self.index}" + (f" (seq {self.seq})" if self.seq is not None else "")
        return f"first difference at {at}:\n  expected: {exp}\n  found:    {got}"


@dataclass
class ReplayResult:
    """What a replay did. ``stop_reason`` and ``stop_epoch`` are ``None`` when the replay outlived
    its data (``exhausted_after`` epochs) without stopping: what it would have done is unknown."""

    trace: list[dict[str, Any]]
    stop_reason: StopReason | None
    stop_epoch: int | None
    history: list[EpochRecord]
    result: TrainResult | None
    exhausted_after: int | None = None
    divergence: Divergence | None = None
    dry_events: list[dict[str, Any]] = field(default_factory=list)
    recorded_epochs: int | None = None
    recorded_stop_reason: StopReason | None = None
    recorded_best_val_loss: float | None = None
    overrides: tuple[str, ...] = ()
    unknown_prune_steps: tuple[int, ...] = ()
    error: Exception | None = None  # what a replayed callback raised (the run then ends with ERROR)
    unknown_why: str | None = None  # what the replay needed besides more epochs, when the recording lacked it

    @property
    def slots(self) -> list[dict[str, Any]]:
        """Slot values at the end of each replayed epoch."""
        return [dict(r.slots) for r in self.history]

    @property
    def epochs_completed(self) -> int:
        return len(self.history)

    @property
    def best_val_loss(self) -> float:
        return min((r.val_loss for r in self.history if math.isfinite(r.val_loss)), default=math.inf)

    @property
    def stopped_by(self) -> str | None:
        return self.result.stop.source if self.result is not None and self.result.stop is not None else None

    @property
    def matches(self) -> bool:
        return self.divergence is None

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.trace if e["event"] == kind]

    def warnings(self, source: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events("warning") if source is None or e["payload"].get("source") == source]

    def what_if(self) -> str:
        """One sentence: what this replay says the run would have done."""
        setting = ", ".join(f"{k.rsplit('.', 1)[-1].replace('_', ' ')} {v}"
                            for k, _, v in (ov.partition("=") for ov in self.overrides))
        prefix = f"with {setting} this run" if setting else "this run"
        if self.stop_reason is None:
            return (f"{prefix} would not have stopped within the {self.exhausted_after} recorded epochs; "
                    f"its stop reason is unknown beyond epoch {self.exhausted_after}, where the recording ends"
                    + (f" ({self.unknown_why})" if self.unknown_why else ""))
        assert self.stop_epoch is not None
        sentence = f"{prefix} would have stopped at epoch {self.stop_epoch} with {self.stop_reason.name}"
        if self.recorded_epochs is not None:
            delta = self.recorded_epochs - self.stop_epoch
            plural = "s" if abs(delta) != 1 else ""
            sentence += (f", saving {delta} epoch{plural}" if delta > 0 else f", running {-delta} more epoch{plural}"
                         if delta < 0 else ", the same number of epochs as recorded")
            if self.recorded_stop_reason is not None:
                sentence += f" (recorded: {self.recorded_epochs} epochs, {self.recorded_stop_reason.name})"
        return sentence

    def to_json(self) -> dict[str, Any]:
        d = self.divergence
        return dict(jsonable({  # enums as their values, tuples as lists
            "overrides": self.overrides, "stop_reason": self.stop_reason, "stop_epoch": self.stop_epoch,
            "stopped_by": self.stopped_by, "exhausted_after": self.exhausted_after,
            "epochs_completed": self.epochs_completed, "best_val_loss": self.best_val_loss,
            "recorded_epochs": self.recorded_epochs, "recorded_stop_reason": self.recorded_stop_reason,
            "recorded_best_val_loss": self.recorded_best_val_loss, "matches_recording": self.matches,
            "divergence": None if d is None else {"index": d.index, "seq": d.seq, "expected": d.expected,
                                                  "found": d.found},
            "what_if": self.what_if(), "slots": self.slots, "unknown_prune_steps": self.unknown_prune_steps,
        }))


def normalize_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """An event without what legitimately differs between two runs of the same decisions."""
    out = {k: v for k, v in event.items() if k not in _VOLATILE_KEYS}
    ignored = _IGNORED_PAYLOAD.get(str(event.get("event")), ())
    payload = event.get("payload")
    if ignored and isinstance(payload, Mapping):
        out["payload"] = {k: v for k, v in payload.items() if k not in ignored}
    return out


def compare_traces(expected: Sequence[Mapping[str, Any]], found: Sequence[Mapping[str, Any]]) -> Divergence | None:
    """The first index where the normalized traces differ, or ``None`` when they are the same."""
    for i in range(max(len(expected), len(found))):
        exp = normalize_event(expected[i]) if i < len(expected) else None
        got = normalize_event(found[i]) if i < len(found) else None
        if exp != got:
            seq = expected[i].get("seq") if i < len(expected) else None
            return Divergence(i, exp, got, seq if isinstance(seq, int) else None)
    return None


def comparable_recorded(events: Sequence[Mapping[str, Any]], dry: Sequence[TrainingCallback],
                        emitted_kinds: set[str]) -> list[Mapping[str, Any]]:
    """The recorded events a replay can reproduce: the engine's, and the kinds the replay wrote,
    except those a dry callback wrote (by the source they name)."""
    dry_names = {cb.name for cb in dry}
    return [e for e in events if (e.get("event") in _CORE_EVENTS or e.get("event") in emitted_kinds)
            and not (isinstance(p := e.get("payload") or {}, Mapping) and p.get("source") in dry_names)]
