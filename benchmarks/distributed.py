"""Multi-process training: samples per second on 1 vs 2 processes, and what the guard agreement costs.

    python benchmarks/distributed.py            # full sizes (about 2 minutes on 2 cores)
    python benchmarks/distributed.py --quick    # a smoke run (seconds; 1 and 2 processes only)

1. Throughput: the same config (an MLP big enough that a step is compute-bound on CPU) trained by
   ``fsmtrain train --nproc N`` for N = 1 and 2, each rank on one torch thread, plus one process on
   two threads (the other way to use both cores). Samples per second are the training rows of
   every rank over the time of the train phase (the ``phase_seconds`` of the ``epoch`` events, so
   start-up is left out), median over the epochs.
2. Agreement: the per-epoch guard agreement (one all-gather of six integers over gloo, and the
   verdict) timed on 2 real ranks, in microseconds per agreement; for scale, one metric all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def _config(folder: Path, rows: int, epochs: int, threads: int) -> Path:
    cfg: dict[str, Any] = {
        "project": "bench", "name": "ddp", "device": "cpu", "num_threads": threads, "seeds": [0],
        "data": "fsmtrain.training.data.synthetic_regression",
        "data_config": {"n_samples": rows, "n_features": 256, "val_fraction": 0.1},
        "net": "fsmtrain.training.models.MLP",
        "net_config": {"in_features": 256, "out_features": 1, "hidden": [1024, 1024]},
        "optimizer": "torch.optim.SGD", "optimizer_config": {"lr": 1e-3},
        "epochs": epochs, "batch_size": 256,
        "early_stopping": {"enabled": False}, "checkpoint": {"enabled": False}, "wandb": {"enabled": False},
    }
    path = folder / f"ddp-{threads}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1")
    return env


def throughput(nproc: int, threads: int, rows: int, epochs: int) -> float:
    """Training samples per second (all ranks), median over the epochs after the first."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = _config(folder, rows, epochs, threads)
        done = subprocess.run([sys.executable, "-m", "fsmtrain", "train", str(config), "--nproc", str(nproc)],
                              cwd=folder, env=_env(), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"training on {nproc} process(es) failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        (log,) = folder.rglob("events.jsonl")
        epochs_seen = [json.loads(line)["payload"] for line in log.read_text().splitlines()
                       if json.loads(line)["event"] == "epoch"]
        train_rows = rows - max(1, rows // 10)
        rates = [train_rows / e["phase_seconds"]["train_step"] for e in epochs_seen[1:] or epochs_seen]
        return statistics.median(rates)


def _agreement_worker(rounds: int) -> None:
    """Runs on each rank under torchrun: time the agreement and one metric all-reduce."""
    import torch

    from fsmtrain.core.consensus import decide, proposal_of
    from fsmtrain.training.distributed import DistributedOptions, init_from_env, shutdown

    coll = init_from_env(DistributedOptions(), torch.device("cpu"))
    for _ in range(50):  # warm-up: connections, allocator
        decide(coll.all_gather_ints(proposal_of(None, None)))
    coll.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        decide(coll.all_gather_ints(proposal_of(None, None)))
    agree_us = (time.perf_counter() - start) / rounds * 1e6
    metrics = torch.zeros(3, dtype=torch.float64)
    coll.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        coll.all_reduce_sum(metrics)
    reduce_us = (time.perf_counter() - start) / rounds * 1e6
    if coll.rank == 0:
        print(json.dumps({"agreement_us": agree_us, "metric_all_reduce_us": reduce_us}))
    shutdown()


def agreement_cost(rounds: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
         "--agreement-worker", "--rounds", str(rounds)],
        env=_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"agreement benchmark failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
    return dict(json.loads(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--agreement-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    if args.agreement_worker:
        _agreement_worker(args.rounds)
        return
    rows, epochs = (1024, 2) if args.quick else (32768, 4)
    rounds = args.rounds
    setups = [("1 process, 1 thread", 1, 1), ("2 processes, 1 thread each", 2, 1)]
    if not args.quick:  # the other way to use both cores
        setups.insert(1, ("1 process, 2 threads", 1, 2))
    results = {name: throughput(nproc, threads, rows, epochs) for name, nproc, threads in setups}
    base = results["1 process, 1 thread"]
    print(f"workload: MLP 256-1024-1024-1, batch 256, {rows} rows, {epochs} epochs, SGD (train phase only)")
    print("| setup | samples/s | vs 1 process |")
    print("|---|---|---|")
    for name, rate in results.items():
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f}x |")
    cost = agreement_cost(rounds)
    print(f"guard agreement (2 ranks, gloo): {cost['agreement_us']:.0f} us per agreement, one per epoch "
          f"(plus one at train_begin); a metric all-reduce: {cost['metric_all_reduce_us']:.0f} us (two per epoch)")


if __name__ == "__main__":
    main()
