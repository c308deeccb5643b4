"""Where fsmtrain + nine's epoch goes against the hand-written loop's, part by part.

Each part is the difference between two runs that differ by that part alone, taken within a round
(fresh processes, interleaved, the order rotated each round) and the median over rounds, so a drift of
the machine's load moves one pair and not the figure. The variants are ``compare_loops``'s:

- ``fsm`` - ``raw``: the core (the lifecycle's moves, their checks and log lines, the program's steps);
- ``fsm_all_hollow`` - ``fsm``: the nine's hooks dispatched, timed and logged, each doing nothing;
- ``fsm_all_no_checkpoint`` - ``fsm_all_hollow``: the work of the eight that do not checkpoint, beside
  ``raw_all_unsaved`` - ``raw``, the same work by hand;
- ``fsm_all_unwritten`` - ``fsm_all_no_checkpoint``: the checkpoint on the training thread (decide,
  collect the state, serialize it, hand it over), beside ``raw_all`` - ``raw_all_unsaved`` (``torch.save``
  to the file) and ``raw_all_durable`` - ``raw_all_unsaved`` (also sha256, fsync, rename, commit line);
- ``fsm_all`` - ``fsm_all_unwritten``: the writer thread's commit, as the training thread feels it.

The last rows are the issue's ratios with the writer's work and without it: ``fsm_all_unwritten`` shows
what no design of the writer can go below.

    python benchmarks/parts.py                    # epochs, 5 rounds: about 6 minutes on 2 cores
    python benchmarks/parts.py --rounds 3 --epochs 300 --json /tmp/parts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import WORKLOADS, _run_worker  # noqa: E402  (beside this file)

VARIANTS = ("raw", "fsm", "fsm_all_hollow", "raw_all_unsaved", "fsm_all_no_checkpoint", "raw_all", "raw_all_durable",
            "fsm_all_unwritten", "fsm_all")
# (part, fsmtrain's (variant, base), the hand-written loop's (variant, base) or None)
PARTS: tuple[tuple[str, tuple[str, str], tuple[str, str] | None], ...] = (
    ("the core: the lifecycle's moves, checks and log lines, the program's steps", ("fsm", "raw"), None),
    ("the nine's hooks dispatched, each doing nothing", ("fsm_all_hollow", "fsm"), None),
    ("the work of the eight that do not checkpoint", ("fsm_all_no_checkpoint", "fsm_all_hollow"),
     ("raw_all_unsaved", "raw")),
    ("the checkpoint on the training thread (by hand: `torch.save` to the file)",
     ("fsm_all_unwritten", "fsm_all_no_checkpoint"), ("raw_all", "raw_all_unsaved")),
    ("the checkpoint on the training thread (by hand: durable, all on the training thread)",
     ("fsm_all_unwritten", "fsm_all_no_checkpoint"), ("raw_all_durable", "raw_all_unsaved")),
    ("the writer thread's commit, as the training thread feels it", ("fsm_all", "fsm_all_unwritten"), None),
    ("all of it, against `raw_all`", ("fsm_all", "raw"), ("raw_all", "raw")),
    ("all of it, against `raw_all_durable`", ("fsm_all", "raw"), ("raw_all_durable", "raw")),
)
RATIOS = (("fsm_all", "raw_all"), ("fsm_all", "raw_all_durable"), ("fsm_all_unwritten", "raw_all"),
          ("fsm_all_unwritten", "raw_all_durable"), ("fsm", "raw"), ("fsm_all_no_checkpoint", "raw_all_unsaved"))
FIELDS = (("epoch_ms", "steady"), ("epoch_p10_ms", "p10"))


def paired(runs: list[dict[str, Any]], a: str, b: str, field: str, op: str) -> float:
    """The median over rounds of ``a``'s ``field`` minus (``-``) or over (``/``) ``b``'s in the same round."""
    by = {(r["framework"], r["round"]): r[field] for r in runs if "error" not in r}
    values = [by[(a, n)] - by[(b, n)] if op == "-" else by[(a, n)] / by[(b, n)]
              for n in sorted({r["round"] for r in runs}) if (a, n) in by and (b, n) in by]
    return statistics.median(values) if values else float("nan")


def render(runs: list[dict[str, Any]], argv: str, epochs: int, minutes: float) -> str:
    rounds = len({r["round"] for r in runs})
    out = [f"`python benchmarks/parts.py {argv}` ({epochs} epochs of `epochs`' shape, {rounds} rounds, "
           f"{minutes:.1f} min). ms an epoch, the median over rounds of paired differences, steady / p10:", "",
           "| part | fsmtrain | by hand |", "|---|---|---|"]
    for name, (fa, fb), hand in PARTS:
        mine = " / ".join(f"{paired(runs, fa, fb, f, '-'):+.2f}" for f, _ in FIELDS)
        theirs = "-" if hand is None else " / ".join(f"{paired(runs, *hand, f, '-'):+.2f}" for f, _ in FIELDS)
        out.append(f"| {name} | {mine} | {theirs} |")
    out += ["", "| ratio | steady | p10 |", "|---|---|---|"]
    for a, b in RATIOS:
        out.append(f"| `{a}` / `{b}` | " + " | ".join(f"{paired(runs, a, b, f, '/'):.3f}" for f, _ in FIELDS) + " |")
    failed = [f"{r['framework']} (round {r['round'] + 1}): {r['error']}" for r in runs if "error" in r]
    if failed:
        out += ["", "Failed runs, left out: " + "; ".join(failed)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=WORKLOADS["epochs"].epochs, help="epochs a run (default 200)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the steps per epoch (a smoke run: 0.2)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as failed")
    ap.add_argument("--json", type=Path, default=None, help="also write every run's figures here")
    args = ap.parse_args(argv)
    work = replace(WORKLOADS["epochs"], epochs=args.epochs).scaled(args.scale)
    started, runs = time.perf_counter(), []
    for n in range(args.rounds):
        for variant in VARIANTS[n % len(VARIANTS):] + VARIANTS[: n % len(VARIANTS)]:
            run = {**_run_worker(variant, work, args.timeout), "round": n}
            runs.append(run)
            print(f"round {n + 1}/{args.rounds} {variant:<22} "
                  f"{run.get('error') or format(run['epoch_ms'], '.2f') + ' ms/epoch'}", file=sys.stderr, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs}, indent=1))
    shown = " ".join(sys.argv[1:] if argv is None else argv)
    print(render(runs, shown, work.epochs, (time.perf_counter() - started) / 60))
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
