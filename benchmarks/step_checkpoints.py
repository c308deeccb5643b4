"""What ``checkpoint.every_n_steps`` costs (issue 41): compare.py's ``large`` workload (a 76 MB state)
with fsmtrain and the nine built-ins, with and without a checkpoint every N steps, beside the raw
loop in the same invocation. Each run is a fresh process (compare.py's worker), rounds interleaved
in a rotating order; the steady window (epoch 2 to the last epoch's start) holds the step checkpoints.
``--scale 1.5`` makes 30 steps an epoch, so steps 100 and 200 fall inside epochs, apart from their ends.

    python benchmarks/step_checkpoints.py [--rounds 3] [--every 100] [--scale 1.5]

Printed: the median steady ms per epoch of each, the ratio of each to raw (and to raw_all), the cost
of the step checkpoints relative to the same run without them (median of the per-round ratios, in
wall time and in the process's CPU seconds, which the writer thread's work is part of), and
each step checkpoint's own time on the training thread (its epoch's ``CheckpointCallback`` time
over the median of the other epochs'), which over 100 steps gives the per-step share it costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import WORKLOADS, _run_worker
from compare_loops import EVERY_N_STEPS_ENV

FRAMEWORKS = ("raw", "raw_all", "fsm_all", "fsm_all_steps")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=100, help="checkpoint.every_n_steps")
    ap.add_argument("--scale", type=float, default=1.5, help="multiply large's 20 steps an epoch")
    args = ap.parse_args()
    os.environ[EVERY_N_STEPS_ENV] = str(args.every)
    work = WORKLOADS["large"].scaled(args.scale)
    runs: dict[str, list[dict[str, object]]] = {f: [] for f in FRAMEWORKS}
    for r in range(args.rounds):
        order = FRAMEWORKS[r % len(FRAMEWORKS):] + FRAMEWORKS[:r % len(FRAMEWORKS)]
        for fw in order:
            result = _run_worker(fw, work, timeout=1800)
            if "error" in result:
                print(f"{fw}: {result['error']}", file=sys.stderr)
                return 1
            runs[fw].append(result)
            print(f"round {r + 1} {fw}: {result['epoch_ms']:.1f} ms/epoch", file=sys.stderr, flush=True)
    hashes = {fw: {str(x["sha256"]) for x in rows} for fw, rows in runs.items()}
    med = {fw: statistics.median(float(x["epoch_ms"]) for x in rows) for fw, rows in runs.items()}  # type: ignore[arg-type]
    steps = work.train_steps * (work.epochs - 2)
    print(f"large x{args.scale}: {work.train_steps} steps an epoch, {work.epochs} epochs (steady window {steps} "
          f"steps), checkpoint.every_n_steps {args.every}, {args.rounds} round(s)")
    print(f"same weights everywhere: {len(set().union(*hashes.values())) == 1}")
    for fw in FRAMEWORKS:
        print(f"  {fw:14s} {med[fw]:9.1f} ms/epoch  {med[fw] / med['raw']:.3f}x raw  "
              f"{med[fw] / med['raw_all']:.3f}x raw_all")
    paired = [float(a["epoch_ms"]) / float(b["epoch_ms"]) - 1  # type: ignore[arg-type]
              for a, b in zip(runs["fsm_all_steps"], runs["fsm_all"], strict=True)]
    print(f"step checkpoints' cost: {100 * statistics.median(paired):+.2f}% of the run without them "
          f"(per round: {', '.join(f'{100 * p:+.2f}%' for p in paired)})")
    cpu = [float(a["cpu_s"]) / float(b["cpu_s"]) - 1  # type: ignore[arg-type]
           for a, b in zip(runs["fsm_all_steps"], runs["fsm_all"], strict=True)]
    print(f"in CPU seconds of the whole run (all its threads; steadier than wall time under load): "
          f"{100 * statistics.median(cpu):+.2f}% (per round: {', '.join(f'{100 * p:+.2f}%' for p in cpu)})")
    stalls = [float(s) for x in runs["fsm_all_steps"] for s in x.get("step_stall_ms", [])]  # type: ignore[attr-defined]
    if stalls:
        step_ms = med["fsm_all"] / work.train_steps
        stall = statistics.median(stalls)
        print(f"each step checkpoint on the training thread: {stall:.1f} ms (median of {len(stalls)}), "
              f"{100 * stall / (args.every * step_ms):.2f}% of {args.every} steps of {step_ms:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
