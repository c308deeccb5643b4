"""A SIGTERM that reaches ``fsmtrain train`` at any moment after its ``result`` line ends it with
128 + 15, as the README's signals paragraph promises: the process either says so and exits 143, or
(once its status is decided) is ended by the signal itself, which a shell shows as 143 too. It never
exits 0 as if no signal had come. Real processes and real signals, sent 0-50 ms after the line
appears in the log."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from resume_harness import REPO, forked
from signal_support import log_has, signal_if_alive, wait_for

from fsmtrain.core.events import read_events

QUICK = REPO / "configs" / "quickstart.yaml"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"
FAST = ("epochs=1", "wandb.enabled=false", "data_config.n_samples=256")
DELAYS_MS = (0, 0, 2, 5, 8, 10, 15, 20, 20, 25, 30, 40, 50)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_right_after_the_result_line_ends_the_process_with_143(tmp_path: Path) -> None:
    outcomes: list[tuple[int, int]] = []
    for i, delay_ms in enumerate(DELAYS_MS):
        work = tmp_path / str(i)
        work.mkdir()
        proc = forked("train", str(QUICK), *[a for o in FAST for a in ("--set", o)], cwd=work)
        wait_for(lambda: log_has(work / RUN, b'"event":"result"'), proc)  # noqa: B023 (used at once)
        time.sleep(delay_ms / 1000)
        sent = signal_if_alive(proc, signal.SIGTERM)  # False: it had exited already, no signal reached it
        out, err = proc.communicate(timeout=120)
        assert read_events(work / RUN / "events.jsonl")[-1]["payload"]["stop_reason"] == "completed"
        if not sent:
            assert proc.returncode == 0, err.decode()[-2000:]
            continue
        outcomes.append((delay_ms, proc.returncode))
        assert proc.returncode in (143, -signal.SIGTERM), (outcomes, err.decode()[-2000:])
        assert b"ignored due to race condition" not in err, err.decode()[-2000:]
        if proc.returncode == 143:
            assert b"SIGTERM received" in out + err, (out + err).decode()[-2000:]
    assert len(outcomes) >= 10, f"only {len(outcomes)} signals reached a live process: {outcomes}"
