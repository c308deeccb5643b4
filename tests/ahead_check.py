"""The audit and the report of a log, read in one process and with a second process reading ahead (a real fork).
Run as a script, in a fresh process (a fork is made only where no other thread runs):

    python tests/ahead_check.py EVENTS BLOCK AT [AT ...]

prints a JSON line for each share ``AT``: whether both readings left the same state, found and said the same
and drew the same page, and how many lines the second process took."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fsmtrain.tools.audit import auditor as auditor_module
from fsmtrain.tools.audit.ahead import Ahead
from fsmtrain.tools.audit.auditor import LogAuditor, read_log
from fsmtrain.tools.report.run import run_sections


def auditor_state(auditor: LogAuditor) -> str:
    """What a later line's checks read: each segment, the chain's pins and links, the counts."""
    chain = auditor.chain
    pins = [sorted(d.items()) for d in (chain.pins, chain._pins_before, chain._end_pins.mapping())]
    return repr(([vars(seg) for seg in auditor.segments], pins, chain.prev_raw, chain.prev_seq, chain.verified_links,
                 auditor.prev_seq, auditor.last_ts, auditor.last_ts_line, sorted(auditor.moves.items())))


def outcome(path: Path, ahead: Ahead | None) -> tuple[Any, ...]:
    """(what the auditor was left with, what it found, the page, the lines the second process took)."""
    auditor = read_log(path, verify_checkpoints=False, ahead=ahead)
    state, report = auditor_state(auditor), auditor.finish()
    said = [(f.check, f.message, f.line, f.severity.value) for f in report.findings]
    defaults = auditor_module.read_log.__kwdefaults__
    assert defaults is not None
    defaults["ahead"] = ahead  # (the report's reading)
    page = run_sections(path)
    return state, (said, repr(report.explanation)), page, auditor.ahead_lines


def main(events: str, block: str, *ats: str) -> None:
    path = Path(events)
    one = outcome(path, None)
    for at in ats:
        two = outcome(path, Ahead(at=float(at), min_bytes=0, block=int(block)))
        print(json.dumps({"at": float(at), "state": one[0] == two[0], "said": one[1] == two[1],
                          "page": one[2] == two[2], "ahead_lines": two[3], "findings": len(one[1][0])}))


if __name__ == "__main__":
    main(*sys.argv[1:])
