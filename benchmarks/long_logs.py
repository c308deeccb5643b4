"""How long ``fsmtrain audit`` and ``fsmtrain report`` take on 1,000,000-line logs (target: at most 5 s
each), against the floor: one Python pass that ``json.loads`` and ``sha256``s every line. The same pass with
msgspec, the parser the audit uses, is printed beside it: what any reader that parses every line pays here.

Two logs, each written by the product's own writer (:class:`fsmtrain.core.events.EventLog`: real
timestamps, its hash chain and seals), so the audit must pass on them:

- ``steps``: a real debug-level run (every batch's move logged: the step-level lines of a long run),
  its epoch re-emitted with ``epoch``/``global_step`` continued until the log has ``--lines`` lines;
- ``epochs``: a real info-level run with the default callbacks' slots, its epoch re-emitted with a
  synthetic loss curve (one spike the page must still show) for 200,000 epochs (5 lines each).

Each command runs in a fresh process, timed from outside (wall, and the child's CPU from ``wait4``), with
fsmtrain's bytecode written first, as a wheel's install does; the floor runs in a fresh process too. The
load average is printed: this machine is shared.

    python benchmarks/long_logs.py [--lines 1000000] [--epochs 200000] [--only steps|epochs] [--keep DIR]
                                   [--reuse] [--repeat N] [--python PY [--python OTHER_VENV/bin/python]]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BATCHES = 64
SPIKE = 9.87654  # the val loss of one epoch of the ``epochs`` log: the page must still show it
FLOOR = ("import hashlib, json, sys\nwith open(sys.argv[1], 'rb') as fh:\n    for raw in fh:\n"
         "        json.loads(raw)\n        hashlib.sha256(raw).hexdigest()\n")
FAST_PASS = FLOOR.replace("import hashlib, json,", "import hashlib, msgspec,").replace(
    "json.loads(raw)", "msgspec.json.decode(raw)")  # the same pass with the parser the audit uses
Record = dict[str, Any]


def real_run(run_dir: Path, level: str, epochs: int, batches: int) -> list[Record]:
    """A tiny real run (the default callbacks' slots, no checkpoints); its log's records."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from fsmtrain.app.trainer import Trainer
    from fsmtrain.callbacks import (
        EarlyStoppingCallback,
        GradientMonitorCallback,
        LossPredictionCallback,
        NaNDetectionCallback,
        OverfitDetectionCallback,
    )
    from fsmtrain.core.events import read_events

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(batches * 8 + 32, 4)
    y = x.sum(dim=1, keepdim=True)
    train = DataLoader(TensorDataset(x[: batches * 8], y[: batches * 8]), batch_size=8)
    val = DataLoader(TensorDataset(x[batches * 8:], y[batches * 8:]), batch_size=8)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    callbacks = [NaNDetectionCallback(), GradientMonitorCallback(), LossPredictionCallback(max_epochs=epochs),
                 OverfitDetectionCallback(), EarlyStoppingCallback(patience=10**9)]
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), train, val, max_epochs=epochs,
            callbacks=callbacks, run_dir=run_dir, run_id="long", log_level=level, console_level="error",
            default_callbacks=False).fit()
    return read_events(run_dir / "events.jsonl")


def curve(e: int, epochs: int) -> tuple[float, float, float]:
    """(train loss, val loss, lr) of epoch ``e``: decaying, a little noisy, one spike at 61.7%."""
    train = 2.0 * math.exp(-e / 40_000) + 0.05 + 0.002 * math.sin(e / 7)
    val = SPIKE if e == int(epochs * 0.617) else 2.0 * math.exp(-e / 45_000) + 0.08 + 0.004 * math.sin(e / 11)
    return train, val, 0.01 * (0.5 + 0.5 * math.cos(math.pi * e / epochs))


def write_log(records: list[Record], epochs: int, out: Path,
              epoch_payload: Callable[[Record, int], Record] | None = None) -> None:
    """``records`` (a finished run) re-emitted through ``EventLog``: its first epoch, then its last
    epoch again and again with ``epoch`` and ``global_step`` continued, then its ending, renumbered.
    ``epoch_payload(payload, e)``: an epoch event's payload for epoch ``e``."""
    from fsmtrain.core.events import EventLog

    begin = next(i for i, r in enumerate(records) if r.get("trigger") == "start_epoch")
    nxt = max(i for i, r in enumerate(records) if r.get("trigger") == "next_epoch")  # into the last epoch
    finish = next(i for i, r in enumerate(records) if r.get("trigger") == "finish")
    head, step_line, body, tail = records[: begin + 1], records[nxt], records[nxt + 1: finish], records[finish:]
    base, per_epoch = body[0]["global_step"], body[-1]["global_step"] - body[0]["global_step"]
    start = head[0]["payload"]
    log = EventLog(out, head[0]["run_id"], level="debug", console=None, config=start.get("config"), fsync="never")
    best: tuple[float, int] = (math.inf, -1)
    last_val = math.nan

    def put(rec: Record, epoch: int, step: int | None, payload: Record | None = None) -> None:
        log.emit(rec["event"], level=rec["level"], phase=rec["phase"], epoch=epoch,
                 global_step=rec["global_step"] if step is None else step, payload=payload or rec["payload"],
                 from_phase=rec["from"], to_phase=rec["to"], trigger=rec["trigger"])

    try:
        for rec in head:
            payload = {k: v for k, v in rec["payload"].items() if k != "chain"}  # the writer describes its own
            put(rec, rec["epoch"], None, dict(payload, max_epochs=epochs) if rec["event"] == "run_start" else payload)
        for e in range(epochs):
            for rec in body:
                step = e * per_epoch + rec["global_step"] - base
                payload = rec["payload"]
                if rec["event"] == "epoch":
                    payload = epoch_payload(payload, e) if epoch_payload is not None else payload
                    val = payload["metrics"]["val_loss"]
                    best, last_val = min(best, (val, e)), val
                put(rec, e, step, payload)
            if e < epochs - 1:
                put(step_line, e + 1, (e + 1) * per_epoch)
        for rec in tail:
            payload = rec["payload"]
            if rec["event"] == "result":
                payload = dict(payload, epochs_completed=epochs, best_epoch=best[1], best_val_loss=best[0],
                               last_val_loss=last_val, objective=best[0], global_step=epochs * per_epoch)
            elif rec["event"] == "transition" and rec["to"] == "train_end":
                payload = dict(payload, message=f"reached max_epochs={epochs}")
            put(rec, epochs, epochs * per_epoch, payload)
    finally:
        log.close()


def synthetic_epoch(epochs: int) -> Callable[[Record, int], Record]:
    def payload(p: Record, e: int) -> Record:
        train, val, lr = curve(e, epochs)
        slots = {k: v for k, v in (p.get("slots") or {}).items() if k != "overfit_gap_ratio"}
        if isinstance(slots.get("loss_prediction"), dict):
            slots["loss_prediction"] = dict(slots["loss_prediction"], predicted_loss=0.8 * val)
        if 0.70 * epochs <= e < 0.72 * epochs or e % 997 == 0:
            slots["overfit_gap_ratio"] = val / train
        return dict(p, metrics=dict(p["metrics"], train_loss=train, val_loss=val, lr=lr), slots=slots)
    return payload


def build(kind: str, lines: int, epochs: int, run_dir: Path) -> None:
    """The ``kind`` log in ``run_dir/events.jsonl`` (run in a child: the parent that measures stays small)."""
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "steps":
            records = real_run(Path(tmp) / "real", "debug", 2, BATCHES)
            per_epoch = sum(1 for r in records if r["epoch"] == 1 and r["event"] != "run_start")
            write_log(records, max(1, lines // per_epoch), run_dir / "events.jsonl")
        else:
            write_log(real_run(Path(tmp) / "real", "info", 3, 8), epochs, run_dir / "events.jsonl",
                      synthetic_epoch(epochs))


def timed(cmd: list[str]) -> tuple[float, float, int, str]:
    """``cmd`` in a fresh process: (wall seconds, its CPU seconds, exit code, its output's tail)."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode(errors="replace")
    return wall, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status), text[-1500:]


def compiled(python: str) -> None:
    """Write the bytecode of ``python``'s fsmtrain, as installing a wheel does: with PYTHONDONTWRITEBYTECODE set
    (as on this machine), an editable install would otherwise compile every module at every start (~0.35 s)."""
    where = subprocess.run([python, "-c", "import fsmtrain, os; print(os.path.dirname(fsmtrain.__file__))"],
                           check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([python, "-m", "compileall", "-q", where], check=True)


def measure(kind: str, run_dir: Path, repeat: int, pythons: list[str]) -> bool:
    """Each command under each Python in turn (old and new alternated), ``repeat`` rounds; the best counts."""
    events = run_dir / "events.jsonl"
    with open(events, "rb") as fh:
        n = sum(1 for _ in fh)
    rows = {"floor (json.loads + sha256 a line)": ["-c", FLOOR, str(events)],
            "msgspec decode + sha256 a line": ["-c", FAST_PASS, str(events)],
            "fsmtrain audit": ["-m", "fsmtrain", "audit", str(run_dir)],
            "fsmtrain report": ["-m", "fsmtrain", "report", str(run_dir)]}
    best: dict[tuple[str, str], tuple[float, float]] = {}
    loads: list[float] = []
    ok = True
    for _ in range(repeat):
        for name, args in rows.items():
            for py in pythons:
                loads.append(os.getloadavg()[0])
                wall, cpu, code, tail = timed([py, *args])
                old = best.get((py, name), (math.inf, math.inf))
                best[py, name] = (min(old[0], wall), min(old[1], cpu))
                if code != 0:
                    ok = False
                    print(f"{name} under {py} failed ({code}):\n{tail}", file=sys.stderr)
    print(f"\n{kind}: {n:,} lines, {events.stat().st_size / 1e6:.0f} MB; load average {min(loads):.1f}-"
          f"{max(loads):.1f} on {os.cpu_count()} CPUs; best of {repeat}, the Pythons alternated")
    print("| Python | command | wall s | CPU s | wall / floor's | CPU / floor's |\n|---|---|---|---|---|---|")
    for py in pythons:
        floor = best[py, "floor (json.loads + sha256 a line)"]
        for name in rows:
            wall, cpu = best[py, name]
            print(f"| {py} | {name} | {wall:.2f} | {cpu:.2f} | {wall / floor[0]:.2f} | {cpu / floor[1]:.2f} |")
    page = (run_dir / "report.html").read_text(encoding="utf-8") if (run_dir / "report.html").exists() else ""
    reduced = page.count("reduced: ")
    print(f"page: {len(page.encode()) / 1e6:.2f} MB, {reduced} chart(s) say they are reduced" +
          (f"; the spike {'is' if f': {SPIKE:.6g}</title>' in page else 'is NOT'} on the page"
           if kind == "epochs" else ""))
    return ok and all(best[pythons[0], k][0] <= 5 for k in ("fsmtrain audit", "fsmtrain report"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines of the steps log")
    parser.add_argument("--epochs", type=int, default=200_000, help="epochs of the epochs log (5 lines each)")
    parser.add_argument("--only", choices=("steps", "epochs"), default=None)
    parser.add_argument("--repeat", type=int, default=1, help="run each command this many times; the best counts")
    parser.add_argument("--keep", type=Path, default=None, help="build the run dirs under DIR and keep them")
    parser.add_argument("--reuse", action="store_true", help="with --keep: measure the logs already there")
    parser.add_argument("--python", action="append", default=None,
                        help="a Python whose fsmtrain is measured (default: this one); given twice (another "
                             "checkout's venv: a before figure), the two alternate; the first is judged")
    parser.add_argument("--build-only", nargs=2, default=None, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_only is not None:
        kind, where = args.build_only
        Path(where).mkdir(parents=True, exist_ok=True)
        build(kind, args.lines, args.epochs, Path(where))
        return 0
    ok = True
    for py in args.python or [sys.executable]:
        compiled(py)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        for kind in [args.only] if args.only else ["steps", "epochs"]:
            run_dir = root / kind
            if not (args.reuse and (run_dir / "events.jsonl").is_file()):
                t0 = time.perf_counter()
                subprocess.run([sys.executable, __file__, "--lines", str(args.lines), "--epochs", str(args.epochs),
                                "--build-only", kind, str(run_dir)], check=True)
                print(f"built the {kind} log in {time.perf_counter() - t0:.1f} s")
            ok = measure(kind, run_dir, args.repeat, args.python or [sys.executable]) and ok
    print("targets (audit and report at most 5 s each):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
