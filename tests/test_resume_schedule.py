"""Resume keeps the schedule: an extension of a run whose scheduler is planned for its epochs (the
quickstart's cosine, ``T_max: 20``, resumed with ``--set epochs=30``) is refused with the fix
named, and the fix re-plans it visibly; never a silent restart of the schedule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fsmtrain.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
SMALL = ("--set", "data_config.n_samples=256", "--set", "wandb.enabled=false", "--set", "early_stopping.enabled=false")


def _epochs(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_quickstart_cosine_extended_from_20_to_30_epochs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", QUICKSTART, *SMALL, "--run-dir", "runs"]) == 0
    run = tmp_path / "runs" / "mlp-regression-seed0"
    before = (run / "events.jsonl").read_bytes()
    capsys.readouterr()

    assert main(["resume", str(run), "--set", "epochs=30"]) == 2  # refused, and the run is untouched
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert ("fsmtrain resume: --set epochs=30: scheduler_config.T_max: expected a horizon that covers the 30 epochs, "
            "or no extension; found 20, the 20 epochs the run was planned for") in err
    assert f"re-plan it: fsmtrain resume {run} --set epochs=30 --set scheduler_config.T_max=30" in err
    assert (run / "events.jsonl").read_bytes() == before

    assert main(["resume", str(run), "--set", "epochs=30", "--set", "scheduler_config.T_max=30"]) == 0
    out = capsys.readouterr()
    assert "scheduler_config.T_max re-planned from 20 to 30" in out.err  # said on the console...
    events = _epochs(run)
    (note,) = [e for e in events if e["event"] == "schedule_replanned"]  # ...and in the log
    assert note["payload"]["before"] == 20 and note["payload"]["after"] == 30
    lrs = {e["epoch"] + 1: e["payload"]["metrics"]["lr"] for e in events if e["event"] == "epoch"}
    assert sorted(lrs) == list(range(1, 31))
    for epoch in range(21, 31):  # the cosine planned for 30 epochs from the start
        assert lrs[epoch] == pytest.approx(3e-3 * (1 + math.cos(math.pi * (epoch - 1) / 30)) / 2, rel=1e-9)
    assert all(lrs[e + 1] < lrs[e] for e in range(21, 30))  # it ends; it never climbs back
    assert lrs[20] == pytest.approx(3e-3 * (1 + math.cos(math.pi * 19 / 20)) / 2)  # the trained epochs kept theirs
    for epoch in range(21, 31):  # the curve it printed is the one it trained with
        assert f"{epoch} {lrs[epoch]:.2e}" in note["payload"]["message"]
    assert main(["audit", str(run)]) == 0
