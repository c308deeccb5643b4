"""fsmtrain side by side with a raw PyTorch loop, Ignite and Lightning, doing the same work.

Every run is a fresh process (this script with ``--worker``), one torch thread, runs interleaved
across frameworks in a rotating order, medians over ``--rounds``. Every loop trains the same MLP on
the same pre-collated batches with AdamW and MSE, so all must end with the same weights: a sha256
of the final ``state_dict`` is compared across frameworks per workload, and a mismatch is reported
loudly (and fails the exit status). The loops are in ``compare_loops.py``.

Figures per run: the steady-state time (between the start of epoch 2 and the start of the last
epoch, so imports, W&B start-up, the first epoch's warm-up and teardown stay out), from which µs per
train step, ms per epoch and the ratio to ``raw`` / ``raw_all`` come; the whole run (``total``, from
building the framework's objects to the end of training), the extra cost of the first epoch over a
steady one (``setup``), the framework's import time (beyond torch) and the peak RSS of the process.

    python benchmarks/compare.py                 # full, 5 rounds: 30 min on a shared 2-core machine (load ~4)
    python benchmarks/compare.py --quick         # tiny and epochs, reduced, one round: 2.9 min there
    python benchmarks/compare.py --frameworks raw,fsm --workloads tiny --rounds 1 --scale 0.05 --output out.md
    python benchmarks/compare.py --workloads large --frameworks raw_all,fsm_all --rounds 1   # checkpoint cost
    python benchmarks/compare.py --device cuda   # gpu_mlp and epochs on the GPU, where one exists

Rows with checkpoints report the stall each checkpoint puts on the training thread (``raw_all``: its
synchronous ``torch.save``; fsmtrain: ``CheckpointCallback``'s time, the staging copy) beside the time
of one plain copy of the same state (a clone of every tensor on CPU; on CUDA a copy into pinned host
memory). Where ``fsm_all`` runs the ``epochs`` workload, it also runs, paired with it, with ``log.fsync``
``never`` and ``every`` (the default is ``commits``), for the cost of the log's fsyncs, and with each
checkpoint written on the training thread (``checkpoint.background: false``), for what the writer thread
saves or costs.

Peers missing (``pip install -e '.[bench]'``) are skipped and named in the output.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FRAMEWORKS = ("raw", "raw_all", "raw_all_durable", "fsm", "fsm_all", "ignite", "ignite_all", "lightning",
              "lightning_all")
BASELINE = {"raw": "raw", "fsm": "raw", "ignite": "raw", "lightning": "raw", "raw_all": "raw_all",
            "raw_all_durable": "raw_all", "fsm_all": "raw_all", "ignite_all": "raw_all", "lightning_all": "raw_all"}
DURABLE = "raw_all_durable"  # the rows with callbacks are also paired with it: the same integrity and fsync work
PEER_PACKAGE = {"ignite": "ignite", "lightning": "lightning"}  # framework prefix -> module that must exist
SUMMARY_ROWS = (
    ("fsm", "fsmtrain core, no callbacks / raw"), ("ignite", "Ignite / raw"), ("lightning", "Lightning / raw"),
    ("fsm_all", "fsmtrain + nine built-ins / raw_all"), ("ignite_all", "Ignite + equivalents / raw_all"),
    ("lightning_all", "Lightning + equivalents / raw_all"),
)


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    in_features: int
    hidden: tuple[int, int]
    batch: int
    epochs: int
    train_steps: int
    val_steps: int
    out_features: int = 1
    device: str = "cpu"

    def describe(self) -> str:
        h1, h2 = self.hidden
        where = "" if self.device == "cpu" else f", on {self.device}"
        return (f"{self.in_features}→{h1}→{h2}→{self.out_features} MLP, batch {self.batch}, {self.epochs} epochs x "
                f"({self.train_steps} train + {self.val_steps} val) steps{where}; {self.what}")

    def scaled(self, factor: float) -> Workload:
        return replace(self, train_steps=max(1, round(self.train_steps * factor)),
                       val_steps=max(1, round(self.val_steps * factor)))


WORKLOADS = {
    "tiny": Workload("tiny", "per-step costs dominate", 32, (64, 64), 64, 4, 1000, 500),
    "epochs": Workload("epochs", "per-epoch costs dominate, as in short HPO trials", 32, (64, 64), 64, 200, 20, 5),
    "wide": Workload("wide", "compute dominates", 256, (1024, 1024), 256, 4, 20, 5),
    "large": Workload("large", "a 76 MB state (6.3M parameters and AdamW's moments): the checkpoint dominates", 1024,
                      (2048, 2048), 32, 10, 20, 5, out_features=16),
}
# --device cuda: the state of issue 22's H100 measurement (252 MB with AdamW), and the epochs workload
GPU_WORKLOADS = {
    "gpu_mlp": Workload("gpu_mlp", "a 252 MB state on the GPU, data already on the device", 1024, (4096, 4096), 512, 8,
                        100, 20, out_features=16, device="cuda"),
    "epochs": replace(WORKLOADS["epochs"], device="cuda"),
}
# fsm_all with one setting changed, paired with it on epochs: the setting as the report shows it
NINE_VARIANTS = {"fsm_all_fsync_never": "log.fsync: never", "fsm_all_fsync_every": "log.fsync: every",
                 "fsm_all_foreground": "checkpoint.background: false"}
# --quick: the same shapes, fewer steps and epochs (still >= 4 epochs, so there is a steady window);
# a run then costs little more than its process start (torch, the framework, W&B).
QUICK = {
    "tiny": replace(WORKLOADS["tiny"], train_steps=200, val_steps=100),
    "epochs": replace(WORKLOADS["epochs"], epochs=40),
    "wide": replace(WORKLOADS["wide"], train_steps=4, val_steps=1),
    "large": WORKLOADS["large"],
}


# --- worker: one framework, one workload, in this process -----------------------------------------
MARK_CALL_ENV = "FSMTRAIN_BENCH_MARK_CALL"
MARK_CALL = "getppid"


class _CalledMarks(list[float]):
    """Epoch marks that also call ``getppid()``, a libc call nothing else in the worker makes:
    ``instructions.py`` has callgrind dump its counters on entering it (``--dump-before=getppid``),
    so each epoch's instructions come out on their own."""

    def append(self, mark: float) -> None:
        os.getppid()
        super().append(mark)


def _weights_sha256(model: Any) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def worker(framework: str, work: Workload) -> dict[str, Any]:
    t_start = time.perf_counter()
    import torch
    from torch import nn

    torch.set_num_threads(1)
    t_torch = time.perf_counter()
    sys.path.insert(0, str(HERE))
    from compare_loops import LOOPS, Job

    loop, _, modules = LOOPS[framework]
    t_import = time.perf_counter()
    for module in modules:  # the framework's import cost, measured before its clock starts
        __import__(module)
    import_s = time.perf_counter() - t_import

    device = torch.device(work.device)
    g = torch.Generator().manual_seed(0)
    n_train, n_val = work.train_steps * work.batch, work.val_steps * work.batch
    w = torch.randn(work.in_features, work.out_features, generator=g)
    x = torch.randn(n_train + n_val, work.in_features, generator=g)
    y = torch.tanh(x @ w / work.in_features**0.5) + 0.1 * torch.randn(n_train + n_val, work.out_features, generator=g)
    batches = [(x[i : i + work.batch].to(device), y[i : i + work.batch].to(device))
               for i in range(0, n_train + n_val, work.batch)]
    torch.manual_seed(0)
    h1, h2 = work.hidden
    model = nn.Sequential(nn.Linear(work.in_features, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU(),
                          nn.Linear(h2, work.out_features)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory(prefix=f"bench-{framework}-") as tmp:
        job = Job(model, optimizer, batches[: work.train_steps], batches[work.train_steps :], work.epochs, Path(tmp),
                  device)
        if os.environ.get(MARK_CALL_ENV):
            job.marks = _CalledMarks()
        syncs = _SyncCounter(device, job.marks)
        t0, c0 = time.perf_counter(), time.process_time()
        with syncs:
            extra = loop(job)
        t_end, cpu_s = time.perf_counter(), time.process_time() - c0
    if framework in ("raw_all", "raw_all_durable", "fsm_all"):
        extra.update(_copy_of_the_state_ms(model, optimizer, device))
    if device.type == "cuda":
        extra["syncs_per_epoch"] = syncs.per_epoch()
    marks = job.marks
    if len(marks) != work.epochs:
        raise RuntimeError(f"{framework} ran {len(marks)} of {work.epochs} epochs")
    steady = marks[-1] - marks[1]
    steady_epochs = len(marks) - 2
    epoch_s = steady / steady_epochs
    # Each steady epoch's own time: load on a shared machine only ever adds time, so a low quantile
    # of them is what the work itself costs (the minimum when there are fewer than ten).
    durations = sorted(b - a for a, b in itertools.pairwise(marks[1:]))
    return {
        "framework": framework, "workload": work.name, "sha256": _weights_sha256(model),
        "steady_s": steady, "epoch_ms": 1e3 * epoch_s, "epoch_p10_ms": 1e3 * durations[len(durations) // 10],
        "step_us": 1e6 * steady / (steady_epochs * work.train_steps),
        "total_s": t_end - t0, "cpu_s": cpu_s, "setup_s": (marks[1] - t0) - epoch_s, "import_s": import_s,
        "torch_import_s": t_torch - t_start,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        **extra,
    }


def _state_tensors(model: Any, optimizer: Any) -> list[Any]:
    import torch

    tensors = list(model.state_dict().values())
    for per_param in optimizer.state_dict()["state"].values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return tensors


def _copy_of_the_state_ms(model: Any, optimizer: Any, device: Any) -> dict[str, float]:
    """One plain copy of the checkpointed state (model and optimizer tensors), the median of 5: a clone
    of every tensor on CPU; on CUDA a copy into pinned host memory, waited for."""
    import torch

    tensors = _state_tensors(model, optimizer)
    times = []
    if device.type == "cuda":
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for buf, t in zip(pinned, tensors, strict=True):
                buf.copy_(t, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    else:
        for _ in range(5):
            t0 = time.perf_counter()
            copies = [t.clone() for t in tensors]
            times.append(time.perf_counter() - t0)
            del copies
    return {"copy_ms": 1e3 * statistics.median(times),
            "state_mb": sum(t.numel() * t.element_size() for t in tensors) / 2**20}


class _SyncCounter:
    """On CUDA, the host syncs torch reports per epoch (``set_sync_debug_mode("warn")``), counted from
    each warning's time against the epoch marks; nothing on CPU."""

    def __init__(self, device: Any, marks: list[float]) -> None:
        self.cuda = device.type == "cuda"
        self.marks = marks
        self.times: list[float] = []
        self._catch: Any = None

    def __enter__(self) -> _SyncCounter:
        if self.cuda:
            import warnings

            import torch

            self._catch = warnings.catch_warnings()
            self._catch.__enter__()
            warnings.simplefilter("always")
            real = warnings.showwarning

            def record(message: Any, *args: Any, **kw: Any) -> None:
                if "synchroniz" in str(message):
                    self.times.append(time.perf_counter())
                else:
                    real(message, *args, **kw)

            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)

    def per_epoch(self) -> list[int]:
        """Syncs in each epoch from the second on (the first sets things up)."""
        bounds = [*self.marks[1:], math.inf]
        return [sum(a <= t < b for t in self.times) for a, b in itertools.pairwise(bounds)]


# --- parent: schedule, collect, report ------------------------------------------------------------
def _available(framework: str) -> bool:
    package = PEER_PACKAGE.get(framework.removesuffix("_all"))
    return package is None or importlib.util.find_spec(package) is not None


def _gpu_name() -> str:
    import torch

    return str(torch.cuda.get_device_name(0))


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def _run_worker(framework: str, work: Workload, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "PYTHONPATH": _pythonpath()}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", framework, json.dumps(asdict(work))]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"framework": framework, "workload": work.name, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return result
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"framework": framework, "workload": work.name, "error": f"exit {proc.returncode}: {tail}"}


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def _pairs(results: list[dict[str, Any]], workload: str, fw: str, base: str
           ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(run of ``fw``, run of ``base``) of the same workload and round, both successful."""
    def by_round(name: str) -> dict[int, dict[str, Any]]:
        return {r["round"]: r for r in results if r["workload"] == workload and r["framework"] == name
                and "error" not in r}

    mine, theirs = by_round(fw), by_round(base)
    return [(mine[r], theirs[r]) for r in sorted(mine) if r in theirs]


def _ranges(paired: dict[str, tuple[str, list[tuple[dict[str, Any], dict[str, Any]]]]]
            ) -> dict[str, tuple[float, float]]:
    """Each ratio's lowest and highest over the rounds (``name -> (field, pairs)``), where there are two or more:
    how far apart the rounds of one report are, beside their median."""
    out: dict[str, tuple[float, float]] = {}
    for name, (field, pairs) in paired.items():
        values = [a[field] / b[field] for a, b in pairs]
        if len(values) > 1:
            out[name] = (min(values), max(values))
    return out


def summarize(results: list[dict[str, Any]], frameworks: Sequence[str], workloads: Sequence[Workload]
              ) -> dict[str, dict[str, Any]]:
    """workload -> {"frameworks": framework -> medians and ratios, "weights_match", "hashes"}."""
    out: dict[str, dict[str, Any]] = {}
    for work in workloads:
        table: dict[str, dict[str, Any]] = {}
        for fw in frameworks:
            mine = [r for r in results if r["workload"] == work.name and r["framework"] == fw]
            rows = [r for r in mine if "error" not in r]
            errors = [r["error"] for r in mine if "error" in r]
            if not rows:
                table[fw] = {"error": errors[0] if errors else "no result"}
                continue
            entry: dict[str, Any] = {k: _median(rows, k) for k in
                                     ("steady_s", "epoch_ms", "epoch_p10_ms", "step_us", "total_s", "setup_s",
                                      "import_s", "rss_mb", "torch_import_s")}
            entry["runs"] = len(rows)
            entry["errors"] = errors
            entry["sha256"] = sorted({r["sha256"] for r in rows})
            if "callback_ms" in rows[0]:
                names = rows[0]["callback_ms"]
                entry["callback_ms"] = {n: statistics.median(r["callback_ms"].get(n, 0.0) for r in rows) for n in names}
            for key in ("stall_ms", "copy_ms", "state_mb"):
                if all(key in r for r in rows):
                    entry[key] = _median(rows, key)
            if all("syncs_per_epoch" in r for r in rows):
                entry["max_syncs_per_epoch"] = max(max(r["syncs_per_epoch"], default=0) for r in rows)
            table[fw] = entry
        for fw, entry in table.items():
            # Paired within a round (runs next to each other in time), then the median over rounds:
            # a shared machine's load drifts between rounds, and this way it moves one pair, not the result.
            pairs = _pairs(results, work.name, fw, BASELINE[fw])
            if "error" in entry or not pairs:
                continue
            entry["ratio"] = statistics.median(a["steady_s"] / b["steady_s"] for a, b in pairs)
            entry["total_ratio"] = statistics.median(a["total_s"] / b["total_s"] for a, b in pairs)
            entry["ranges"] = _ranges({"ratio": ("steady_s", pairs), "total_ratio": ("total_s", pairs),
                                       "p10_ratio": ("epoch_p10_ms", pairs)})
            entry["delta_ms_epoch"] = statistics.median(a["epoch_ms"] - b["epoch_ms"] for a, b in pairs)
            entry["rss_ratio"] = statistics.median(a["rss_mb"] / b["rss_mb"] for a, b in pairs)
            entry["p10_ratio"] = statistics.median(a["epoch_p10_ms"] / b["epoch_p10_ms"] for a, b in pairs)
            entry["p10_delta_ms"] = statistics.median(a["epoch_p10_ms"] - b["epoch_p10_ms"] for a, b in pairs)
            durable = _pairs(results, work.name, fw, DURABLE) if BASELINE[fw] == "raw_all" and fw != DURABLE else []
            if durable:
                entry["durable_ratio"] = statistics.median(a["steady_s"] / b["steady_s"] for a, b in durable)
                entry["ranges"].update(_ranges({"durable_ratio": ("steady_s", durable),
                                                "durable_total_ratio": ("total_s", durable)}))
                entry["durable_total_ratio"] = statistics.median(a["total_s"] / b["total_s"] for a, b in durable)
                entry["durable_delta_ms"] = statistics.median(a["epoch_ms"] - b["epoch_ms"] for a, b in durable)
                entry["durable_total_delta_ms"] = statistics.median(
                    1e3 * (a["total_s"] - b["total_s"]) / work.epochs for a, b in durable)
            entry["total_delta_ms"] = statistics.median(1e3 * (a["total_s"] - b["total_s"]) / work.epochs
                                                        for a, b in pairs)
        variants: dict[str, dict[str, float]] = {}
        for fw in NINE_VARIANTS:  # one setting changed, paired with fsm_all in each round
            pairs = _pairs(results, work.name, fw, "fsm_all")
            if pairs:
                variants[fw] = {"ratio": statistics.median(a["steady_s"] / b["steady_s"] for a, b in pairs),
                             "delta_ms_epoch": statistics.median(a["epoch_ms"] - b["epoch_ms"] for a, b in pairs),
                             "epoch_ms": statistics.median(a["epoch_ms"] for a, _ in pairs), "runs": len(pairs)}
        hashes = {fw: e["sha256"] for fw, e in table.items() if "sha256" in e}
        distinct = {h for hs in hashes.values() for h in hs}
        out[work.name] = {"frameworks": table, "weights_match": len(distinct) <= 1, "hashes": hashes,
                          "variants": variants}
    return out


# --- CLI start-up -----------------------------------------------------------------------------------
def cli_startup(runs: int) -> dict[str, Any]:
    """Median wall time of ``fsmtrain --help``, ``audit``, ``diagram`` and ``validate`` (fresh processes)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "CI": "1",
           "PYTHONPATH": _pythonpath()}
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        train = subprocess.run([sys.executable, "-m", "fsmtrain", "train", str(REPO / "configs" / "quickstart.yaml"),
                                "--run-dir", tmp], env=env, capture_output=True, text=True, timeout=600)
        events = sorted(Path(tmp).rglob("events.jsonl"))
        if train.returncode != 0 or not events:
            return {"error": f"quickstart training failed: {train.stderr.strip()[-300:]}"}
        commands = {
            "fsmtrain --help": ["--help"],
            "fsmtrain audit <quickstart events.jsonl>": ["audit", str(events[0])],
            "fsmtrain diagram": ["diagram"],
            "fsmtrain validate configs/quickstart.yaml": ["validate", str(REPO / "configs" / "quickstart.yaml")],
        }
        script = Path(sys.executable).with_name("fsmtrain")
        launchers = {"python -m fsmtrain": [sys.executable, "-m", "fsmtrain"]}
        if script.exists():
            launchers["fsmtrain script"] = [str(script)]
        out: dict[str, Any] = {}
        for name, args in commands.items():
            for launcher, prefix in launchers.items():
                times = []
                for _ in range(runs):
                    t = time.perf_counter()
                    subprocess.run([*prefix, *args], env=env, capture_output=True, timeout=120, check=False)
                    times.append(time.perf_counter() - t)
                out.setdefault(name, {})[launcher] = statistics.median(times)
    return out


# --- report -------------------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for dist in ("torch", "fsmtrain", "pytorch-ignite", "lightning", "wandb", "optuna", "transitions", "structlog"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


_BUSY = ("import time\nw, c = time.perf_counter(), time.process_time()\n"
         "while time.perf_counter() - w < {s}:\n    sum(range(1000))\n"
         "print((time.process_time() - c) / (time.perf_counter() - w))")


def cpu_capacity(seconds: float = 0.5) -> float:
    """The CPUs this machine gives at once: as many busy Python processes as it has cores, side by
    side, each its own CPU time over wall time, summed. A virtual machine may give less than its
    cores (one here gave 2 cores 1.3 CPUs): then a background thread or process (a checkpoint
    writer, W&B's service) takes its CPU from the training thread."""
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY.format(s=seconds)], stdout=subprocess.PIPE, text=True)
             for _ in range(os.cpu_count() or 1)]
    return sum(float(p.communicate()[0]) for p in procs)


def _fmt_ratio(entry: dict[str, Any], key: str = "ratio", delta: str = "delta_ms_epoch") -> str:
    if "error" in entry:
        return "n/a"
    if key not in entry:
        return "n/a (no baseline)"
    spread = entry.get("ranges", {}).get(key)
    shown = "" if spread is None else f" [{spread[0]:.2f}-{spread[1]:.2f}]"
    return f"{entry[key]:.2f}{shown} ({entry[delta]:+.2f} ms/epoch)"


def _stall_lines(work: Workload, s: dict[str, Any]) -> list[str]:
    """The checkpoint's stall on the training thread beside one plain copy of the state; the nine with one
    setting changed."""
    from compare_loops import LOOPS

    rows = [(fw, e) for fw, e in s["frameworks"].items() if "stall_ms" in e]
    out: list[str] = []
    if rows:
        copy = "a copy into pinned host memory" if work.device == "cuda" else "a clone of every tensor"
        out += ["", f"Checkpoint stall on the training thread, median per checkpoint (epochs 2 on), beside one plain "
                f"copy of the same state ({copy}, median of 5):", "",
                "| framework | stall ms/checkpoint | one copy of the state ms | stall / copy | state MB | "
                "host syncs per epoch (max, epochs 2 on) |", "|---|---|---|---|---|---|"]
        for fw, e in rows:
            copy_ms = e.get("copy_ms")
            ratio = f"{e['stall_ms'] / copy_ms:.2f}" if copy_ms else "-"
            syncs = e.get("max_syncs_per_epoch", "-")
            out.append(f"| {LOOPS[fw][1]} | {e['stall_ms']:.2f} | {copy_ms if copy_ms is None else f'{copy_ms:.2f}'} "
                       f"| {ratio} | {e.get('state_mb', float('nan')):.1f} | {syncs} |")
    if s.get("variants"):
        out += ["", "fsmtrain + nine with one setting changed (its defaults: `log.fsync: commits`, "
                "`checkpoint.background: true`), paired with it per round:", "",
                "| setting | ratio to the defaults | ms/epoch difference | runs |", "|---|---|---|---|"]
        for fw, f in s["variants"].items():
            out.append(f"| {NINE_VARIANTS[fw]} | {f['ratio']:.3f} | {f['delta_ms_epoch']:+.2f} | {f['runs']} |")
    return out


def render(summary: dict[str, dict[str, Any]], workloads: Sequence[Workload], frameworks: Sequence[str],
           skipped: Sequence[str], meta: dict[str, Any], cli: dict[str, Any] | None) -> str:
    from compare_loops import LOOPS

    lines = ["# fsmtrain vs raw PyTorch, Ignite and Lightning", "",
             f"Generated by `python benchmarks/compare.py {meta['argv']}` on {meta['date']} "
             f"in {meta['wall_min']:.1f} min.", ""]
    lines += ["## Machine", "",
              f"- {meta['cpu']}, {meta['cores']} cores; {meta['platform']}; Python {meta['python']}",
              f"- load average before/after: {meta['load_before']} / {meta['load_after']}"
              + (" (**the machine was shared and loaded during the measurement**: absolute figures are noisy; "
                 "ratios of interleaved runs less so)" if meta["loaded"] else ""),
              f"- CPU capacity before/after: {meta['capacity_before']:.2f} / {meta['capacity_after']:.2f} CPUs "
              f"({meta['cores']} busy processes side by side, their CPU time over wall time summed)"
              + (": **less than the cores**, so the checkpoint writer thread and W&B's service process take "
                 "their CPU from the training thread" if min(meta["capacity_before"], meta["capacity_after"])
                 < 0.9 * meta["cores"] else ""),
              "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
              (f"- GPU: {meta['gpu']} (`--device cuda`: the workloads train on it, data already on the device)"
               if meta.get("gpu") else "- no GPU used: CPU figures (`--device cuda` runs gpu_mlp and epochs where a "
               "GPU exists)"),
              f"- {meta['rounds']} round(s); each run a fresh process, one torch thread, frameworks interleaved "
              "in a rotating order; figures are medians over rounds", ""]
    if meta["quick"] or meta["rounds"] < 3:
        lines += [f"**{'Quick mode' if meta['quick'] else 'Few rounds'}: reduced workloads and/or "
                  f"{meta['rounds']} round(s).** A smoke check of the whole pipeline, not a measurement: one run "
                  "per framework carries the machine's noise in full. `python benchmarks/compare.py` "
                  "(5 rounds, full sizes) gives the figures to compare.", ""]
    if skipped:
        lines += [f"**Skipped (not installed):** {', '.join(skipped)}. Install with `pip install -e '.[bench]'`.", ""]
    lines += ["## Summary: ratio of steady-state time (same work)", "",
              "| ratio | " + " | ".join(w.name for w in workloads) + " |",
              "|---|" + "---|" * len(workloads)]
    for fw, label in SUMMARY_ROWS:
        if fw in frameworks:
            lines.append(f"| {label} | " + " | ".join(_fmt_ratio(summary[w.name]["frameworks"][fw]) for w in workloads)
                         + " |")
    lines += ["", "### The same, from the 10th percentile of each run's steady epoch times", "",
              "Less noisy where a workload has many epochs (see *How to read it*; tiny and wide have two steady "
              "epochs each, so this is their faster epoch).", "",
              "| ratio | " + " | ".join(w.name for w in workloads) + " |", "|---|" + "---|" * len(workloads)]
    for fw, label in SUMMARY_ROWS:
        if fw in frameworks:
            lines.append(f"| {label} | " + " | ".join(
                _fmt_ratio(summary[w.name]["frameworks"][fw], "p10_ratio", "p10_delta_ms") for w in workloads) + " |")
    lines += ["", "### The whole fit (`fit` called to returned: start-up, every epoch, the final drain)", "",
              "Short HPO trials are whole fits of a few seconds; the ms are per epoch of the run.", "",
              "| ratio | " + " | ".join(w.name for w in workloads) + " |", "|---|" + "---|" * len(workloads)]
    for fw, label in SUMMARY_ROWS:
        if fw in frameworks:
            lines.append(f"| {label} | " + " | ".join(
                _fmt_ratio(summary[w.name]["frameworks"][fw], "total_ratio", "total_delta_ms") for w in workloads)
                + " |")
    if DURABLE in frameworks:
        lines += ["", f"### Against `{DURABLE}`: `raw_all` that also sha256s each checkpoint, writes it to a temp "
                  "file, fsyncs it, renames it, fsyncs the folder and appends an fsync'd commit line, as fsmtrain "
                  "does", "", "| ratio (steady; whole fit) | " + " | ".join(w.name for w in workloads) + " |",
                  "|---|" + "---|" * len(workloads)]
        for fw, label in SUMMARY_ROWS:
            if fw in frameworks and BASELINE[fw] == "raw_all":
                cells = [(f"{_fmt_ratio(e, 'durable_ratio', 'durable_delta_ms')}; "
                          f"{_fmt_ratio(e, 'durable_total_ratio', 'durable_total_delta_ms')}")
                         for e in (summary[w.name]["frameworks"][fw] for w in workloads)]
                lines.append(f"| {label.replace('/ raw_all', f'/ {DURABLE}')} | " + " | ".join(cells) + " |")
    lines.append("")
    for w in workloads:
        s = summary[w.name]
        ok = s["weights_match"]
        lines += [f"## {w.name}: {w.describe()}", "",
                  "Final weights: " + ("identical in every framework and round (sha256 "
                                       f"`{next(iter(next(iter(s['hashes'].values()))))[:16]}`)" if ok and s["hashes"]
                                       else "**MISMATCH**: " + "; ".join(f"{fw} {[h[:12] for h in hs]}"
                                                                         for fw, hs in s["hashes"].items())), "",
                  "| framework | ratio | p10 ratio | total ratio | µs/train step | ms/epoch | p10 ms/epoch | total s "
                  "| setup s | import s | peak RSS MB | RSS ratio |", "|---" * 12 + "|"]
        for fw in frameworks:
            e = s["frameworks"][fw]
            label = LOOPS[fw][1]
            if "error" in e:
                lines.append(f"| {label} | failed: {e['error']} | | | | | | | | | | |")
                continue
            ratio, p10, total, rss = (f"{e[k]:.{n}f}" if k in e else "-" for k, n in
                                      (("ratio", 3), ("p10_ratio", 3), ("total_ratio", 3), ("rss_ratio", 2)))
            lines.append(
                f"| {label} | {ratio} | {p10} | {total} | {e['step_us']:.1f} | {e['epoch_ms']:.2f} "
                f"| {e['epoch_p10_ms']:.2f} | {e['total_s']:.2f} | {e['setup_s']:.2f} | {e['import_s']:.2f} "
                f"| {e['rss_mb']:.0f} | {rss} |")
        fsm_all = s["frameworks"].get("fsm_all", {})
        if "callback_ms" in fsm_all:
            lines += ["", "fsmtrain's own per-callback time (median over runs of the mean over epochs 2.., from the "
                      "`callback_seconds` of each `epoch` event):", "",
                      "| callback | ms/epoch |", "|---|---|"]
            lines += [f"| {n} | {v:.3f} |" for n, v in sorted(fsm_all["callback_ms"].items(), key=lambda kv: -kv[1])]
            in_callbacks = sum(fsm_all["callback_ms"].values())
            lines.append(f"| **all nine** | **{in_callbacks:.3f}** |")
            core = s["frameworks"].get("fsm", {})
            if "epoch_ms" in core:
                extra = fsm_all["epoch_ms"] - core["epoch_ms"]
                lines += ["", f"fsmtrain + nine minus fsmtrain core: {extra:+.2f} ms/epoch, of which "
                          f"{in_callbacks:.2f} ms inside the callbacks and {extra - in_callbacks:+.2f} ms around "
                          "them (dispatch, slots, their events in the log, the step hooks' batch path)."]
        lines += _stall_lines(w, s)
        lines.append("")
    if cli is not None:
        lines += ["## Start-up of the tools", "",
                  f"Median of {meta['cli_runs']} fresh processes each (`fsmtrain script` is the console script next "
                  "to the interpreter, without any shell shim in front).", ""]
        if "error" in cli:
            lines += [f"failed: {cli['error']}", ""]
        else:
            launchers = sorted({k for v in cli.values() for k in v})
            lines += ["| command | " + " | ".join(f"{x} s" for x in launchers) + " |",
                      "|---|" + "---|" * len(launchers)]
            lines += [f"| `{cmd}` | " + " | ".join(f"{times[x]:.3f}" for x in launchers) + " |"
                      for cmd, times in cli.items()]
            lines.append("")
    lines += ["## How to read it", "",
              "- **ratio**: steady-state time (start of epoch 2 to start of the last epoch) over the same for `raw` "
              "(core rows) or `raw_all` (rows with callbacks), paired within each round, median over rounds; "
              "`total ratio` compares whole runs, start-up included. In the summaries, [low-high] is the lowest and "
              "the highest of the rounds' paired ratios: runs of the same code here have moved their median by "
              "more than a bound's margin, and the spread says how far to trust one. "
              "The other columns are medians over rounds. "
              "**µs/train step** is that steady epoch time (validation included) over its train steps.",
              "- **p10**: the 10th percentile of a run's steady epochs, each timed on its own (the faster one when "
              "there are two), paired and taken to the median like the ratio. Load from other processes only "
              "ever adds time to an epoch, so on a shared machine this follows the work itself where the "
              "whole-window ratio follows the load: in the epochs workload (198 steady epochs) it tells 1% apart, "
              "which fresh processes' medians, moving 5 to 10% between runs, do not. It fits work whose cost is the "
              "same every epoch (the core rows). Rows with callbacks write a checkpoint file every epoch, whose cost "
              "varies from epoch to epoch by its nature (page-cache writeback; `raw_all` writes synchronously, "
              "fsmtrain in the background): there p10 leaves out slow epochs that belong to the work, and the "
              "whole-window ratio is the one to read.",
              "- **setup**: the first epoch's time beyond a steady epoch: building the framework's objects, W&B "
              "start-up, warm-up (slightly negative when it is within the noise). **import**: the framework's "
              "modules beyond torch, imported before the clock starts (torch itself: "
              f"{meta.get('torch_import_s', float('nan')):.2f} s).",
              "- `raw_all` does by hand: the global gradient norm every step with a running max on the device, a "
              "NaN check, one W&B offline log, Optuna `report`/`should_prune`, early-stopping bookkeeping and one "
              "`torch.save` of model and optimizer per epoch. The peers use their closest equivalents (see "
              "`benchmarks/compare_loops.py`). fsmtrain's nine also fit the loss curve (a least-squares "
              "exponential) and check for overfitting each epoch, which no peer does, and write each "
              "checkpoint atomically with fsync (periodic, best and latest).", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "WORKLOAD_JSON"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true",
                    help="tiny and epochs at reduced sizes, one round, 3 runs per CLI command: under 3 minutes")
    ap.add_argument("--rounds", type=int, default=None, help="runs per framework and workload (default 5; quick 1)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated, of: " + ", ".join(FRAMEWORKS))
    ap.add_argument("--workloads", default=None,
                    help="comma-separated, of: " + ", ".join(WORKLOADS) + " (default: all; quick: tiny,epochs)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the steps per epoch (e.g. 0.05 for a smoke run)")
    ap.add_argument("--cli-runs", type=int, default=None,
                    help="runs per CLI start-up command (default 5; quick 3; 0 skips)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run before it counts as failed")
    ap.add_argument("--output", type=Path, default=None,
                    help="markdown report (default benchmarks/RESULTS.md; --device cuda: benchmarks/RESULTS_cuda.md)")
    ap.add_argument("--json", type=Path, default=None,
                    help="also write the raw results here (rewritten after every run: a run cut short keeps them)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the gpu_mlp and epochs workloads on the GPU (needs one)")
    ap.add_argument("--resume", type=Path, default=None,
                    help="a --json file of an invocation cut short: its runs count, only the missing ones run "
                         "(for a GPU lease too short for all rounds in one command)")
    args = ap.parse_args(argv)

    if args.worker:
        framework, work_json = args.worker
        spec = json.loads(work_json)
        result = worker(framework, Workload(**{**spec, "hidden": tuple(spec["hidden"])}))
        print("RESULT " + json.dumps(result))
        return 0

    if args.device == "cuda" and not _has_cuda():
        print("compare.py --device cuda: no CUDA device on this machine (torch.cuda.is_available() is False); "
              "nothing was run. The CPU figures (python benchmarks/compare.py) stand alone.", file=sys.stderr)
        return 2
    catalog = GPU_WORKLOADS if args.device == "cuda" else QUICK if args.quick else WORKLOADS
    output: Path = args.output or HERE / ("RESULTS_cuda.md" if args.device == "cuda" else "RESULTS.md")
    rounds = args.rounds or (1 if args.quick else 5)
    cli_runs = args.cli_runs if args.cli_runs is not None else (3 if args.quick else 5)
    unknown = [f for f in args.frameworks.split(",") if f not in FRAMEWORKS]
    default = ",".join(GPU_WORKLOADS) if args.device == "cuda" else "tiny,epochs" if args.quick else ",".join(WORKLOADS)
    names = (args.workloads or default).split(",")
    unknown += [w for w in names if w not in catalog]
    if unknown:
        ap.error(f"unknown framework or workload: {', '.join(unknown)}")
    wanted = [f for f in FRAMEWORKS if f in args.frameworks.split(",")]
    frameworks = [f for f in wanted if _available(f)]
    skipped = [f for f in wanted if f not in frameworks]
    for f in skipped:
        print(f"skipping {f}: {PEER_PACKAGE[f.removesuffix('_all')]} is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
    workloads = [catalog[w].scaled(args.scale) for w in names]
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    capacity_before = cpu_capacity()
    started = time.perf_counter()
    results: list[dict[str, Any]] = json.loads(args.resume.read_text())["results"] if args.resume else []
    done = {(r["round"], r["workload"], r["framework"]) for r in results if "error" not in r}
    results = [r for r in results if (r["round"], r["workload"], r["framework"]) in done]
    if args.resume:
        print(f"resuming from {args.resume}: {len(results)} run(s) done, kept", file=sys.stderr)
    for r in range(rounds):
        for work in workloads:
            order = frameworks[r % len(frameworks):] + frameworks[: r % len(frameworks)]  # rotate who goes first
            if work.name == "epochs" and "fsm_all" in order and args.device == "cpu":
                order += list(NINE_VARIANTS)  # one setting changed, next to fsm_all in the same round
            for fw in (f for f in order if (r, work.name, f) not in done):
                res = {**_run_worker(fw, work, args.timeout), "round": r}
                results.append(res)
                state = res.get("error") or f"{res['epoch_ms']:.2f} ms/epoch, {res['step_us']:.1f} µs/step"
                print(f"round {r + 1}/{rounds} {work.name:>6} {fw:<14} {state}", file=sys.stderr, flush=True)
                if args.json is not None:  # the runs so far, kept should the whole be cut short
                    args.json.write_text(json.dumps({"results": results, "partial": True}))
    cli = cli_startup(cli_runs) if cli_runs > 0 else None
    load_after = os.getloadavg()
    capacity_after = cpu_capacity()
    summary = summarize(results, frameworks, workloads)
    torch_imports = [r["torch_import_s"] for r in results if "torch_import_s" in r]
    meta = {
        "argv": " ".join(sys.argv[1:] if argv is None else argv), "date": time.strftime("%Y-%m-%d %H:%M"),
        "wall_min": (time.perf_counter() - started) / 60, "cpu": _cpu(), "cores": os.cpu_count(),
        "platform": platform.platform(), "python": platform.python_version(), "versions": _versions(),
        "load_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_after": " ".join(f"{x:.2f}" for x in load_after),
        "capacity_before": capacity_before, "capacity_after": capacity_after,
        # others' load before we start, or more than our own one busy core at the end
        "loaded": load_before[0] > 0.25 * cores or load_after[0] > 0.25 * cores + 1,
        "rounds": rounds, "cli_runs": cli_runs, "quick": args.quick, "device": args.device,
        "gpu": _gpu_name() if args.device == "cuda" else None,
        "torch_import_s": statistics.median(torch_imports) if torch_imports else float("nan"),
    }
    sys.path.insert(0, str(HERE))
    report = render(summary, workloads, frameworks, skipped, meta, cli)
    output.write_text(report + "\n", encoding="utf-8")
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "summary": summary, "meta": meta, "cli": cli}, indent=2))
    print(report)
    mismatched = [w.name for w in workloads if not summary[w.name]["weights_match"]]
    failed = [f"{r['framework']}/{r['workload']}" for r in results if "error" in r]
    if mismatched:
        print(f"\n!!! FINAL WEIGHTS DIFFER between frameworks in: {', '.join(mismatched)} !!!", file=sys.stderr)
    if failed:
        print(f"\n!!! failed runs: {', '.join(failed)}", file=sys.stderr)
    return 1 if mismatched or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
