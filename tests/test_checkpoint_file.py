"""A checkpoint file is ``torch.save``'s, streamed through the hashing writer: it loads with
``torch.load(weights_only=True)``, its committed sha256 is the file's, and a write that fails
part-way (a full disk) raises the disk's own error and leaves the process and the old file as they were."""

from __future__ import annotations

import hashlib
import io
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fsmtrain.training.checkpoint_file import HashingWriter, atomic_file, atomic_link, capture_rng_state, save_state

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="needs a CUDA device; none here (CPU-only machine)"))


def _trained_state(device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 8, device=device)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"format": 1, "epoch": 3, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "rng": capture_rng_state(), "history": "epoch,loss\n0,0.5\n", "metrics": {"val_loss": 0.25},
            "callbacks": {"EarlyStopping": {"best": 0.25, "bad": [1, 2, 3]}}, "best": None, "extra": {}}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_saved_state_loads_weights_only_and_its_digest_is_the_files(tmp_path: Path, device: str) -> None:
    """Model, AdamW, RNG states, plain values and a tensor of several MB, live on ``device``: the
    file holds ``torch.save``'s bytes, the returned sha256 is theirs, and no temp file is left."""
    state = _trained_state(device)
    state["big"] = torch.arange(1 << 20, dtype=torch.float64)
    state["rng_python"] = random.getstate()
    state["rng_numpy"] = np.random.get_state(legacy=False)["state"]["key"].tolist()
    path = tmp_path / "ckpt.pt"
    digest = save_state(path, state)
    data = path.read_bytes()
    assert digest == hashlib.sha256(data).hexdigest()
    expected = io.BytesIO()
    torch.save(state, expected)
    assert data == expected.getvalue()
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert _equal(loaded["model"], state["model"]) and _equal(loaded["big"], state["big"])
    assert not list(tmp_path.glob("*.tmp"))


def test_a_temp_name_left_by_a_killed_process_of_the_same_pid_is_replaced_not_written_through(
        tmp_path: Path) -> None:
    """Temp names of this pid and thread, left by a killed process: a file, and a hard link of a committed
    checkpoint (a link killed before its rename). The write and the link replace them, without an unlink
    before every write, and never write into the committed file through the old name."""
    def temp_of(path: Path) -> Path:
        return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")

    committed, ckpt, latest = tmp_path / "epoch_1.pt", tmp_path / "epoch_2.pt", tmp_path / "latest.pt"
    committed.write_bytes(b"epoch 1, committed")
    os.link(committed, temp_of(ckpt))
    with atomic_file(ckpt, sync_dir=False) as fh:
        fh.write(b"epoch 2")
    assert ckpt.read_bytes() == b"epoch 2" and committed.read_bytes() == b"epoch 1, committed"
    temp_of(latest).write_bytes(b"left by a killed process")
    atomic_link(ckpt, latest)
    assert os.path.samefile(latest, ckpt) and latest.read_bytes() == b"epoch 2"
    assert not list(tmp_path.glob("*.tmp"))


def test_a_failed_save_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"committed")
    data = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="view the same data as different types"):  # torch.save refuses it
        save_state(path, {"a": data, "b": data.view(torch.float32)})
    assert path.read_bytes() == b"committed"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_the_hashing_writer_passes_every_byte_on_and_hashes_it() -> None:
    out = io.BytesIO()
    hashing = HashingWriter(out)
    chunks = [b"a" * 10, bytes(range(256)) * 1000, memoryview(b"tail")]
    assert [hashing.write(c) for c in chunks] == [10, 256_000, 4]
    hashing.flush()
    assert out.getvalue() == b"".join(bytes(c) for c in chunks)
    assert hashing.hexdigest() == hashlib.sha256(out.getvalue()).hexdigest()


_FULL_DISK = """
import gc, io, torch
from fsmtrain.training.checkpoint_file import HashingWriter

class FullDisk(io.RawIOBase):
    def __init__(self):
        self.n = 0
    def writable(self):
        return True
    def write(self, b):
        self.n += len(b)
        if self.n > 30000:
            raise OSError(28, "No space left on device")
        return len(b)

for _ in range(3):
    hashing = HashingWriter(FullDisk())
    torch.save({"a": torch.randn(100000), "b": torch.randn(10)}, hashing)
    try:
        hashing.hexdigest()
    except OSError as exc:
        print("raised", exc.errno)
    gc.collect()
print("alive")
"""


@pytest.mark.timeout(60)
def test_a_failed_write_raises_the_disks_error_and_the_process_lives() -> None:
    """A write that fails part-way never reaches torch's zip writer as an exception (which could
    end the process from its destructor): ``torch.save`` finishes, and the disk's ``OSError`` is
    what the write raises. In a subprocess, so an abort fails the test instead of ending the suite."""
    done = subprocess.run([sys.executable, "-c", _FULL_DISK], capture_output=True, text=True, timeout=50,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["raised", "28"] * 3 + ["alive"]
