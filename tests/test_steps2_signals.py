"""The pre-emption notice is configurable (``preemption.signals``; SLURM's ``--signal`` may send
SIGUSR2): a configured SIGUSR2 mid-epoch saves the last step, names itself in the ``result``, exits
143 and resumes bit for bit; a signal that is no notice is a config error naming the field."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from steps_support import RUN, events, fsmtrain, preempted, same_bits, weights, write_config
from torch import nn

from fsmtrain import Trainer
from fsmtrain.app.config import ConfigError, load_config
from fsmtrain.core.context import RunContext
from fsmtrain.core.signals import install, preemption_signals, stop_on_signals, uninstall

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def test_a_signal_that_is_no_notice_is_a_config_error_naming_the_field() -> None:
    assert load_config(QUICKSTART, ["preemption.signals=[USR2, SIGTERM]"]).preemption.signals == \
        ["SIGUSR2", "SIGTERM"]
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, ["preemption.signals=[SIGKILL]"])
    said = str(info.value)
    assert "preemption.signals" in said and "'SIGKILL'" in said and "SIGUSR2" in said
    with pytest.raises(ValueError, match="got 'USR3'"):
        model = nn.Linear(1, 1)
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), [(torch.ones(1, 1),) * 2],
                preemption_signals=["USR3"])


def test_the_block_takes_the_configured_notices_and_gives_back_the_others() -> None:
    uninstall()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    signals = install()
    assert signals is not None
    try:
        run = RunContext("r", 1, None)  # type: ignore[arg-type]  # no events are sent
        with stop_on_signals(run, preemption_signals(["SIGTERM", "USR2"])):
            assert signal.getsignal(signal.SIGUSR2) == signals.handle
            assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]
            assert signal.getsignal(signal.SIGTERM) == signals.handle
        assert signal.getsignal(signal.SIGUSR1) == signals.handle
        assert signal.getsignal(signal.SIGUSR2) == before[signal.SIGUSR2]
    finally:
        uninstall()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_configured_sigusr2_saves_the_last_step_exits_143_and_resumes_bit_identical(tmp_path: Path) -> None:
    config = write_config(tmp_path, **{"checkpoint.background": False, "preemption.signals": ["SIGTERM", "USR2"],
                                     "epochs": 2})
    (tmp_path / "ref").mkdir()
    done = fsmtrain(tmp_path / "ref", "train", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "run").mkdir()
    proc, _ = preempted(tmp_path / "run", config, signal.SIGUSR2, at_step=8)
    out = proc.output()[1]  # its stderr
    assert proc.returncode == 143, out[-3000:]
    run_dir = tmp_path / "run" / RUN
    log = events(run_dir)
    result = next(e for e in log if e["event"] == "result")["payload"]
    assert result["stop_reason"] == "interrupted" and result["stop_source"] == "signal SIGUSR2"
    end_step = next(e for e in log if e["event"] == "transition" and e["to"] == "train_end")["global_step"]
    saved = [e["payload"]["step"] for e in log if e["event"] == "checkpoint" and e["payload"].get("kind") == "step"]
    assert saved == [end_step] and end_step % 26, "the state after the last step, mid-epoch"
    resumed = fsmtrain(tmp_path / "run", "resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert same_bits(weights(tmp_path / "ref" / RUN), weights(run_dir))
