"""Signals never cost a run its files or its exit status: ``model.pt`` and ``lifecycle.mmd`` are
written before the ``result``, the last line; a signal during start-up or the teardown is caught
and honoured after it, with exit status 130 or 143; once the status is decided a signal is the
default action. Real ``fsmtrain`` processes, real signals; the tests wait on what the process shows
(its log, its run directory, its signal handlers in /proc), never on a guessed time."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from resume_harness import REPO, forked
from signal_support import catches_signals, log_has, signal_if_alive, wait_for

from fsmtrain.app.config import load_config
from fsmtrain.app.job import train_seed
from fsmtrain.core.events import EventLog, read_events
from fsmtrain.tools.audit import audit_file

QUICK = REPO / "configs" / "quickstart.yaml"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"
# Small and quick: a few hundred samples, two epochs, no W&B start-up.
FAST = ("epochs=2", "wandb.enabled=false", "data_config.n_samples=512")
SLOW_TEARDOWN = "callbacks.extra=[{target: signal_support.SlowTeardown, kwargs: {seconds: 1.5}}]"
SLOW_EXIT = "callbacks.extra=[{target: signal_support.SlowExit, kwargs: {seconds: 1.5}}]"


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _finished_record(run: Path, reason: str) -> list[dict[str, Any]]:
    """The run's log ends with its ``result`` (for ``reason``), it audits, and no ``.lock`` stays."""
    events = read_events(run / "events.jsonl")
    assert events[-1]["event"] == "result", events[-1]
    assert events[-1]["payload"]["stop_reason"] == reason
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render(False)
    assert not (run / ".lock").exists()
    return events


# --- the outputs come before the result ---------------------------------------------------------------
def test_model_pt_and_lifecycle_mmd_exist_when_the_result_is_written(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed just after the ``result`` line leaves both files: they are written before it."""
    seen: dict[str, bool] = {}
    emit = EventLog.emit

    def watching(self: EventLog, event: str, **kw: Any) -> None:
        if event == "result" and self.path is not None:
            seen.update({name: (self.path.parent / name).exists() for name in ("model.pt", "lifecycle.mmd")})
        emit(self, event, **kw)

    monkeypatch.setattr(EventLog, "emit", watching)
    cfg = load_config(QUICK, list(FAST))
    run = train_seed(cfg, 0, tmp_path / "run")
    assert run.error is None and run.result is not None
    assert seen == {"model.pt": True, "lifecycle.mmd": True}
    _finished_record(tmp_path / "run", "completed")


# --- late signals -----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_process_exits_is_the_default_action_with_every_file_written(
        tmp_path: Path, sig: signal.Signals) -> None:
    """Once the command's status is decided the default actions are back: a signal during the exit
    handlers ends the process by the signal (a shell shows 128 + it), and every file is written."""
    proc = forked("train", str(QUICK), *_sets(*FAST, SLOW_EXIT), cwd=tmp_path)
    run = tmp_path / RUN
    wait_for(lambda: log_has(run, b'"event":"result"'), proc)
    wait_for(lambda: not catches_signals(proc.pid), proc)  # the status is decided: the exit handlers run
    assert signal_if_alive(proc, sig), "the process ended before its exit handler ran"
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -sig, (proc.returncode, err.decode()[-2000:])
    assert (run / "model.pt").is_file() and (run / "lifecycle.mmd").is_file()
    _finished_record(run, "completed")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_signal_at_any_moment_after_the_result_line_never_costs_a_file(tmp_path: Path) -> None:
    """Signals sent every few ms after the ``result`` line, the process stopped while it is decided
    whether it is still alive, until one comes too late: before the status is decided the process
    says it and exits 128 + it; after, it ends by the signal. The run's record is whole either way."""
    outcomes: list[tuple[float, str, int]] = []
    for i in range(12):
        delay = 0.006 * i
        sig = (signal.SIGTERM, signal.SIGINT)[i % 2]
        work = tmp_path / str(i)
        work.mkdir()
        proc = forked("train", str(QUICK), *_sets(*FAST), cwd=work)
        wait_for(lambda: log_has(work / RUN, b'"event":"result"'), proc)  # noqa: B023 (used at once)
        time.sleep(delay)
        sent = signal_if_alive(proc, sig)
        out, err = proc.communicate(timeout=120)
        if not sent:
            break
        outcomes.append((delay, sig.name, proc.returncode))
        assert proc.returncode in (128 + sig, -sig), (outcomes, err.decode()[-2000:])
        if proc.returncode == 128 + sig:
            said = out + err  # the run says one in its teardown; the process one after it (on stderr)
            assert f"{sig.name} received".encode() in said, said.decode()[-2000:]
        _finished_record(work / RUN, "completed")
    assert outcomes, "no signal reached a process after its result line"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_teardown_is_honoured_after_it(tmp_path: Path, sig: signal.Signals) -> None:
    """The teardown finishes (files, W&B, the result), then the process exits 128 + the signal; the
    run keeps its reason."""
    proc = forked("train", str(QUICK), *_sets(*FAST, SLOW_TEARDOWN), cwd=tmp_path)
    run = tmp_path / RUN
    wait_for(lambda: log_has(run, b'"to":"train_end"'), proc)  # the teardown has begun; it sleeps 1.5 s
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (proc.returncode, err.decode()[-2000:])
    assert f"signal {sig.name} received: it arrived during the teardown, after the run had ended COMPLETED" in \
        out.decode()
    assert (run / "model.pt").is_file() and (run / "lifecycle.mmd").is_file()
    _finished_record(run, "completed")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("apart", [0.06, 0.15, 0.3])
def test_two_sigints_apart_exit_130(tmp_path: Path, apart: float) -> None:
    """Two SIGINTs 60-300 ms apart: the second interrupts the run or its teardown, which still
    writes the ``result``; the process exits 130, or, when the second came once that status was
    decided, ends by SIGINT (the default action, which a shell shows as 130 too)."""
    proc = forked("train", str(QUICK), *_sets("epochs=50", "wandb.enabled=false", "data_config.n_samples=512"),
                    cwd=tmp_path)
    run = tmp_path / RUN
    wait_for(lambda: log_has(run, b'"event":"epoch"'), proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(apart)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err.decode()[-2000:])
    assert b"exit code 130" in out and b"Traceback" not in err
    _finished_record(run, "interrupted")


# --- start-up ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_stops_before_anything_is_claimed(tmp_path: Path, sig: signal.Signals) -> None:
    """A signal once the command catches its signals (its first act), while it still imports and
    builds: honoured before the run directory is claimed."""
    proc = forked("train", str(QUICK), *_sets(*FAST), cwd=tmp_path)
    wait_for(lambda: catches_signals(proc.pid), proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (proc.returncode, err.decode()[-2000:])
    assert f"seed 0: signal {sig.name} received before its run started; nothing was trained" in out.decode()
    assert f"exit code {128 + sig}" in out.decode() and "==" not in out.decode()
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_once_the_run_dir_is_claimed_leaves_no_lock_only_folder(tmp_path: Path, sig: signal.Signals) -> None:
    """Exit 128 + the signal, and either no run dir (the run never started, so its claim is let go
    with what it wrote) or a complete INTERRUPTED record: never a folder holding only ``.lock``."""
    proc = forked("train", str(QUICK), *_sets(*FAST), cwd=tmp_path)
    run = tmp_path / RUN
    wait_for(lambda: (run / ".lock").exists(), proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (proc.returncode, err.decode()[-2000:])
    if run.exists():
        _finished_record(run, "interrupted")
    else:
        assert not (tmp_path / "runs" / "quickstart").exists() or not any((tmp_path / "runs" / "quickstart").iterdir())


def test_the_console_script_owns_its_process_and_in_process_calls_give_the_handlers_back(tmp_path: Path) -> None:
    """``fsmtrain.cli.main`` called with arguments (as tests do) leaves the process's handlers as it
    found them."""
    from fsmtrain.cli import main

    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    assert main(["train", str(QUICK), "--run-dir", str(tmp_path), *_sets("epochs=1", "wandb.enabled=false",
                                                                         "data_config.n_samples=256")]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
