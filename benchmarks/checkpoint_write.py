"""CPU time of one checkpoint write on the writer thread: ``torch.save`` through the checkpoint's
hashing file (:class:`fsmtrain.training.checkpoint_file.HashingWriter`), on real checkpoint states.

The state is what fsmtrain's checkpoint holds after a short real run (model, AdamW, RNG states,
history, callback states): ``small`` is compare.py's ``epochs`` model (32->64->64->1, a 0.1 MB
state), ``large`` its ``large`` one (1024->2048->2048->16, 76 MB). Each write goes into memory (no
disk: the disk's time is not CPU the training thread could be waiting on). CPU time is the writing
thread's own (``time.thread_time``): on a small state nearly all of it is Python holding the GIL,
which the training thread waits for while the writer thread serialises.

    python benchmarks/checkpoint_write.py            # both states, 7 rounds
    python benchmarks/checkpoint_write.py --json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsmtrain import Trainer
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.training.checkpoint_file import HashingWriter, load_checkpoint

SHAPES = {"small": (32, 64, 1, 64, 20), "large": (1024, 2048, 16, 32, 4)}  # in, hidden, out, batch, batches


def real_state(shape: str, scratch: Path) -> dict[str, Any]:
    """The latest checkpoint of a 3-epoch run of ``shape``, as ``load_checkpoint`` reads it."""
    n_in, hidden, n_out, batch, batches = SHAPES[shape]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, n_out))
    data = [(torch.randn(batch, n_in), torch.randn(batch, n_out)) for _ in range(batches)]
    Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), nn.MSELoss(), data, data[:2], max_epochs=3,
            callbacks=[CheckpointCallback(directory=str(scratch / "ckpt"))], run_dir=scratch, console_level="error",
            default_callbacks=False).fit()
    return load_checkpoint(scratch / "ckpt" / "latest.pt")


def _cpu_us(state: Any, n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        hashing = HashingWriter(io.BytesIO())
        torch.save(state, hashing)  # type: ignore[arg-type]  # a file object by duck typing
        hashing.hexdigest()
    return (time.thread_time() - start) / n * 1e6


def measure(state: Any, rounds: int, n: int) -> dict[str, float]:
    out = io.BytesIO()
    torch.save(state, out)
    return {"write_us": statistics.median(_cpu_us(state, n) for _ in range(rounds)), "bytes": len(out.getvalue())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", default="small,large", help="comma-separated: small, large")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            n = 200 if shape == "small" else 3  # writes per timing: a few ms of CPU either way
            results[shape] = measure(real_state(shape, Path(tmp) / shape), args.rounds, n)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"CPU time of one checkpoint write (torch.save, hashed, into memory), median of {args.rounds} rounds")
    print(f"{'state':<8}{'MB':>8}{'write us':>12}")
    for shape, r in results.items():
        print(f"{shape:<8}{r['bytes'] / 1e6:>8.2f}{r['write_us']:>12.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
