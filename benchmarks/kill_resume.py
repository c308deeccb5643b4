"""Kill a real quickstart run with SIGKILL many times (some mid checkpoint write), resume it each
time, and check that it ends with the weights of an uninterrupted run, to the bit, and that every
log passes the audit.

    python benchmarks/kill_resume.py --kills 25 --trials 2

Prints one line per trial and exits 1 if any trial ends with different weights or a failing audit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from resume_harness import fsmtrain, random_kills, run_with_kills, same_weights  # noqa: E402

from fsmtrain.tools.audit import audit_file  # noqa: E402

QUICK = ROOT / "configs" / "quickstart.yaml"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=25, help="SIGKILLs per trial (default 25)")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=30, help="epochs of the run (room for the kills)")
    parser.add_argument("--keep-last-k", type=int, default=1)
    args = parser.parse_args()
    overrides = (f"epochs={args.epochs}", "wandb.enabled=false", f"checkpoint.keep_last_k={args.keep_last_k}")
    failures = 0
    with tempfile.TemporaryDirectory(prefix="fsmtrain-kill-") as tmp:
        ref = Path(tmp) / "reference"
        ref.mkdir()
        proc = fsmtrain("train", str(QUICK), *[a for o in overrides for a in ("--set", o)], cwd=ref)
        if proc.wait(timeout=600) != 0:
            print("reference run failed", file=sys.stderr)
            return 2
        for trial in range(args.trials):
            work = Path(tmp) / f"trial{trial}"
            work.mkdir()
            t0 = time.monotonic()
            report = run_with_kills(QUICK, work, work / RUN, random_kills(args.kills, seed=trial, epochs=args.epochs),
                                    *overrides, timeout=3600)
            same = same_weights(work / RUN / "model.pt", ref / RUN / "model.pt")
            audit = audit_file(work / RUN / "events.jsonl")
            mid = sum("checkpoint write" in k for k in report.kills)
            ok = same and audit.ok
            failures += not ok
            print(f"trial {trial}: {len(report.kills)} SIGKILLs ({mid} during a checkpoint write), "
                  f"{report.processes} processes, {time.monotonic() - t0:.0f} s: weights "
                  f"{'bit-identical' if same else 'DIFFER'}, audit {'ok' if audit.ok else 'FAILED'}", flush=True)
            if not audit.ok:
                print(audit.render(False), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
