"""One epoch numbering for everything a person reads: a 20-epoch quickstart's console,
checkpoint names, audit text and diagram all count epochs 1..20."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_20_epoch_quickstart_counts_epochs_from_1_everywhere(tmp_path: Path) -> None:
    train = subprocess.run([sys.executable, "-m", "fsmtrain", "train", str(REPO / "configs" / "quickstart.yaml"),
                            "--set", "wandb.enabled=false", "--set", "early_stopping.enabled=false"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert train.returncode == 0, train.stderr[-3000:]
    run = tmp_path / RUN
    audit = subprocess.run([sys.executable, "-m", "fsmtrain", "audit", str(run / "events.jsonl")],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    texts = {
        "console": train.stdout + train.stderr,
        "audit": audit.stdout,
        "diagram": (run / "lifecycle.mmd").read_text(),
        "checkpoints": " ".join(p.name for p in (run / "checkpoints").iterdir()),
    }
    for where, text in texts.items():
        numbers = [int(n) for n in re.findall(r"epoch[ _](\d+)", text)]
        assert numbers, f"{where} names no epoch"
        assert min(numbers) >= 1 and max(numbers) <= 20, f"{where}: {sorted(set(numbers))}"
        assert "epoch index" not in text, f"{where} shows a 0-based index to a person"
    rows = re.findall(r"^\s*(\d+)/20\b", texts["console"], flags=re.M)
    assert [int(r) for r in rows] == list(range(1, 21))
    assert "epoch_20.pt" in texts["checkpoints"] and "epoch_0.pt" not in texts["checkpoints"]
    assert "in epoch 20" in texts["diagram"]
    assert "epoch 20" in texts["audit"]
