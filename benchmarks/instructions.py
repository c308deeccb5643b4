"""Instructions per steady epoch, counted by valgrind's callgrind: the framework's own work without
the host's noise.

Wall-time ratios on a shared machine move by 5 to 30% between runs (see ``compare.py``'s *How to read
it*), which hides a 2% cost. The number of instructions an epoch executes hardly moves: each
framework runs ``compare.py``'s worker once under ``valgrind --tool=callgrind``, with one hash seed
(``PYTHONHASHSEED=0``: dict probing would otherwise differ between processes) and one thread. The
worker calls ``getppid()`` at the start of every epoch (where ``FSMTRAIN_BENCH_MARK_CALL`` is set) and
callgrind dumps its counters on entering it, so every epoch's instructions come out on their own;
the steady epochs (all but the first and the last, as ``compare.py`` times them) give a median and a
range. The first framework is the baseline of the others' ratios, and the functions where each
spends more than it are listed.

Why one run with dumps and not the difference of a short and a long run (this script's first
version): what a process spends once (imports, pybind11's type caches, the allocator's layout)
depends on its environment and arguments down to their lengths, and varied by up to 9 M instructions
between two such runs; divided by the extra epochs that moved a "steady epoch" by up to 0.9 M (2%).
An epoch counted between two dumps does not contain any of it.

Instructions are not time: cache misses and branch mispredictions add time that this does not see,
so a ratio here is a floor under the wall-time ratio, not a replacement for it.

    python benchmarks/instructions.py                                   # raw vs fsm on epochs: ~5 min on 2 cores
    python benchmarks/instructions.py --frameworks raw_all,fsm_all --workload tiny --scale 0.05

It needs ``valgrind`` (Debian: ``apt-get install valgrind``); without it, it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
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

from compare import MARK_CALL, MARK_CALL_ENV, WORKLOADS, Workload, _pythonpath  # noqa: E402  (beside this file)
from compare_loops import LOOPS  # noqa: E402

Where = tuple[str, str]  # (source file, function) as callgrind names them


@dataclass(frozen=True)
class Count:
    """One stretch of execution: its instructions in all and per function (self cost)."""

    total: int
    by_function: Counter[Where]


@dataclass(frozen=True)
class Epochs:
    """The steady epochs of one run."""

    totals: list[int]
    by_function: Counter[Where]  # the mean over the epochs

    @property
    def median(self) -> float:
        return statistics.median(self.totals)


def parse_callgrind(text: str) -> Count:
    """The ``Ir`` (instructions executed) of one callgrind dump, in all and per function. A cost
    line right after a ``calls=`` line is the call's inclusive cost, already counted in the callee's
    own lines, so it is left out; inlined code (``fi=``/``fe=``) is counted under its own file, and
    code without debug information under its library (``ob=``). Names may be written in full or
    compressed (``(7) name`` once, ``(7)`` after)."""
    by_function: Counter[Where] = Counter()
    files: dict[str, str] = {}
    functions: dict[str, str] = {}
    objects: dict[str, str] = {}
    ir = -1
    total: int | None = None
    fl = file = fn = obj = "???"
    after_call = False
    for line in text.splitlines():
        head = line[:1]
        if head.isdigit() or head in "+-*":
            if after_call:
                after_call = False
                continue
            fields = line.split()
            if 0 < ir < len(fields):
                by_function[(file, fn)] += int(fields[ir])
            continue
        key, _, value = line.partition("=")
        if key == "ob":
            obj = _name(value, objects).rsplit("/", 1)[-1]
        elif key == "fl":
            fl = file = _name(value, files).rsplit("/", 1)[-1]
            if fl == "???":  # no debug information: the library it is in says more
                fl = file = obj
        elif key in ("fi", "fe"):
            file = _name(value, files).rsplit("/", 1)[-1]
        elif key == "fn":
            # callgrind names a recursion's deeper levels f'2, f'3...: one function for this purpose
            fn, file = re.sub(r"'\d+$", "", _name(value, functions)), fl
        elif key in ("cfi", "cfl"):
            _name(value, files)
        elif key == "cob":
            _name(value, objects)
        elif key == "cfn":
            _name(value, functions)
        elif key == "calls":
            after_call = True
        elif line.startswith("events:"):
            events = line.split()[1:]
            ir = 1 + events.index("Ir") if "Ir" in events else -1
        elif line.startswith("summary:") and ir > 0:
            total = int(line.split()[ir])
    if ir < 0 or total is None:
        raise ValueError("not a callgrind output file: no 'events:' line with Ir, or no 'summary:' line")
    return Count(total, by_function)


def _name(value: str, table: dict[str, str]) -> str:
    """A name as written, or the one its compressed id stands for (defined at its first use)."""
    value = value.strip()
    m = re.fullmatch(r"\((\d+)\)\s*(.*)", value)
    if m is None:
        return value
    ident, name = m.groups()
    if name:
        table[ident] = name
    return table.get(ident, "???")


def steady_epochs(dumps: Sequence[Count], epochs: int) -> Epochs:
    """The epochs between the second mark and the last, from the dumps in order: dump 1 ends at the
    first epoch's mark (start-up), dump ``k`` (2 <= k <= ``epochs``) is epoch ``k - 2``; what comes
    after the last mark (the last epoch, teardown) is in the run's final file, not here."""
    if len(dumps) != epochs:
        raise RuntimeError(f"expected one dump per epoch mark ({epochs}), got {len(dumps)}: something else in the "
                           f"process called {MARK_CALL}(), or the run ended early")
    steady = dumps[2:]
    by_function: Counter[Where] = Counter()
    for d in steady:
        by_function.update(d.by_function)
    return Epochs([d.total for d in steady], Counter({k: v // len(steady) for k, v in by_function.items()}))


def _dump_number(path: Path) -> int:
    return int(path.name.rsplit(".", 1)[1])


def _run(framework: str, work: Workload, folder: Path) -> Epochs:
    folder.mkdir(parents=True)
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": _pythonpath(),
           MARK_CALL_ENV: "1"}
    cmd = ["valgrind", "--tool=callgrind", f"--dump-before={MARK_CALL}", "--compress-strings=no", "--compress-pos=no",
           f"--callgrind-out-file={folder / 'out'}", sys.executable, str(HERE / "compare.py"), "--worker", framework,
           json.dumps(asdict(work))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{framework} with {work.epochs} epochs under callgrind: exit {proc.returncode}\n{tail}")
    dumps = sorted(folder.glob("out.*"), key=_dump_number)
    return steady_epochs([parse_callgrind(p.read_text()) for p in dumps], work.epochs)


def _m(n: float) -> str:
    return f"{n / 1e6:.2f} M"


def report(work: Workload, frameworks: Sequence[str], counts: dict[str, Epochs], top: int) -> str:
    base_name = frameworks[0]
    base = counts[base_name]
    steady = len(base.totals)
    lines = [f"# Instructions per steady epoch: {work.name}", "",
             f"{work.describe()}. Counted by `valgrind --tool=callgrind`, one dump per epoch (one hash seed, one "
             f"thread); the median of {steady} steady epochs, and their range. A floor under the wall-time ratio, "
             "not a replacement for it (see this script's docstring).", "",
             "| framework | instructions per epoch | range | per train step | ratio |", "|---|---|---|---|---|"]
    for name in frameworks:
        c = counts[name]
        lines.append(f"| {name} | {_m(c.median)} | {_m(min(c.totals))} to {_m(max(c.totals))} | "
                     f"{c.median / work.train_steps / 1e3:.1f} K | {c.median / base.median:.4f} |")
    for name in frameworks[1:]:
        c = counts[name]
        diff = Counter({k: c.by_function[k] - base.by_function[k]
                        for k in set(c.by_function) | set(base.by_function)})
        lines += ["", f"Where {name} executes more than {base_name}, per epoch "
                  f"({c.median - base.median:+,.0f} in all, medians; the rows are means):", "",
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
    ap.add_argument("--epochs", type=int, default=7, help="epochs per run (default 7: 5 steady ones)")
    ap.add_argument("--top", type=int, default=15, help="functions listed per framework")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    ap.add_argument("--output", type=Path, default=None, help="write the report there too")
    args = ap.parse_args(argv)
    frameworks = args.frameworks.split(",")
    unknown = [f for f in frameworks if f not in LOOPS]
    if unknown or len(frameworks) < 2:
        ap.error(f"--frameworks: two or more of {', '.join(LOOPS)}; got {args.frameworks!r}")
    if args.epochs < 3:
        ap.error(f"--epochs: 3 or more (the first and the last are not steady); got {args.epochs}")
    if shutil.which("valgrind") is None:
        print("instructions.py needs valgrind (Debian: apt-get install valgrind); none on PATH, nothing was run",
              file=sys.stderr)
        return 2
    work = replace(WORKLOADS[args.workload].scaled(args.scale), epochs=args.epochs)
    with tempfile.TemporaryDirectory(prefix="fsmtrain-callgrind-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = {f: pool.submit(_run, f, work, Path(tmp) / f) for f in frameworks}
        counts = {f: fut.result() for f, fut in futures.items()}
    text = report(work, frameworks, counts, args.top)
    print(text, end="")
    if args.output:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
