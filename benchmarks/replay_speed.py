"""Replay speed: a 10,000-epoch synthetic loss curve through the real engine with every replayable
built-in callback (target: under 2 s).

    python benchmarks/replay_speed.py [--epochs 10000] [--repeat 3] [--profile]

Prints the best wall time of ``--repeat`` runs and the time per epoch; ``--profile`` adds the
cProfile top entries by own time, to show where an epoch's time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from fsmtrain.callbacks import (
    CheckpointCallback,
    EarlyStoppingCallback,
    GradientMonitorCallback,
    LossPredictionCallback,
    NaNDetectionCallback,
    OptimizerModeCallback,
    OverfitDetectionCallback,
    PrunerCallback,
    WandbLoggingCallback,
)
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.tools.replay import RecordedTrial, ReplayResult, TrialReport, replay_losses


def curve(epochs: int) -> tuple[list[float], list[float]]:
    """A decaying train loss and a val loss that bottoms out and creeps up (nothing stops it early)."""
    train = [2.0 * math.exp(-i / 800) + 0.05 for i in range(epochs)]
    val = [2.0 * math.exp(-i / 900) + 0.08 + 0.01 * math.sin(i / 7) for i in range(epochs)]
    return train, val


def all_replayable(epochs: int, directory: Path, skip: Sequence[str] = ()) -> list[TrainingCallback]:
    trial = RecordedTrial({i: TrialReport(i, 0.0, False) for i in range(epochs)})
    cbs: list[TrainingCallback] = [
        NaNDetectionCallback(), OptimizerModeCallback(), GradientMonitorCallback(),
        LossPredictionCallback(max_epochs=epochs), OverfitDetectionCallback(), WandbLoggingCallback(),
        PrunerCallback(cast(Any, trial)), EarlyStoppingCallback(patience=epochs), CheckpointCallback(directory),
    ]
    return [cb for cb in cbs if cb.name not in skip]


def callback_seconds(res: ReplayResult) -> dict[str, float]:
    """Seconds spent inside each callback over the whole replay (from the epoch events' timings)."""
    total: dict[str, float] = {}
    for e in res.events("epoch"):
        for name, sec in e["payload"]["callback_seconds"].items():
            total[name] = total.get(name, 0.0) + sec
    return total


def run_once(epochs: int, skip: Sequence[str] = ()) -> tuple[float, ReplayResult]:
    train, val = curve(epochs)
    grads = [1.0 + 0.1 * math.sin(i) for i in range(epochs)]
    with tempfile.TemporaryDirectory() as tmp:
        cbs = all_replayable(epochs, Path(tmp) / "checkpoints", skip)
        t0 = time.perf_counter()
        res = replay_losses(train=train, val=val, callbacks=cbs, lrs=[1e-3] * epochs,
                            slots={"max_grad_norm": grads})
        return time.perf_counter() - t0, res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--epochs", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip", action="append", default=[], metavar="CALLBACK",
                    help="leave a built-in out (class name), to see its share of the time")
    args = ap.parse_args(argv)
    times = []
    res: ReplayResult | None = None
    for _ in range(args.repeat):
        seconds, res = run_once(args.epochs, args.skip)
        times.append(seconds)
    assert res is not None
    best = min(times)
    names = [cb.name for cb in all_replayable(1, Path(tempfile.gettempdir()), args.skip)]
    print(f"replay of {args.epochs} epochs with {len(names)} built-ins: "
          f"best {best:.3f} s of {args.repeat} ({best / args.epochs * 1e6:.1f} us/epoch); "
          f"stop {res.stop_reason.name if res.stop_reason else 'unknown'} at epoch {res.stop_epoch}, "
          f"{len(res.trace)} events")
    per_cb = callback_seconds(res)
    inside = sum(per_cb.values())
    print(f"  inside callbacks {inside:.3f} s; engine, driver and event log {best - inside:.3f} s "
          f"({(best - inside) / args.epochs * 1e6:.1f} us/epoch)")
    for name, sec in sorted(per_cb.items(), key=lambda kv: -kv[1]):
        print(f"    {name:28s} {sec:8.3f} s")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_once(args.epochs, args.skip)
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
