"""What the per-batch pre-emption agreement costs a step on 2 ranks: a step timed with and without
``RankAgreement.poll_signal`` before each, in blocks of 4 rounds' worth of steps that alternate (``--steps``
x ``--reps`` steps each way): the means' ratio and the paired blocks' median. ``--every 100000`` (no round in
the run) shows the method's own noise.

    python benchmarks/preempt_poll.py [--steps 2000] [--every N]        # CPU: the quickstart's step, DDP on gloo
    python benchmarks/preempt_poll.py --device cuda --shape gpu_mlp     # GPU: compare.py's gpu_mlp step

On CUDA both ranks use ``cuda:0`` (a lent machine has one GPU; NCCL refuses two ranks on one device),
so each trains its own replica with no gradient all-reduce. The agreement's rounds are the real thing:
a non-blocking all-reduce on the host (its own gloo group), read one round later, every ``--every`` batches
(default: auto, about every 500 ms of training, as a run spaces them). A separate pass runs every poll under
``torch.cuda.set_sync_debug_mode("error")``: a poll that made the host wait for the GPU would fail it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

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


def _rank(rank: int, steps: int, port: int, device_name: str, shape: str, every: int | None, reps: int) -> None:
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
                              RunContext("bench", 1, EventLog(None, "bench", console=None, keep=True)), per_batch=False,
                              rounds_every=every)
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

    # Settle the spacing (auto: from the batch time), then time blocks of 4 rounds' worth of steps with and
    # without the polls, alternating, in pairs whose order alternates too: a drift on the machine (another
    # process, a governor) falls on both arms alike.
    for _ in range(min(steps, 400)):
        agreement.poll_signal()
        step()
    spacing = agreement.every  # auto's spacing, settled; held fixed below, where blocks without polls come between
    agreement = RankAgreement(agreement.collective, agreement.run, per_batch=False, rounds_every=spacing)
    block = min(4 * spacing, 256)
    results: dict[str, list[float]] = {"without": [], "with": []}
    cpu: dict[str, list[float]] = {"without": [], "with": []}  # the process's CPU a step (gloo's threads too)
    arms: list[tuple[str, Callable[[], None] | None]] = [("without", None), ("with", agreement.poll_signal)]
    for pair in range(max(2, steps * reps // block // 2)):
        for name, poll in arms if pair % 2 == 0 else arms[::-1]:
            dist.barrier()
            sync()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(block):
                if poll is not None:
                    poll()
                step()
            sync()
            results[name].append((time.perf_counter() - t) / block)
            cpu[name].append((time.process_time() - c) / block)
    # The agreement alone: rounds of a fixed spacing, polled back to back (auto would shrink it to 1 here, with
    # no step between polls); CPU of the training thread and of the whole process (gloo's threads too), best of 3.
    alone_agreement = RankAgreement(agreement.collective, agreement.run, per_batch=False, rounds_every=8)
    rounds = max(1, steps // 8)
    alone: dict[str, list[float]] = {"thread": [], "process": []}
    for _ in range(3):
        dist.barrier()
        t, c = time.thread_time(), time.process_time()
        for _ in range(rounds * 8):
            alone_agreement.poll_signal()
        alone["thread"].append((time.thread_time() - t) / rounds)
        alone["process"].append((time.process_time() - c) / rounds)
    checked = device.type == "cuda"
    if checked:  # raises at the first poll that syncs the host with the GPU
        for _ in range(4 * spacing):
            checked_poll()
            step()
        sync()
    if rank == 0:
        where = "gloo, CPU, DDP" if device.type == "cpu" else f"{torch.cuda.get_device_name(device)}, both on it"
        said = f"every {every} batches" if every else f"auto: settled on every {spacing} batches"
        pairs = len(results["with"])
        for what, got in (("step wall", results), ("rank 0's CPU a step (all its threads)", cpu)):
            base, polled = statistics.fmean(got["without"]), statistics.fmean(got["with"])
            paired = sorted(w / o for w, o in zip(got["with"], got["without"], strict=True))
            low, high = paired[len(paired) // 10], paired[-1 - len(paired) // 10]
            print(f"{what}: {base * 1e6:.0f} us without the agreement, {polled * 1e6:.0f} us with it: "
                  f"{(polled - base) / base * 100:+.2f}% of the means; paired blocks: median "
                  f"{(statistics.median(paired) - 1) * 100:+.2f}%, p10-p90 {(low - 1) * 100:+.1f}% to "
                  f"{(high - 1) * 100:+.1f}%")
        print(f"  2 ranks ({where}), {shape} step, rounds {said}; {pairs} pairs of blocks of {block} steps"
              + ("; no poll synced the host with the GPU (sync debug mode 'error')" if checked else ""))
        base = statistics.fmean(cpu["without"])
        thread, process = min(alone["thread"]), min(alone["process"])
        print(f"  the agreement alone ({rounds} rounds of 8 polls): a round costs {thread * 1e6:.0f} us of the "
              f"training thread and {process * 1e6:.0f} us of the process's CPU; at the spacing of {spacing} "
              f"batches: {thread / spacing * 1e6:.1f} and {process / spacing * 1e6:.1f} us a step, "
              f"{thread / spacing / base * 100:.2f}% and {process / spacing / base * 100:.2f}% of the step's CPU "
              "without it")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--reps", type=int, default=6, help="repetitions of each arm, alternating which goes first")
    ap.add_argument("--every", type=int, default=None, help="the batches between rounds (default: auto)")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="small",
                    help="small: the quickstart's MLP 8-64-64-1, batch 64; gpu_mlp: 1024-4096-4096-16, batch 512")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("preempt_poll.py --device cuda: no CUDA device here; nothing was run")
    mp.spawn(_rank, args=(args.steps, 29500 + os.getpid() % 1000, args.device, args.shape, args.every, args.reps),
             nprocs=2)


if __name__ == "__main__":
    main()
