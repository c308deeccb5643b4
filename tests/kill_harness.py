"""Kill real ``fsmtrain`` processes at random moments, from start-up to exit, and continue the run
with ``fsmtrain resume`` until it completes (tests/test_kill_harness.py).

A moment is drawn per process from what that process will live through, and found by watching
what it shows, never by a guessed time:

- ``startup``: once it catches its signals (its handler for SIGTERM appears in /proc), plus a
  random delay: while it imports, builds and claims;
- ``claim``: once its run directory's ``.lock`` names it (claimed, the run not yet started);
- ``epoch``: once it has logged its ``j``-th epoch (of those it has left), plus a random delay;
- ``teardown``: once it has logged the move to ``train_end``, plus a few milliseconds: inside the
  teardown (outputs, ``result``);
- ``result``: once its ``result`` line is written: between the end of the log and the exit.

Most kills are SIGKILL; some are SIGTERM or SIGINT, after which the process must exit 143 or 130,
never 0, and die by the signal only after its ``result`` line (the process is stopped while it is
decided whether the signal still reaches it, so one that does is always owed its status). After each
kill the next process continues the run: ``fsmtrain resume`` when the folder holds a started run
(``train --resume`` when none started, which starts it or reuses the folder of one that never
started). A run killed before its first checkpoint was committed has its folder moved aside (kept
as evidence) and the run started again.
"""

from __future__ import annotations

import json
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from forked_cli import ForkedProcess
from resume_harness import forked
from signal_support import catches_signals, signal_if_alive

from fsmtrain.app.rundir import run_started

STAGES = ("startup", "claim", "epoch", "teardown", "result")


@dataclass
class Moment:
    stage: str
    delay: float
    sig: signal.Signals
    epoch: int = 1  # for ``epoch``: the how-manieth epoch this process logs

    def __str__(self) -> str:
        at = f"epoch {self.epoch} of this process" if self.stage == "epoch" else self.stage
        return f"{self.sig.name} at {at} + {self.delay * 1000:.0f} ms"


@dataclass
class KillLog:
    kills: list[str] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)
    moved_aside: list[Path] = field(default_factory=list)


def _count(run: Path, needle: bytes) -> int:
    try:
        return (run / "events.jsonl").read_bytes().count(needle)
    except OSError:
        return 0


def _committed(run: Path) -> bool:
    return _count(run, b'"event":"checkpoint"') > 0


def _epochs_done(run: Path) -> int:
    """How many epochs the log says are done (an epoch logged again after a resume counts once)."""
    try:
        lines = (run / "events.jsonl").read_bytes().splitlines()
    except OSError:
        return 0
    return max((json.loads(line)["epoch"] + 1 for line in lines if b'"event":"epoch"' in line), default=0)


def _finished(run: Path) -> bool:
    """The run's log has a completed result (all its epochs ran)."""
    return _count(run, b'"stop_reason":"completed"') > 0


# How likely each stage is, while epochs are left to train and once none are: a process that is not
# killed while it trains goes on to train them all, so its teardown comes with the last epochs.
_WHILE_TRAINING = {"startup": 1, "claim": 1, "epoch": 4, "teardown": 0, "result": 0}
_ONCE_TRAINED = {"startup": 1, "claim": 1, "epoch": 0, "teardown": 2, "result": 1}


def draw(rng: random.Random, run: Path, epochs: int) -> Moment:
    """A moment this process will live through: while epochs are left, mostly inside one; after
    that, mostly in the teardown of a resume that has nothing left to train."""
    left = 0 if _finished(run) else epochs - _epochs_done(run)
    weights = _WHILE_TRAINING if left > 0 else _ONCE_TRAINED
    stage = rng.choices(STAGES, weights=[weights[s] for s in STAGES])[0]
    sig = rng.choices((signal.SIGKILL, signal.SIGTERM, signal.SIGINT), weights=(6, 2, 2))[0]
    delay = {"startup": rng.uniform(0.0, 1.5), "claim": rng.uniform(0.0, 0.1), "epoch": rng.uniform(0.0, 0.15),
             "teardown": rng.uniform(0.0, 0.02), "result": 0.0}[stage]
    return Moment(stage, delay, sig, rng.randint(1, max(1, min(3, left))))


def _reached(moment: Moment, proc: ForkedProcess, run: Path, base: dict[str, int]) -> bool:
    if moment.stage == "startup":
        return catches_signals(proc.pid)
    if moment.stage == "claim":
        try:
            return (run / ".lock").read_text().strip() == str(proc.pid)
        except OSError:
            return False
    if moment.stage == "epoch":
        return _count(run, b'"event":"epoch"') >= base["epoch"] + moment.epoch
    if moment.stage == "teardown":
        return _count(run, b'"to":"train_end"') > base["end"]
    return _count(run, b'"event":"result"') > base["result"]


def _kill_at(moment: Moment, proc: ForkedProcess, run: Path, deadline: float) -> bool:
    """Signal ``proc`` at ``moment``; False when it exited first."""
    base = {"epoch": _count(run, b'"event":"epoch"'), "end": _count(run, b'"to":"train_end"'),
            "result": _count(run, b'"event":"result"')}
    while not _reached(moment, proc, run, base):
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"waited too long for {moment}")
        time.sleep(0.001)
    if moment.delay:
        time.sleep(moment.delay)
    return signal_if_alive(proc, moment.sig)


def _check_exit(moment: Moment, proc: ForkedProcess, err: bytes, wrote_result: bool) -> None:
    """A caught signal ends the process with 128 + its number. Once this process has written its
    ``result`` line (a short resume can get there before a delayed signal lands), the status is
    decided and the signal's default action may end it: a shell shows 128 + it as well."""
    if moment.sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL, (str(moment), proc.returncode, err.decode()[-2000:])
        return
    if wrote_result and proc.returncode == -moment.sig:
        return
    assert proc.returncode == 128 + moment.sig, (str(moment), proc.returncode, err.decode()[-2000:])


def _next_process(config: Path, cwd: Path, run: Path, sets: list[str], log: KillLog) -> ForkedProcess:
    if run_started(run):
        if not _committed(run):  # nothing to resume from (yet): start again, the killed folder kept aside
            aside = run.with_name(f"{run.name}.killed-{len(log.processes)}")
            run.rename(aside)
            log.moved_aside.append(aside)
            log.processes.append("train --resume (the killed run had no checkpoint)")
            return forked("train", str(config), *sets, "--resume", cwd=cwd)
        log.processes.append("resume")
        return forked("resume", str(run), *sets, cwd=cwd)
    log.processes.append("train --resume")
    return forked("train", str(config), *sets, "--resume", cwd=cwd)


def kill_until_done(config: Path, cwd: Path, run: Path, kills: int, seed: int, epochs: int, *overrides: str,
                    timeout: float = 900) -> KillLog:
    """Start the run, kill ``kills`` processes at random moments (``seed``), then continue it until a
    process completes it."""
    rng = random.Random(seed)
    sets = [a for o in overrides for a in ("--set", o)]
    deadline = time.monotonic() + timeout
    log = KillLog()
    while True:
        proc = _next_process(config, cwd, run, sets, log)
        if len(log.kills) < kills:
            moment = draw(rng, run, epochs)
            results = _count(run, b'"event":"result"')
            if _kill_at(moment, proc, run, deadline):
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if not (proc.returncode == 0 and moment.stage == "result"):  # else it exited as the signal went
                    _check_exit(moment, proc, err, _count(run, b'"event":"result"') > results)
                    log.kills.append(f"{moment} -> {proc.returncode} ({log.processes[-1]})")
                    continue
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))  # (again, if it ended: no output)
        assert proc.returncode == 0, (log.processes[-1], proc.returncode, err.decode()[-3000:])
        if len(log.kills) >= kills and _finished(run):
            return log
