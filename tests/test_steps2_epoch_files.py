"""File names and contents agree (issue 41, "Also found"): ``epoch_N.pt`` holds ``epoch: N``, counted
from 1 as step files hold their step; the resume event, the damage warning and the audit still read
the log's numbering; a file of the previous format is refused by name, not misread one epoch early."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain import Trainer, read_events
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.tools.audit.auditor import audit_file
from fsmtrain.training.checkpoint_file import CheckpointError, load_checkpoint, save_state


def _fit(run_dir: Path, epochs: int, resume: bool = False) -> None:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(12, 3), torch.randn(12, 1)), batch_size=4)
    model = nn.Linear(3, 1)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), data, data, max_epochs=epochs,
            callbacks=[CheckpointCallback(run_dir / "checkpoints", every_n_steps=4, keep_last_k=10,
                                          background=False)],
            run_dir=run_dir, resume_from="latest" if resume else None, default_callbacks=False,
            console_level="error").fit()


@pytest.mark.timeout(120)
def test_each_file_holds_the_epoch_or_step_its_name_says_and_resume_reads_them(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fit(run, 2)
    files = {p.name: load_checkpoint(p) for p in (run / "checkpoints").glob("*.pt")}
    assert {n: s["epoch"] for n, s in files.items() if n.startswith("epoch_")} == {"epoch_1.pt": 1, "epoch_2.pt": 2}
    # 3 batches an epoch: step 4 is the first of epoch 2
    assert {n: (s["step"], s["epoch"]) for n, s in files.items() if n.startswith("step_")} == {"step_4.pt": (4, 2)}
    assert files["latest.pt"]["epoch"] == 2
    _fit(run, 3, resume=True)
    (resume,) = [e["payload"] for e in read_events(run / "events.jsonl") if e["event"] == "resume"]
    assert resume["checkpoint_epoch"] == 1 and resume["next_epoch"] == 2  # the log's 0-based epoch index
    assert load_checkpoint(run / "checkpoints" / "epoch_3.pt")["epoch"] == 3
    assert not audit_file(run / "events.jsonl").violations


def test_a_file_of_the_previous_format_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "epoch_1.pt"
    save_state(path, {"format": 1, "epoch": 0})
    with pytest.raises(CheckpointError, match="has format 1; this fsmtrain reads 2"):
        load_checkpoint(path)
