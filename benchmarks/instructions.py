"""Instructions per steady epoch, counted by valgrind's cachegrind: the framework's own work without
the host's noise.

Wall-time ratios on a shared machine move by 5 to 30% between runs (see ``compare.py``'s *How to read
it*), which hides a 2% cost. The number of instructions a process executes does not move: each
framework runs ``compare.py``'s worker twice under ``valgrind --tool=cachegrind``, once for
``--short`` and once for ``--long`` epochs, with one hash seed (``PYTHONHASHSEED=0``: dict probing
would otherwise differ between processes) and one thread; the difference over the extra epochs is
what one steady epoch costs, start-up and teardown cancelled out. The first framework is the
baseline of the others' ratios, and the functions where each spends more than it are listed.

Instructions are not time: cache misses and branch mispredictions add time that this does not see,
so a ratio here is a floor under the wall-time ratio, not a replacement for it.

    python benchmarks/instructions.py                                   # raw vs fsm on epochs: ~4 min on 2 cores
    python benchmarks/instructions.py --frameworks raw_all,fsm_all --workload tiny --scale 0.05

It needs ``valgrind`` (Debian: ``apt-get install valgrind``); without it, it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import WORKLOADS, Workload, _pythonpath  # noqa: E402  (beside this file)
from compare_loops import LOOPS  # noqa: E402

Where = tuple[str, str]  # (source file, function) as cachegrind names them


@dataclass(frozen=True)
class Count:
    total: int
    by_function: Counter[Where]


def parse_cachegrind(text: str) -> Count:
    """The ``Ir`` (instructions executed) of a cachegrind output file, in all and per function."""
    by_function: Counter[Where] = Counter()
    events: list[str] = []
    total: int | None = None
    fl = fn = "???"
    for line in text.splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("fl="):
            fl = line[3:].strip().rsplit("/", 1)[-1]
        elif line.startswith("fn="):
            fn = line[3:].strip()
        elif line.startswith("summary:"):
            total = int(line.split()[1 + events.index("Ir")])
        elif line[:1].isdigit():
            fields = line.split()
            if len(fields) > 1 + events.index("Ir"):
                by_function[(fl, fn)] += int(fields[1 + events.index("Ir")])
    if not events or "Ir" not in events or total is None:
        raise ValueError("not a cachegrind output file: no 'events:' line with Ir, or no 'summary:' line")
    return Count(total, by_function)


def per_epoch(short: Count, long: Count, extra_epochs: int) -> Count:
    """What one steady epoch costs: the long run minus the short one, over the epochs it adds."""
    functions = set(short.by_function) | set(long.by_function)
    by_function = Counter({k: (long.by_function[k] - short.by_function[k]) // extra_epochs for k in functions})
    return Count((long.total - short.total) // extra_epochs, by_function)


def _run(framework: str, work: Workload, out: Path) -> Count:
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": _pythonpath()}
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
           sys.executable, str(HERE / "compare.py"), "--worker", framework, json.dumps(asdict(work))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{framework} with {work.epochs} epochs under cachegrind: exit {proc.returncode}\n{tail}")
    return parse_cachegrind(out.read_text())


def report(work: Workload, frameworks: Sequence[str], counts: dict[str, Count], top: int) -> str:
    base_name = frameworks[0]
    base = counts[base_name]
    lines = [f"# Instructions per steady epoch: {work.name}", "",
             f"{work.describe()}. Counted by `valgrind --tool=cachegrind` (one hash seed, one thread); "
             "a floor under the wall-time ratio, not a replacement for it (see this script's docstring).", "",
             "| framework | instructions per epoch | per train step | ratio |", "|---|---|---|---|"]
    for name in frameworks:
        c = counts[name]
        lines.append(f"| {name} | {c.total / 1e6:.2f} M | {c.total / work.train_steps / 1e3:.1f} K | "
                     f"{c.total / base.total:.4f} |")
    for name in frameworks[1:]:
        c = counts[name]
        diff = Counter({k: c.by_function[k] - base.by_function[k]
                        for k in set(c.by_function) | set(base.by_function)})
        lines += ["", f"Where {name} executes more than {base_name}, per epoch "
                  f"(+{(c.total - base.total) / 1e3:.0f} K in all):", "",
                  "| K instructions | function | source |", "|---|---|---|"]
        for (fl, fn), n in diff.most_common(top):
            if n <= 0:
                break
            lines.append(f"| {n / 1e3:.1f} | `{fn[:100]}` | {fl} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default="raw,fsm", help="comma-separated; the first is the baseline")
    ap.add_argument("--workload", default="epochs", choices=sorted(WORKLOADS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the steps per epoch")
    ap.add_argument("--short", type=int, default=3, help="epochs of the short run (default 3)")
    ap.add_argument("--long", type=int, default=13, help="epochs of the long run (default 13)")
    ap.add_argument("--top", type=int, default=15, help="functions listed per framework")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    ap.add_argument("--output", type=Path, default=None, help="write the report there too")
    args = ap.parse_args(argv)
    frameworks = args.frameworks.split(",")
    unknown = [f for f in frameworks if f not in LOOPS]
    if unknown or len(frameworks) < 2:
        ap.error(f"--frameworks: two or more of {', '.join(LOOPS)}; got {args.frameworks!r}")
    if not 2 <= args.short < args.long:
        ap.error(f"--short and --long: 2 <= short < long (two steady epochs at least); got {args.short}, {args.long}")
    if shutil.which("valgrind") is None:
        print("instructions.py needs valgrind (Debian: apt-get install valgrind); none on PATH, nothing was run",
              file=sys.stderr)
        return 2
    work = WORKLOADS[args.workload].scaled(args.scale)
    runs = [(f, n) for f in frameworks for n in (args.short, args.long)]
    with tempfile.TemporaryDirectory(prefix="fsmtrain-cachegrind-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = {(f, n): pool.submit(_run, f, replace(work, epochs=n), Path(tmp) / f"{f}.{n}.out") for f, n in runs}
        got = {key: fut.result() for key, fut in futures.items()}
    counts = {f: per_epoch(got[(f, args.short)], got[(f, args.long)], args.long - args.short) for f in frameworks}
    text = report(work, frameworks, counts, args.top)
    print(text, end="")
    if args.output:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
