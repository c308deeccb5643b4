"""The checkpoint writer's serialiser is ``torch.save``'s file, byte for byte: the same bytes (so the
same sha256 in the log), read back by ``torch.load(weights_only=True)``, for the states fsmtrain
writes and for every kind of tensor it does not take the short way for."""

from __future__ import annotations

import hashlib
import io
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fsmtrain.training.checkpoint_files import _Hashing, save_state
from fsmtrain.training.rng import capture_rng_state
from fsmtrain.training.torch_file import write_torch_file

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="needs a CUDA device; none here (CPU-only machine)"))


def _torch_save_bytes(obj: Any) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def _ours(obj: Any) -> bytes:
    out = io.BytesIO()
    write_torch_file(obj, out)
    return out.getvalue()


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


def _assert_same_file(obj: Any) -> None:
    expected = _torch_save_bytes(obj)
    assert _ours(obj) == expected  # the old assertion form: a mismatch shows both byte strings' lengths
    loaded = torch.load(io.BytesIO(expected), weights_only=False)
    ours = torch.load(io.BytesIO(_ours(obj)), weights_only=False)
    assert _equal(loaded, ours)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t.dequantize() if t.is_quantized else t


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.is_sparse or a.is_quantized:
            return isinstance(b, torch.Tensor) and _equal(_plain(a), _plain(b))
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (torch.storage.TypedStorage, torch.UntypedStorage)):
        return type(a) is type(b) and a.tolist() == b.tolist()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_checkpoint_state_is_the_same_file_as_torch_save(device: str) -> None:
    """Model, AdamW, RNG states and plain values, live on ``device`` (a foreground save) and staged
    on the CPU (what the writer thread saves)."""
    state = _trained_state(device)
    _assert_same_file(state)
    staged = {k: ({n: t.detach().cpu().clone() for n, t in v.items()} if k == "model" else v) for k, v in state.items()}
    _assert_same_file(staged)
    loaded = torch.load(io.BytesIO(_ours(state)), weights_only=True)  # what load_checkpoint does
    assert _equal(loaded["model"], state["model"])


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*:UserWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
def test_every_kind_of_tensor_is_the_same_file_as_torch_save() -> None:
    base = torch.arange(24, dtype=torch.float32)
    dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.int8, torch.uint8, torch.int64,
              torch.complex64, torch.uint16, torch.uint32]  # the last two: torch.save keeps them untyped
    plain = {str(d): torch.ones(3, 2).to(d) for d in dtypes}
    tagged = torch.zeros(2)
    tagged.note = "a Python attribute"  # type: ignore[attr-defined]
    state = {
        "dtypes": plain,
        "zero_d": torch.tensor(7.0), "empty": torch.empty(0, 3),
        "views": [base[2:10], base.view(4, 6).t(), base[::3], base],  # one storage, offsets and strides
        "requires_grad": torch.ones(2, requires_grad=True),
        "parameter": nn.Parameter(torch.ones(2)),
        "attribute": tagged,
        "conj": torch.ones(2, dtype=torch.complex64).conj(),  # a conj-bit view: its metadata is pickled
        "quantized": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
        "sparse": torch.eye(3).to_sparse(),
        "untyped_storage": torch.ones(4).untyped_storage(),
        "typed_storage": torch.ones(2, dtype=torch.float64).storage(),
        "containers": OrderedDict(a=(1, 2.5, "x", None, True), b=[b"bytes", {"n": [1, 2]}]),
    }
    _assert_same_file(state)


def test_the_same_bytes_under_two_dtypes_are_refused_as_torch_save_refuses_them() -> None:
    data = torch.zeros(4, dtype=torch.int32)
    state = {"a": data, "b": data.view(torch.float32)}
    with pytest.raises(RuntimeError, match="view the same data as different types") as ours:
        write_torch_file(state, io.BytesIO())
    with pytest.raises(RuntimeError) as theirs:
        torch.save(state, io.BytesIO())
    assert str(ours.value) == str(theirs.value)


def test_save_state_commits_torch_saves_sha256(tmp_path: Path) -> None:
    """The digest the log commits is the sha256 of ``torch.save``'s bytes, and the file holds them;
    a state with tensors larger than the gathering buffer goes through the same way."""
    state = _trained_state("cpu")
    state["big"] = torch.arange(3 * _Hashing.GATHER, dtype=torch.float64)  # bytes past the gather size
    state["rng_python"] = random.getstate()
    state["rng_numpy"] = np.random.get_state(legacy=False)["state"]["key"].tolist()
    digest = save_state(tmp_path / "ckpt.pt", state)
    expected = _torch_save_bytes(state)
    assert (tmp_path / "ckpt.pt").read_bytes() == expected
    assert digest == hashlib.sha256(expected).hexdigest()
    assert not list(tmp_path.glob("*.tmp"))


def test_the_hashing_file_gathers_small_writes_and_passes_large_ones() -> None:
    out = io.BytesIO()
    hashing = _Hashing(out)
    small, fills, large, tail = b"a" * 10, b"b" * (_Hashing.GATHER - 10), bytes(range(256)) * 1000, b"c" * 3
    for chunk in (small, fills):
        assert hashing.write(chunk) == len(chunk)
    assert out.getvalue() == b""  # gathered: exactly GATHER bytes wait
    assert hashing.write(large) == len(large)
    assert out.getvalue() == small + fills + large  # what waited goes out first, then the large one
    hashing.write(tail)
    assert out.getvalue() == small + fills + large
    hashing.flush()
    assert out.getvalue() == small + fills + large + tail
    assert hashing.digest.hexdigest() == hashlib.sha256(out.getvalue()).hexdigest()


def test_a_staged_state_takes_the_short_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensors a staged checkpoint holds never go through torch's own per-tensor reduction (the
    Python work this serialiser exists to skip); a tensor that requires grad does."""
    calls: list[type] = []
    reduce = torch.Tensor.__reduce_ex__

    def counting(self: torch.Tensor, proto: int) -> Any:
        calls.append(type(self))
        return reduce(self, proto)

    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", counting)
    state = _trained_state("cpu")
    write_torch_file(state, io.BytesIO())
    assert calls == []
    write_torch_file({"w": torch.ones(2, requires_grad=True)}, io.BytesIO())
    assert calls == [torch.Tensor]


_FULL_DISK = """
import gc, io, torch
from fsmtrain.training.torch_file import write_torch_file

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
    try:
        write_torch_file({"a": torch.randn(100000), "b": torch.randn(10)}, FullDisk())
    except OSError as exc:
        print("raised", exc.errno)
    gc.collect()
print("alive")
"""


@pytest.mark.timeout(60)
def test_a_failed_write_raises_its_own_error_and_the_process_lives() -> None:
    """Found here: a write that failed part-way (a full disk) left torch's zip writer open, and its
    destructor, ending the archive on the same failing file, aborted the whole process
    (``terminate called after throwing an instance of 'c10::Error'``). Now the writer is ended on
    the way out, as torch.save ends its own, and the disk's error is the one raised."""
    done = subprocess.run([sys.executable, "-c", _FULL_DISK], capture_output=True, text=True, timeout=50,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["raised", "28"] * 3 + ["alive"]
