"""How long ``fsmtrain report`` takes on a 200,000-epoch log, how much memory, and how big a page
(targets: under 5 s, under 300 MB, under 2 MB).

The log is made from a real info-level run with the default callbacks' slots (gradient monitor,
loss prediction, overfit detection, early stopping; no checkpoints): its epoch block is repeated
with ``seq``, ``ts``, ``epoch``, ``global_step``, ``max_epochs`` and the ``result`` renumbered, the
losses and lr replaced by a synthetic curve with one spike, and hash-chained as ``EventLog`` chains
it, so the log audits clean. Then ``fsmtrain report`` runs on it in a fresh process, measured from
outside (wall time, the child's peak RSS from ``getrusage``).

    python benchmarks/report_speed.py [--epochs 200000] [--keep DIR] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import long_logs  # beside this script

REPO = Path(__file__).resolve().parents[1]
BATCHES = 8
SPIKE = 9.87654  # the val loss of one epoch (at 61.7% of the run): the report must still show it


def real_run(run_dir: Path) -> list[dict[str, Any]]:
    """Twelve epochs of a tiny real run at info level with the default callbacks' slots."""
    return long_logs.real_run(run_dir, "info", 12, BATCHES)


def curve(e: int, epochs: int) -> tuple[float, float, float]:
    """(train loss, val loss, lr) of epoch ``e``: decaying, a little noisy, one spike."""
    train = 2.0 * math.exp(-e / 40_000) + 0.05 + 0.002 * math.sin(e / 7)
    val = 2.0 * math.exp(-e / 45_000) + 0.08 + 0.004 * math.sin(e / 11)
    if e == spike_epoch(epochs):
        val = SPIKE
    return train, val, 0.01 * (0.5 + 0.5 * math.cos(math.pi * e / epochs))


def overfitting(e: int, epochs: int) -> bool:
    """Flagged as overfitting: one long stretch and every 997th epoch (many short stretches)."""
    return 0.70 * epochs <= e < 0.72 * epochs or e % 997 == 0


def spike_epoch(epochs: int) -> int:
    return int(epochs * 0.617)


def _index(records: list[dict[str, Any]], pred: Any) -> int:
    return next(i for i, r in enumerate(records) if pred(r))


def build_log(records: list[dict[str, Any]], epochs: int, out: Path) -> None:
    """A legal, chained log of ``epochs`` epochs shaped like ``records`` (see the module doc)."""
    from fsmtrain.core.chain import Chain

    start = _index(records, lambda r: r.get("trigger") == "start_epoch")
    nxt = max(i for i, r in enumerate(records) if r.get("trigger") == "next_epoch")  # into the last epoch
    finish = _index(records, lambda r: r.get("trigger") == "finish")
    # the run's first epoch opens the log; its last epoch (slots all set by then) is repeated
    head, body, step_line, tail = records[: start + 1], records[nxt + 1: finish], records[nxt], records[finish:]
    steps = BATCHES
    chain = Chain(None)
    prev = chain.genesis(records[0]["run_id"], None)
    seq = 0
    t0 = records[0]["ts"]
    best = (math.inf, -1)
    last_val = math.nan
    with open(out, "wb") as fh:

        def put(rec: dict[str, Any], epoch: int, step: int | None) -> None:
            nonlocal seq, prev
            rec = dict(rec, seq=seq, epoch=epoch, ts=t0 + seq * 1e-5)
            if step is not None:
                rec["global_step"] = step
            rec.pop("seal", None)
            rec.pop("prev", None)
            rec["prev"] = prev  # the last field before the seal, as the log writes it
            line, _, prev = chain.seal(json.dumps(rec, separators=(",", ":")).encode("utf-8"))
            fh.write(line)
            seq += 1

        for rec in head:
            if rec["event"] == "run_start":
                rec = dict(rec, payload=dict(rec["payload"], max_epochs=epochs, chain=chain.describe()))
            put(rec, rec["epoch"], rec["global_step"])
        base = body[0]["global_step"]
        for e in range(epochs):
            train, val, lr = curve(e, epochs)
            if val < best[0]:
                best = (val, e)
            last_val = val
            for rec in body:
                if rec["event"] == "epoch":
                    metrics = dict(rec["payload"]["metrics"], train_loss=train, val_loss=val, lr=lr)
                    slots = dict(rec["payload"].get("slots") or {})
                    if "early_stopping_wait" in slots:
                        slots["early_stopping_wait"] = e - best[1]
                    if isinstance(slots.get("loss_prediction"), dict):
                        slots["loss_prediction"] = dict(slots["loss_prediction"], predicted_loss=0.8 * val)
                    slots.pop("overfit_gap_ratio", None)
                    if overfitting(e, epochs):
                        slots["overfit_gap_ratio"] = val / train
                    rec = dict(rec, payload=dict(rec["payload"], metrics=metrics, slots=slots))
                step = rec["global_step"]
                put(rec, e, None if step is None else step - base + e * steps)
            if e < epochs - 1:
                put(step_line, e + 1, (e + 1) * steps)
        for rec in tail:
            if rec["event"] == "result":
                rec = dict(rec, payload=dict(rec["payload"], epochs_completed=epochs, best_epoch=best[1],
                                             best_val_loss=best[0], last_val_loss=last_val, objective=best[0],
                                             global_step=epochs * steps))
            elif rec["event"] == "transition" and rec["to"] == "train_end":
                rec = dict(rec, payload=dict(rec["payload"], message=f"reached max_epochs={epochs}"))
            put(rec, epochs, epochs * steps)


def measure(run_dir: Path) -> tuple[float, float, int, str, float]:
    """``fsmtrain report RUN_DIR`` in a fresh process: (seconds, peak RSS in MB, page bytes, stdout,
    CPU seconds). The peak RSS is that child's own, from ``wait4`` (not the largest of every child
    so far)."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "fsmtrain", "report", str(run_dir)], env=env, stdout=out,
                                stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"fsmtrain report failed ({proc.returncode}): {stderr[-2000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return seconds, usage.ru_maxrss / 1024, (run_dir / "report.html").stat().st_size, stdout, cpu


def parts(events: Path) -> None:
    """Where the time goes: the report's own reading of the log, the audit, and the rest (wall time,
    and CPU time, which a loaded machine inflates less)."""
    from fsmtrain.tools.audit import audit_file
    from fsmtrain.tools.report.run import run_sections
    from fsmtrain.tools.report.run_log import read_run

    marks = [(time.perf_counter(), time.process_time())]
    read_run(events)  # with the audit, in one pass
    marks.append((time.perf_counter(), time.process_time()))
    audit_file(events)
    marks.append((time.perf_counter(), time.process_time()))
    run_sections(events)
    marks.append((time.perf_counter(), time.process_time()))
    (w0, c0), (w1, c1), (w2, c2), (w3, c3) = marks
    print(f"parts (wall / CPU): reading the log {w1 - w0:.2f} / {c1 - c0:.2f} s, the audit {w2 - w1:.2f} / "
          f"{c2 - c1:.2f} s, the whole page {w3 - w2:.2f} / {c3 - c2:.2f} s (reading and audit included)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=200_000)
    parser.add_argument("--keep", type=Path, default=None, help="build the run dir here and keep it")
    parser.add_argument("--repeat", type=int, default=1, help="report this many times; the best time is shown")
    parser.add_argument("--reuse", action="store_true", help="with --keep: measure the log already there")
    parser.add_argument("--parts", action="store_true",
                        help="also time the page's parts in this process: reading the log, the audit, the rest")
    parser.add_argument("--build-only", type=Path, default=None, metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_only is not None:  # the child that imports torch (see below)
        args.build_only.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            build_log(real_run(Path(tmp) / "real"), args.epochs, args.build_only / "events.jsonl")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.keep or Path(tmp) / "big"
        t0 = time.perf_counter()
        # Built in a child: a child's peak RSS counts from its parent's size at fork, so the
        # parent that measures must stay small (no torch here).
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if not (args.reuse and (run_dir / "events.jsonl").is_file()):
            subprocess.run([sys.executable, __file__, "--epochs", str(args.epochs), "--build-only", str(run_dir)],
                           env=env, check=True)
        with open(run_dir / "events.jsonl", "rb") as fh:
            lines = sum(1 for _ in fh)
        print(f"built {lines:,} lines ({args.epochs:,} epochs, info level) in {time.perf_counter() - t0:.1f} s")
        runs = [measure(run_dir) for _ in range(max(1, args.repeat))]
        seconds = min(r[0] for r in runs)
        rss, size, out = runs[0][1], runs[0][2], runs[0][3]
        cpu = min(r[4] for r in runs)
        page = (run_dir / "report.html").read_text(encoding="utf-8")
        if args.parts:
            parts(run_dir / "events.jsonl")
    print(out.strip())
    spike = f": {SPIKE:.6g}</title>" in page  # a drawn point's tooltip
    print(f"report: {seconds:.2f} s ({cpu:.2f} s CPU), peak RSS {rss:.0f} MB, page {size / 1e6:.2f} MB; the spike "
          f"at epoch {spike_epoch(args.epochs) + 1} {'is' if spike else 'is NOT'} on the page; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    ok = seconds < 5 and rss < 300 and size < 2e6 and spike
    print("targets (under 5 s, 300 MB, 2 MB; the spike kept):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
