"""A second Ctrl-C ends a hung batch at once, and a third is the default action: a real
``fsmtrain train`` whose training batch blocks forever in its second epoch (a user data module in
a temporary folder), real SIGINTs. The tests wait on what the process shows (its log, a file the
hung batch writes), never on a guessed time."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from resume_harness import REPO, fsmtrain
from signal_support import wait_for

from fsmtrain.core.events import read_events

QUICK = REPO / "configs" / "quickstart.yaml"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"

HANGING_DATA = '''
import threading
from pathlib import Path

from torch.utils.data import Dataset

from fsmtrain.training.data import make_loaders, synthetic_regression


class HangsInSecondEpoch(Dataset):
    """The training set; its first item of the second epoch blocks forever (a deadlocked loader)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        self.calls += 1
        if self.calls > len(self.inner):
            Path("hanging").touch()
            threading.Event().wait()
        return self.inner[i]


def build(*, batch_size, seed, **kwargs):
    train, val = synthetic_regression(batch_size=batch_size, seed=seed, **kwargs)
    return make_loaders(HangsInSecondEpoch(train.dataset), val.dataset, batch_size=batch_size, seed=seed)
'''

HANGING_TEARDOWN = '''
import threading

from fsmtrain import TrainingCallback


class HangsInTeardown(TrainingCallback):
    def on_train_end(self, run):
        threading.Event().wait()
'''


def _hung_train(tmp_path: Path, *sets: str) -> tuple[subprocess.Popen[bytes], Path]:
    (tmp_path / "hanging_data.py").write_text(HANGING_DATA, encoding="utf-8")
    (tmp_path / "hanging_teardown.py").write_text(HANGING_TEARDOWN, encoding="utf-8")
    overrides = ("epochs=3", "wandb.enabled=false", "data_config.n_samples=256", "data=hanging_data.build", *sets)
    proc = fsmtrain("train", str(QUICK), *[a for o in overrides for a in ("--set", o)], cwd=tmp_path)
    wait_for(lambda: (tmp_path / "hanging").exists(), proc)
    return proc, tmp_path / RUN


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_sigint_ends_a_hung_batch_and_the_log_ends_with_the_result(tmp_path: Path) -> None:
    proc, run = _hung_train(tmp_path)
    proc.send_signal(signal.SIGINT)  # asks for a stop at the next safe point, which the hung batch never reaches
    time.sleep(0.5)
    assert proc.poll() is None, "the first SIGINT only asks for a stop"
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 130, (proc.returncode, err.decode()[-2000:])
    assert took < 5.0, took
    last = read_events(run / "events.jsonl")[-1]
    assert last["event"] == "result", last
    assert last["payload"]["stop_reason"] == "interrupted", last
    assert b"exit code 130" in out, out.decode()[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_third_sigint_is_the_default_action(tmp_path: Path) -> None:
    """The second SIGINT ends the hung batch; the teardown hangs as well; the third ends the process
    by the signal."""
    proc, run = _hung_train(tmp_path, "callbacks.extra=[{target: hanging_teardown.HangsInTeardown}]")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: b'"to":"train_end"' in (run / "events.jsonl").read_bytes(), proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT
