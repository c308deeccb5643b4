"""Per-rank peak memory of FSDP2 against DDP on 2 CPU ranks (gloo), and the training thread's stall
of a sharded run's checkpoint.

A model whose parameters dominate: an MLP of about 50M parameters (2048 -> 4096 -> 4096 -> 4096 ->
2048), AdamW, 4 steps of batch 8 through ``fsmtrain.Trainer`` (``strategy="ddp"`` or ``"fsdp"``,
no callbacks). Each rank records its RSS high-water mark (``getrusage``) after the steps, less its
RSS before the model was built (torch and the process group), and, under FSDP, what a sharded
checkpoint costs the training thread (every rank: its shards' state dicts by name, staged into the
checkpoint's buffers), the writer thread's DCP write of the folder (shards, each rank's state, and
rank 0's sha256 of every file), and, for comparison, the full state's gather ``model.pt`` pays.

    python benchmarks/fsdp_memory.py            # writes nothing; prints the table
    python benchmarks/fsdp_memory.py --append benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTHS = (2048, 4096, 4096, 4096, 2048)


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def worker(strategy: str, out: Path) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from fsmtrain.app.trainer import Trainer
    from fsmtrain.training.checkpoint_file import save_folder
    from fsmtrain.training.checkpoint_writer import BufferSet, stage
    from fsmtrain.training.distributed import DistributedOptions, init_from_env, shutdown
    from fsmtrain.training.sharding import checkpoint_states, full_state, writers_group

    torch.set_num_threads(1)
    collective = init_from_env(DistributedOptions(), torch.device("cpu"))
    base = _rss_mb()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    with torch.device("meta" if strategy == "fsdp" else "cpu"):  # FSDP: never whole on a rank
        for a, b in itertools.pairwise(WIDTHS):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(64, WIDTHS[0]), torch.randn(64, WIDTHS[-1]))
    trainer = Trainer(model, opt, nn.MSELoss(), DataLoader(data, batch_size=8), max_epochs=1, collective=collective,
                      strategy=strategy, default_callbacks=False)
    t0 = time.perf_counter()
    trainer.fit()
    fit_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = {"rank": collective.rank, "strategy": strategy, "params": params, "base_mb": base, "peak_mb": peak,
           "fit_s": fit_s}
    if strategy == "fsdp":
        buffers, folder = BufferSet(), out / "ckpt"
        for key in ("stage_first_s", "stage_s"):
            collective.barrier()
            t0 = time.perf_counter()  # what the training thread pays at a sharded checkpoint
            model_sd, optim_sd = checkpoint_states(trainer.model, opt)
            staged = stage({"model": model_sd, "optimizer": optim_sd}, buffers)
            row[key] = time.perf_counter() - t0
        row["shard_mb"] = sum(t.to_local().numel() * t.element_size() for t in model_sd.values()) / 2**20
        collective.barrier()
        t0 = time.perf_counter()  # the writer thread's: DCP's write of every rank's shards, rank 0's hashing
        save_folder(folder / "epoch_1", staged.state, writers_group(trainer.model))
        row["write_s"] = time.perf_counter() - t0
        collective.barrier()
        t0 = time.perf_counter()
        full_state(trainer.model, opt)
        row["gather_s"] = time.perf_counter() - t0
    (out / f"{strategy}-rank{collective.rank}.json").write_text(json.dumps(row))
    del trainer, model, opt
    shutdown()


def run(strategy: str, out: Path) -> list[dict[str, float]]:
    # A fixed mmap threshold: glibc's moving one keeps freed blocks of tens of MB in the heap, and the
    # RSS high-water mark would count memory neither strategy still uses.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", strategy, "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    return [json.loads((out / f"{strategy}-rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--out")
    ap.add_argument("--append")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, Path(args.out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = {s: run(s, Path(tmp)) for s in ("ddp", "fsdp")}
    ddp, fsdp = rows["ddp"], rows["fsdp"]
    lines = ["", "## FSDP2 vs DDP: per-rank peak memory on 2 CPU ranks (gloo)", "",
             f"Generated by `python benchmarks/fsdp_memory.py --append benchmarks/RESULTS.md` on "
             f"{time.strftime('%Y-%m-%d %H:%M')} ({platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores; no GPU lent to this measurement). An MLP "
             f"{' -> '.join(map(str, WIDTHS))} ({ddp[0]['params'] / 1e6:.1f}M parameters), AdamW, 4 steps of batch 8 "
             "per rank through `Trainer(strategy=...)`, no callbacks. Peak: the rank's RSS high-water mark after "
             "the steps, less its RSS before the model was built; glibc's mmap threshold fixed at 1 MB "
             "(`MALLOC_MMAP_THRESHOLD_`) for both, so freed blocks leave the RSS.", "",
             "| rank | DDP peak MB | FSDP peak MB | FSDP / DDP | DDP fit s | FSDP fit s |", "|---|---|---|---|---|---|"]
    for d, f in zip(ddp, fsdp, strict=True):
        dm, fm = d["peak_mb"] - d["base_mb"], f["peak_mb"] - f["base_mb"]
        lines.append(f"| {d['rank']} | {dm:.0f} | {fm:.0f} | {fm / dm:.2f} | {d['fit_s']:.1f} | {f['fit_s']:.1f} |")
    f0 = fsdp[0]
    lines += ["", f"Sharded checkpoint stall (DCP folder, the training thread): each rank's shards by name "
              f"({f0['shard_mb']:.0f} MB of weights a rank, plus AdamW's moments) staged into the checkpoint's "
              f"buffers: {max(r['stage_s'] for r in fsdp):.2f} s ({max(r['stage_first_s'] for r in fsdp):.2f} s "
              f"the first time); the writer thread's DCP write of the folder (every rank's shards and state, "
              f"rank 0's sha256 of each file) {max(r['write_s'] for r in fsdp):.2f} s; for comparison the full "
              f"state's gather to rank 0 (what the one-file checkpoint cost the training thread before, and "
              f"`model.pt` still costs once) {max(r['gather_s'] for r in fsdp):.2f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(args.append, "a") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
