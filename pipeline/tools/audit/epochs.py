"""The events inside a run: epochs (losses, batches, slots, timings), exceptions, warnings and the
pruner's reports. Mixed into the auditor."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fsmtrain.core.context import epoch_number
from fsmtrain.core.lifecycle import PROGRAM, Action
from fsmtrain.tools.audit.content import number, slot_checks
from fsmtrain.tools.audit.ending import EndingChecks, Segment
from fsmtrain.tools.audit.verdict import Explanation, shown_epoch

__all__ = ["EpochChecks"]

_LOSSES = ("train_loss", "val_loss")
_SLOTS = slot_checks()
# The phase whose last step writes the ``epoch`` event.
_RECORD_PHASE = next(s.phase for s in PROGRAM if s.name == Action.RECORD_EPOCH.value).value


def _is_nonfinite(value: Any) -> bool:
    x = number(value)
    return x is not None and not math.isfinite(x)


class EpochChecks(EndingChecks):
    """Needs the auditor's ``ex``."""

    ex: Explanation

    def _epoch(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        epoch = rec["epoch"]
        if seg.phase != _RECORD_PHASE:
            return  # already reported as a phase mismatch
        if epoch != seg.next_epoch:
            if type(epoch) is int and epoch > seg.next_epoch:
                shown = range(epoch_number(seg.next_epoch), epoch_number(min(epoch, seg.next_epoch + 5)))
                missing = ", ".join(map(str, shown))
                self.bad("epochs", f"epoch {epoch_number(epoch)} follows epoch {epoch_number(seg.next_epoch - 1)}: "
                         f"epoch(s) {missing} missing", n)
            else:
                self.bad("epochs", f"epoch {shown_epoch(epoch)} again or out of order (expected "
                         f"{epoch_number(seg.next_epoch)})", n)
        p = rec["payload"]
        metrics = p.get("metrics") or {}
        cur = seg.next_epoch
        seg.epochs_seen.add(cur)
        if isinstance(metrics, dict):
            for key in _LOSSES:
                if _is_nonfinite(metrics.get(key)) and cur not in seg.nonfinite:
                    seg.nonfinite[cur] = (n, key)
            val = metrics.get("val_loss")
            x = number(val) if type(val) is not bool else None
            seg.vals.append((math.nan if x is None else x, n))
        else:
            seg.vals.append((math.nan, n))
        self._batches(n, rec, seg)
        slots = p.get("slots")
        if isinstance(slots, dict):
            for name, value in slots.items():
                check = _SLOTS.get(name)
                if check is not None and not check[0](value):
                    self.bad("slot", f"slot {name!r} is {value!r}; it is declared as {check[1]}", n)
        for source, target in ((p.get("phase_seconds"), self.ex.phase_seconds),
                               (p.get("callback_seconds"), self.ex.callback_seconds)):
            if isinstance(source, dict):
                for k, v in source.items():
                    if isinstance(v, (int, float)):
                        target[k] = target.get(k, 0.0) + v
        seconds = p.get("seconds")
        if isinstance(seconds, (int, float)):
            self.ex.total_epoch_seconds += seconds
        seg.next_epoch = cur + 1
        seg.epochs += 1

    def _batches(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        """The epoch's ``batches`` against the global steps it took (and its per-batch lines)."""
        batches, begin, val = rec["payload"].get("batches"), seg.step_begin, seg.step_val
        if type(batches) is not int or begin is None or val is None:
            return
        if val - begin != batches:
            self.bad("batches", f"the epoch says {batches} batches, but global_step went from {begin} to {val} in it",
                     n)
        elif seg.batch_lines and seg.batch_lines != batches - 1:
            self.bad("batches", f"the epoch says {batches} batches, but {seg.batch_lines} per-batch lines were logged "
                     f"(expected {batches - 1})", n)
        elif rec["global_step"] != val:
            self.bad("global_step", f"the epoch event says global_step {rec['global_step']}, validation began at {val}",
                     n)

    def _exception(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        failed = rec["payload"].get("failed_rank")
        seg.failed_rank = failed if type(failed) is int else None
        if seg.end_line is not None:
            return  # a teardown failure after train_end, logged for people
        seg.faulted = True
        if seg.exception is None:
            seg.exception = dict(rec["payload"])
            seg.exception_line = n

    def _warning(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        source = str(p.get("source", "?"))
        self.ex.warning_counts[source] = self.ex.warning_counts.get(source, 0) + 1
        if len(self.ex.warnings) < 100:
            self.ex.warnings.append({"line": n, "epoch": rec["epoch"], "source": source,
                                     "message": str(p.get("message", ""))})

    def _trial_report(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        seg.last_trial_report = (bool(rec["payload"].get("should_prune")), n)
