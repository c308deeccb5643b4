"""A Ctrl-C is a request, not a fault: the console of an interrupted ``fsmtrain train`` shows no
``[error]`` line, and names the interrupt; the log still records the ``exception`` event (with
``interrupt: true``) that replay and the audit read. A real process and a real SIGINT."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from resume_harness import REPO, fsmtrain
from signal_support import log_has, wait_for

from fsmtrain.core.events import read_events
from fsmtrain.tools.audit import audit_file

QUICK = REPO / "configs" / "quickstart.yaml"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_prints_no_error_line_and_the_result_names_the_interrupt(tmp_path: Path) -> None:
    sets = ("epochs=200", "wandb.enabled=false", "data_config.n_samples=512")
    proc = fsmtrain("train", str(QUICK), *[a for o in sets for a in ("--set", o)], cwd=tmp_path)
    run = tmp_path / RUN
    wait_for(lambda: log_has(run, b'"event":"epoch"'), proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    console = (out + err).decode()
    assert proc.returncode == 130, console[-3000:]
    assert "[error" not in console, console[-3000:]
    assert "Traceback" not in console, console[-3000:]
    assert "INTERRUPTED" in console and "SIGINT" in console, console[-3000:]

    events = read_events(run / "events.jsonl")
    assert events[-1]["event"] == "result" and events[-1]["payload"]["stop_reason"] == "interrupted"
    faults = [e for e in events if e["event"] == "exception"]
    assert len(faults) == 1 and faults[0]["payload"]["interrupt"] is True, faults
    assert faults[0]["payload"]["source"] == "signal SIGINT", faults
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render(False)
