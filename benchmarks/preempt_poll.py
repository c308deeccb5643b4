"""What the per-batch pre-emption agreement costs a step on 2 ranks: a step timed with and without
``RankAgreement.poll_signal`` before each, the two interleaved, best of 3.

    python benchmarks/preempt_poll.py [--steps 2000]                    # CPU: the quickstart's step, DDP on gloo
    python benchmarks/preempt_poll.py --device cuda --shape gpu_mlp     # GPU: compare.py's gpu_mlp step

On CUDA both ranks use ``cuda:0`` (a lent machine has one GPU; NCCL refuses two ranks on one device),
so each trains its own replica with no gradient all-reduce. The agreement's rounds are the real thing:
a non-blocking all-reduce on the host (its own gloo group) every ``POLL_EVERY`` batches, read one round
later. A separate pass runs every poll under ``torch.cuda.set_sync_debug_mode("error")``: a poll that
made the host wait for the GPU would fail it.
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

SHAPES = {"small": (8, (64, 64), 1, 64), "gpu_mlp": (1024, (4096, 4096), 16, 512)}  # in, hidden, out, batch


def _net(shape: str) -> nn.Module:
    n_in, hidden, n_out, _ = SHAPES[shape]
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(n_in, width), nn.ReLU()]
        n_in = width
    return nn.Sequential(*layers, nn.Linear(n_in, n_out))


def _rank(rank: int, steps: int, port: int, device_name: str, shape: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    device = torch.device(device_name)
    torch.manual_seed(0)
    model: nn.Module = _net(shape).to(device)
    if device.type == "cpu":
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters())
    batch = SHAPES[shape][3]
    x, y = torch.randn(batch, SHAPES[shape][0], device=device), torch.randn(batch, SHAPES[shape][2], device=device)
    agreement = RankAgreement(TorchCollective(device),
                              RunContext("bench", 1, EventLog(None, "bench", console=None, keep=True)), per_batch=False)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def checked_poll() -> None:
        torch.cuda.set_sync_debug_mode("error")
        try:
            agreement.poll_signal()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    results: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # the process's CPU seconds a step (every thread: gloo's too)
    for _ in range(3):
        for name, poll in (("without", None), ("with", agreement.poll_signal)):
            dist.barrier()
            sync()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(steps):
                if poll is not None:
                    poll()
                step()
            sync()
            results.setdefault(name, []).append((time.perf_counter() - t) / steps)
            cpu.setdefault(name, []).append((time.process_time() - c) / steps)
    # The agreement alone: POLL_EVERY back-to-back polls make a round; CPU of the training thread and of the
    # whole process (gloo's threads too), best of 3.
    rounds = max(1, steps // RankAgreement.POLL_EVERY)
    alone: dict[str, list[float]] = {"thread": [], "process": []}
    for _ in range(3):
        dist.barrier()
        t, c = time.thread_time(), time.process_time()
        for _ in range(rounds * RankAgreement.POLL_EVERY):
            agreement.poll_signal()
        alone["thread"].append((time.thread_time() - t) / rounds)
        alone["process"].append((time.process_time() - c) / rounds)
    checked = device.type == "cuda"
    if checked:  # raises at the first poll that syncs the host with the GPU
        for _ in range(4 * RankAgreement.POLL_EVERY):
            checked_poll()
            step()
        sync()
    if rank == 0:
        base, polled = min(results["without"]), min(results["with"])
        where = "gloo, CPU, DDP" if device.type == "cpu" else f"{torch.cuda.get_device_name(device)}, both on it"
        print(f"2 ranks ({where}), {shape} step: {base * 1e6:.0f} us without the agreement, {polled * 1e6:.0f} us "
              f"with it: {(polled - base) / base * 100:+.1f}% ({(polled - base) * 1e6:+.0f} us a step; best of 3 x "
              f"{steps})" + ("; no poll synced the host with the GPU (sync debug mode 'error')" if checked else ""))
        base, polled = min(cpu["without"]), min(cpu["with"])
        print(f"  rank 0's CPU (all its threads) a step: {base * 1e6:.0f} us without, {polled * 1e6:.0f} us with: "
              f"{(polled - base) / base * 100:+.1f}% ({(polled - base) * 1e6:+.0f} us)")
        thread, process = min(alone["thread"]), min(alone["process"])
        every = RankAgreement.POLL_EVERY
        print(f"  the agreement alone ({rounds} rounds of {every} polls): a round costs {thread * 1e6:.0f} us of the "
              f"training thread and {process * 1e6:.0f} us of the process's CPU: {thread / every * 1e6:.1f} and "
              f"{process / every * 1e6:.1f} us a step, {thread / every / base * 100:.2f}% and "
              f"{process / every / base * 100:.2f}% of the step's CPU without it")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="small",
                    help="small: the quickstart's MLP 8-64-64-1, batch 64; gpu_mlp: 1024-4096-4096-16, batch 512")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("preempt_poll.py --device cuda: no CUDA device here; nothing was run")
    mp.spawn(_rank, args=(args.steps, 29500 + os.getpid() % 1000, args.device, args.shape), nprocs=2)


if __name__ == "__main__":
    main()
