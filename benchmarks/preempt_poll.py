"""What the per-batch pre-emption agreement costs on 2 CPU ranks (gloo): the quickstart's step
(MLP 8-64-64-1, batch 64, DDP) timed with and without ``RankAgreement.poll_signal`` before each.

    python benchmarks/preempt_poll.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fsmtrain.core.consensus import RankAgreement
from fsmtrain.core.context import RunContext
from fsmtrain.core.events import EventLog
from fsmtrain.training.distributed import TorchCollective


def _rank(rank: int, steps: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64),
                                                              nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    agreement = RankAgreement(TorchCollective(torch.device("cpu")),
                              RunContext("bench", 1, EventLog(None, "bench", console=None, keep=True)), per_batch=False)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    results: dict[str, list[float]] = {}
    for _ in range(3):
        for name, poll in (("without", None), ("with", agreement.poll_signal)):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(steps):
                if poll is not None:
                    poll()
                step()
            results.setdefault(name, []).append((time.perf_counter() - t) / steps)
    if rank == 0:
        base, polled = min(results["without"]), min(results["with"])
        print(f"2 ranks (gloo, CPU): step {base * 1e6:.0f} us without the agreement, {polled * 1e6:.0f} us with it: "
              f"{(polled - base) / base * 100:+.1f}% ({(polled - base) * 1e6:+.0f} us a step; best of 3 x {steps})")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    mp.spawn(_rank, args=(args.steps, 29500 + os.getpid() % 1000), nprocs=2)


if __name__ == "__main__":
    main()
