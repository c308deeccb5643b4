"""HPO throughput: trials per minute of ``fsmtrain hpo --workers K`` on the journal file storage.

    python benchmarks/hpo_throughput.py [--workers 1 2 4] [--trials 16] [--epochs 20]

Each trial is the quickstart (configs/quickstart.yaml: 2048 samples, an MLP 8-64-64-1, ``--epochs``
epochs; W&B off, NopPruner so every trial runs to the end, a random sampler over the learning
rate). For each K the whole command runs in a fresh folder and two rates are printed:

- ``wall``: trials / the command's wall time (process start, imports, worker spawn included);
- ``steady``: trials / (last trial end - first trial start), read from the study itself.

Every trial is one process's work, so the rate can only scale up to the number of free cores
(``os.cpu_count()`` is printed, with the load average: on a shared machine the figures are noisy).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.storages.journal import JournalFileBackend, JournalStorage

REPO = Path(__file__).resolve().parents[1]


def study_config(directory: Path, epochs: int) -> Path:
    data: dict[str, Any] = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text(encoding="utf-8"))
    data.update({"epochs": epochs, "scheduler_config": {"T_max": epochs}, "wandb": {"enabled": False},
                 "early_stopping": {"enabled": False}})
    data["optimize"] = {
        "study_name": "bench", "sampler": "RandomSampler", "sampler_config": {"seed": 0}, "pruner": "NopPruner",
        "search_space": {"optimizer_config.lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}},
    }
    path = directory / "bench.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def run(workers: int, trials: int, epochs: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="fsmtrain-hpo-bench-") as tmp:
        root = Path(tmp)
        cfg = study_config(root, epochs)
        journal = root / "study.journal"
        env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "fsmtrain", "hpo", str(cfg), "--workers", str(workers), "--n-trials", str(trials),
             "--storage", str(journal)], cwd=root, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"fsmtrain hpo --workers {workers} failed ({proc.returncode}):\n"
                             f"{proc.stdout}{proc.stderr}")
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        study = optuna.load_study(study_name="bench", storage=JournalStorage(JournalFileBackend(str(journal))))
        times = [(t.datetime_start, t.datetime_complete) for t in study.trials
                 if t.datetime_start is not None and t.datetime_complete is not None]
        span = (max(end for _, end in times) - min(begin for begin, _ in times)).total_seconds()
        per_trial = sum((end - begin).total_seconds() for begin, end in times) / len(times)
        done = times
        return {"trials": len(done), "wall_s": wall, "wall_per_min": 60 * len(done) / wall,
                "steady_per_min": 60 * len(done) / span, "trial_s": per_trial}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    print(f"cpus {os.cpu_count()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.trials} quickstart trials of {args.epochs} epochs each, journal storage")
    print(f"{'workers':>7} {'trials':>6} {'wall s':>8} {'trials/min (wall)':>18} {'trials/min (steady)':>20} "
          f"{'s/trial':>8}")
    base: float | None = None
    for k in args.workers:
        r = run(k, args.trials, args.epochs)
        base = base or r["steady_per_min"]
        print(f"{k:>7} {int(r['trials']):>6} {r['wall_s']:>8.1f} {r['wall_per_min']:>18.1f} "
              f"{r['steady_per_min']:>14.1f} ({r['steady_per_min'] / base:.2f}x) {r['trial_s']:>8.2f}", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
