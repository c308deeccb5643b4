"""How long ``fsmtrain audit`` takes on a 1,000,000-line log (target: under 10 s, hash chain included).

The log is made from a real debug-level run (every per-batch move logged): its epoch block is
repeated with ``seq``, ``ts``, ``epoch``, ``global_step``, ``max_epochs`` and the ``result``
renumbered so the log stays legal, and hash-chained and sealed as ``EventLog`` writes it (``--key``
for an HMAC chain), then audited once, streaming, and the wall time printed.

    python benchmarks/audit_speed.py [--lines 1000000] [--keep PATH] [--key KEY]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain.app.trainer import Trainer
from fsmtrain.callbacks import EarlyStoppingCallback, NaNDetectionCallback
from fsmtrain.core.chain import Chain
from fsmtrain.tools.audit import audit_file

BATCHES = 64


def real_run(run_dir: Path) -> list[dict[str, Any]]:
    """Two epochs of a tiny real run at debug level."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(BATCHES * 8 + 32, 4)
    y = x.sum(dim=1, keepdim=True)
    train = DataLoader(TensorDataset(x[: BATCHES * 8], y[: BATCHES * 8]), batch_size=8)
    val = DataLoader(TensorDataset(x[BATCHES * 8:], y[BATCHES * 8:]), batch_size=8)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), train, val, max_epochs=2,
                      callbacks=[NaNDetectionCallback(), EarlyStoppingCallback(patience=10**9)],
                      run_dir=run_dir, run_id="bench", log_level="debug", console_level="error",
                      default_callbacks=False)
    trainer.fit()
    with open(run_dir / "events.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _index(records: list[dict[str, Any]], pred: Any) -> int:
    return next(i for i, r in enumerate(records) if pred(r))


def build_log(records: list[dict[str, Any]], target_lines: int, out: Path, key: bytes | None = None) -> int:
    """Write a legal, chained log of about ``target_lines`` lines; returns the number of epochs in it."""
    start = _index(records, lambda r: r.get("trigger") == "start_epoch")
    nxt = _index(records, lambda r: r.get("trigger") == "next_epoch")
    finish = _index(records, lambda r: r.get("trigger") == "finish")
    head, body1, step_line = records[: start + 1], records[nxt + 1: finish], records[nxt]
    tail = records[finish:]
    per_epoch = len(body1) + 1
    epochs = max(1, (target_lines - len(head) - len(tail)) // per_epoch)
    steps_per_epoch = BATCHES
    chain = Chain(key)
    prev = chain.genesis(records[0]["run_id"], None)
    seq = 0
    t0 = records[0]["ts"]
    with open(out, "wb") as fh:

        def put(rec: dict[str, Any], epoch: int, step: int | None) -> None:
            nonlocal seq, prev
            rec = dict(rec, seq=seq, epoch=epoch, ts=t0 + seq * 1e-5)
            rec.pop("seal", None)
            rec["prev"] = prev
            if step is not None:
                rec["global_step"] = step
            line, _, prev = chain.seal(json.dumps(rec, separators=(",", ":")).encode("utf-8"))
            fh.write(line)
            seq += 1

        for rec in head:
            if rec["event"] == "run_start":
                payload = dict(rec["payload"], max_epochs=epochs)
                payload["chain"] = chain.describe()
                rec = dict(rec, payload=payload)
            put(rec, rec["epoch"], rec["global_step"])
        base_step = body1[0]["global_step"]  # global_step at the start of epoch 1 in the real run
        for e in range(epochs):
            for rec in body1:
                step = rec["global_step"]
                put(rec, e, None if step is None else step - base_step + e * steps_per_epoch)
            if e < epochs - 1:
                put(step_line, e + 1, (e + 1) * steps_per_epoch)
        last_val = body1[-1]["payload"]["metrics"]["val_loss"]  # every epoch repeats epoch 1's figures
        for rec in tail:
            if rec["event"] == "result":
                rec = dict(rec, payload=dict(rec["payload"], epochs_completed=epochs, best_epoch=0,
                                             best_val_loss=last_val, last_val_loss=last_val, objective=last_val,
                                             global_step=epochs * steps_per_epoch))
            elif rec["event"] == "transition" and rec["to"] == "train_end":
                rec = dict(rec, payload=dict(rec["payload"], message=f"reached max_epochs={epochs}"))
            put(rec, epochs, epochs * steps_per_epoch)
    return epochs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, default=None, help="write the generated log here and keep it")
    parser.add_argument("--key", default=None, help="chain with HMAC-SHA256 under this key (audited with it)")
    args = parser.parse_args(argv)
    key = args.key.encode("utf-8") if args.key else None
    with tempfile.TemporaryDirectory() as tmp:
        records = real_run(Path(tmp) / "run")
        log = args.keep or Path(tmp) / "big.jsonl"
        t0 = time.perf_counter()
        epochs = build_log(records, args.lines, log, key)
        built = time.perf_counter() - t0
        with open(log, "rb") as fh:
            n_lines = sum(1 for _ in fh)
        t0 = time.perf_counter()
        report = audit_file(log, key=key)
        seconds = time.perf_counter() - t0
    scheme = "hmac-sha256" if key else "sha256"
    print(f"built {n_lines} lines ({epochs} epochs of {BATCHES} batches, debug level, {scheme} chain) in {built:.1f} s")
    print(f"audit: {seconds:.2f} s for {n_lines} lines ({n_lines / seconds:,.0f} lines/s); "
          f"ok={report.ok} violations={len(report.violations)} stop={report.explanation.stop_reason}")
    if not report.ok:
        print(report.render()[:3000], file=sys.stderr)
        return 1
    return 0 if seconds < 10 else 1


if __name__ == "__main__":
    sys.exit(main())
