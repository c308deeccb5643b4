"""Overhead of the fsmtrain loop against a raw PyTorch loop, measured in one process, interleaved.

Each round trains a fresh copy of the same tiny MLP (32->64->64->1, batch 64, AdamW, MSE,
one thread) once with a hand-written loop and once through ``Trainer`` for every case, in
alternating order, and the ratio per round is ``case time / raw time``. The figure printed is the
median over rounds, so a burst of load on the machine moves one round, not the result.

Both loops iterate the same pre-collated list of batches and do the same per-epoch work
(validation under inference_mode, one host read of the train loss), so the ratio isolates the
cost of the machine, the hook dispatch and the event log.

    python benchmarks/overhead.py            # all cases
    python benchmarks/overhead.py --batches 20 --epochs 200 --case no_callbacks --case no_callbacks_in_memory
                                             # compare.py's epochs shape: what the event log costs per epoch
    python benchmarks/overhead.py --json     # machine-readable
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsmtrain import Trainer, TrainingCallback
from fsmtrain.core.lifecycle import HOOK_NAMES

Batch = tuple[torch.Tensor, torch.Tensor]


def _noop(self: TrainingCallback, ctx: Any) -> None:
    return None


# Overrides every hook with a no-op: the worst case of pure dispatch cost.
EveryHookNoop = type("EveryHookNoop", (TrainingCallback,), {hook: _noop for hook in HOOK_NAMES})


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path, int], list[TrainingCallback]]  # (scratch dir, epochs) -> callbacks
    epochs: int | None = None  # defaults to --epochs
    rounds: int | None = None  # defaults to --rounds
    file_log: bool = True  # events.jsonl written (a run_dir); False keeps the events in memory


CASES: dict[str, Case] = {
    "no_callbacks": Case("no_callbacks", lambda _dir, _epochs: []),
    # the same without the hash-chained file: no_callbacks minus this is what the event log costs
    "no_callbacks_in_memory": Case("no_callbacks_in_memory", lambda _dir, _epochs: [], file_log=False),
    "every_hook_noop": Case("every_hook_noop", lambda _dir, _epochs: [EveryHookNoop()]),
}


def all_nine(run_dir: Path, epochs: int) -> list[TrainingCallback]:
    """The nine built-ins as a real run has them: W&B offline into the run directory, a checkpoint
    every 10 epochs (plus best and latest), and a pruner on a real in-memory Optuna trial."""
    import os

    import optuna

    import fsmtrain.callbacks as cb

    os.environ.setdefault("WANDB_SILENT", "true")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trial = optuna.create_study(pruner=optuna.pruners.NopPruner()).ask()
    return [
        cb.NaNDetectionCallback(),
        cb.OptimizerModeCallback(),
        cb.GradientMonitorCallback(),
        cb.LossPredictionCallback(max_epochs=epochs),
        cb.OverfitDetectionCallback(),
        cb.WandbLoggingCallback(mode="offline", directory=run_dir),
        cb.PrunerCallback(trial),
        cb.EarlyStoppingCallback(),
        cb.CheckpointCallback(run_dir / "checkpoints", save_every_n_epochs=10),
    ]


CASES["all_nine"] = Case("all_nine", all_nine, epochs=20, rounds=5)


def make_data(n_train: int, n_val: int, batch: int, seed: int = 0) -> tuple[list[Batch], list[Batch]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 1, generator=g)
    x = torch.randn(n_train + n_val, 32, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n_train + n_val, 1, generator=g)
    train = [(x[i : i + batch], y[i : i + batch]) for i in range(0, n_train, batch)]
    val = [(x[i : i + batch], y[i : i + batch]) for i in range(n_train, n_train + n_val, batch)]
    return train, val


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def raw_loop(train: list[Batch], val: list[Batch], epochs: int) -> float:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    t0 = time.perf_counter()
    for _ in range(epochs):
        model.train()
        total = torch.zeros(())
        seen = 0
        for x, y in train:
            out = model(x)
            loss = loss_fn(out, y)
            total += loss.detach() * y.shape[0]
            seen += y.shape[0]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _ = (total / seen).item()
        model.eval()
        vsum = torch.zeros(1)
        with torch.inference_mode():
            for x, y in val:
                vsum += torch.stack([loss_fn(model(x), y)]) * y.shape[0]
        _ = vsum.tolist()
    return time.perf_counter() - t0


def trainer_loop(train: list[Batch], val: list[Batch], epochs: int, callbacks: list[TrainingCallback],
                 run_dir: Path | None) -> float:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=epochs, callbacks=callbacks,
                      run_dir=run_dir, console_level="error", default_callbacks=False)
    t0 = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - t0


def measure(case: Case, train: list[Batch], val: list[Batch], epochs: int, rounds: int) -> dict[str, Any]:
    ratios: list[float] = []
    raw_times: list[float] = []
    case_times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            run_dir = Path(tmp) / f"{case.name}-{r}" if case.file_log else None
            callbacks = case.build(run_dir or Path(tmp), epochs)
            if r % 2 == 0:  # alternate who goes first, so warm caches favour neither
                raw = raw_loop(train, val, epochs)
                took = trainer_loop(train, val, epochs, callbacks, run_dir)
            else:
                took = trainer_loop(train, val, epochs, callbacks, run_dir)
                raw = raw_loop(train, val, epochs)
            raw_times.append(raw)
            case_times.append(took)
            ratios.append(took / raw)
    steps = epochs * len(train)
    return {
        "raw_ms_per_epoch": 1e3 * statistics.median(raw_times) / epochs,
        "ms_per_epoch": 1e3 * statistics.median(case_times) / epochs,
        "case": case.name,
        "epochs": epochs,
        "rounds": rounds,
        "raw_steps_per_s": steps / statistics.median(raw_times),
        "steps_per_s": steps / statistics.median(case_times),
        "ratio_median": statistics.median(ratios),
        "overhead_pct": (statistics.median(ratios) - 1) * 100,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--batches", type=int, default=128, help="training batches per epoch")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="run only these cases")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    train, val = make_data(64 * args.batches, 64 * 8, 64)
    raw_loop(train, val, 1)  # warm-up: allocator, kernels
    results = []
    for name in args.case or list(CASES):
        case = CASES[name]
        results.append(measure(case, train, val, case.epochs or args.epochs, case.rounds or args.rounds))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"{'case':<24} {'raw steps/s':>12} {'steps/s':>10} {'raw ms/epoch':>13} {'ms/epoch':>9} {'ratio':>7} "
              f"{'overhead':>9}")
        for r in results:
            print(f"{r['case']:<24} {r['raw_steps_per_s']:>12.0f} {r['steps_per_s']:>10.0f} "
                  f"{r['raw_ms_per_epoch']:>13.3f} {r['ms_per_epoch']:>9.3f} {r['ratio_median']:>7.3f} "
                  f"{r['overhead_pct']:>8.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
