"""Smoke test of ``benchmarks/compare.py``: a much reduced run (raw loop and fsmtrain core, one
workload, one round, a few steps per epoch) through the real orchestrator and worker processes.
It checks the report's structure and the weight check, never a timing."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compare_smoke_run_writes_the_report(tmp_path: Path) -> None:
    out, raw = tmp_path / "RESULTS.md", tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compare.py"), "--quick", "--rounds", "1", "--scale", "0.02",
         "--frameworks", "raw,fsm,raw_all,raw_all_durable,fsm_all", "--workloads", "tiny", "--cli-runs", "0",
         "--output", str(out), "--json", str(raw)],
        env=env, capture_output=True, text=True, timeout=380, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out.read_text(encoding="utf-8")
    assert report.startswith("# fsmtrain vs raw PyTorch, Ignite and Lightning")
    for heading in ("## Machine", "## Summary: ratio of steady-state time", "## tiny: ", "## How to read it",
                    "### The same, from the 10th percentile of each run's steady epoch times",
                    "### The whole fit (`fit` called to returned", "### Against `raw_all_durable`"):
        assert heading in report
    assert re.search(r"versions: torch \S+", report)
    # what the machine gives at once: on a VM less than its cores, and background threads are not free
    assert re.search(r"- CPU capacity before/after: \d+\.\d\d / \d+\.\d\d CPUs", report)
    assert "Final weights: identical in every framework and round (sha256 `" in report
    # summary: one row for the core ratio, with a number and the per-epoch difference
    # (the summary, its 10th-percentile twin and the whole fit: one row each)
    core = re.findall(r"^\| fsmtrain core, no callbacks / raw \| \d+\.\d\d \([+-]\d+\.\d\d ms/epoch\) \|$",
                      report, re.M)
    assert len(core) == 3, report
    # the nine against the loop that does fsmtrain's durability by hand: steady and whole fit
    ms = r"\d+\.\d\d \([+-]\d+\.\d\d ms/epoch\)"
    assert re.search(rf"^\| fsmtrain \+ nine built-ins / raw_all_durable \| {ms}; {ms} \|$", report, re.M), report
    rows = [line for line in report.splitlines() if line.startswith(("| raw PyTorch loop |", "| fsmtrain core"))]
    detail = [r for r in rows if r.count("|") == 13]
    assert len(detail) == 2, rows  # raw and fsm, twelve columns each
    assert detail[0].split("|")[2].strip() == "1.000"  # raw against itself
    data = json.loads(raw.read_text())
    runs = {r["framework"]: r for r in data["results"]}
    assert set(runs) == {"raw", "fsm", "raw_all", "raw_all_durable", "fsm_all"}, proc.stderr[-3000:]
    assert len({r["sha256"] for r in runs.values()}) == 1  # the same final weights everywhere
    assert all(r["rss_mb"] > 0 and 0 < r["epoch_p10_ms"] <= r["epoch_ms"] * 1.5 for r in runs.values())
    assert "skipping" not in proc.stderr  # only raw and fsmtrain were asked for: no peer to skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_peer_that_is_not_installed_is_skipped_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import compare

    monkeypatch.setitem(compare.PEER_PACKAGE, "ignite", "no_such_package_for_the_test")  # as if not installed
    out = tmp_path / "RESULTS.md"
    code = compare.main(["--quick", "--rounds", "1", "--scale", "0.02", "--frameworks", "raw,ignite,ignite_all",
                         "--workloads", "tiny", "--cli-runs", "0", "--output", str(out)])
    assert code == 0
    assert "skipping ignite: no_such_package_for_the_test is not installed" in capsys.readouterr().err
    report = out.read_text(encoding="utf-8")
    assert "**Skipped (not installed):** ignite, ignite_all." in report
    assert "| raw PyTorch loop | 1.000 |" in report and "| Ignite |" not in report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_benchmark_smoke_run() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "distributed.py"), "--quick", "--rounds", "50"],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\| (.+?) \| ([\d,]+) \| (\d+\.\d\d)x \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["1 process, 1 thread", "2 processes, 1 thread each"]
    assert all(int(r[1].replace(",", "")) > 0 for r in rows)
    assert re.search(r"guard agreement \(2 ranks, gloo\): \d+ us per agreement", proc.stdout)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here: --device cuda would run in full")
@pytest.mark.timeout(120)
def test_compare_on_cuda_without_a_gpu_says_so_and_runs_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compare.py"), "--device", "cuda",
                           "--output", str(out)], env=env, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no CUDA device on this machine" in proc.stderr and "nothing was run" in proc.stderr
    assert not out.exists()


@pytest.mark.timeout(120)
def test_checkpoint_write_benchmark_runs_on_a_real_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/checkpoint_write.py`` on the small state, one round; no timing is asserted."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import checkpoint_write
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert checkpoint_write.main(["--rounds", "1", "--shapes", "small", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"small"}
    assert set(results["small"]) == {"write_us", "bytes"}
    assert results["small"]["bytes"] > 50_000  # model, AdamW moments, RNG states: a real checkpoint


def _run(workload: str, fw: str, rnd: int, steady: float) -> dict[str, object]:
    """One worker's result as ``compare.summarize`` reads it: every time ``steady``."""
    return {"workload": workload, "framework": fw, "round": rnd, "steady_s": steady, "epoch_ms": steady,
            "epoch_p10_ms": steady, "step_us": 1.0, "total_s": steady + 1.0, "setup_s": 0.0, "import_s": 0.0,
            "rss_mb": 300.0, "torch_import_s": 1.0, "sha256": "same"}


def test_the_summary_shows_each_ratio_beside_the_spread_of_its_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three rounds whose paired ratios are 1.00, 1.10 and 1.30: the cell reads their median and its range, so
    a report says how far one median can be trusted; one round has no range to show."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import compare

    work = compare.WORKLOADS["epochs"]

    results = [r for i, ratio in enumerate((1.00, 1.30, 1.10))
               for r in (_run(work.name, "raw", i, 10.0), _run(work.name, "fsm", i, 10.0 * ratio))]
    entry = compare.summarize(results, ["raw", "fsm"], [work])[work.name]["frameworks"]["fsm"]
    assert compare._fmt_ratio(entry) == "1.10 [1.00-1.30] (+1.00 ms/epoch)"
    assert compare._fmt_ratio(entry, "p10_ratio", "p10_delta_ms") == "1.10 [1.00-1.30] (+1.00 ms/epoch)"
    assert compare._fmt_ratio(entry, "total_ratio", "total_delta_ms").startswith("1.09 [1.00-1.27] (")
    one = compare.summarize(results[:2], ["raw", "fsm"], [work])[work.name]["frameworks"]["fsm"]
    assert compare._fmt_ratio(one) == "1.00 (+0.00 ms/epoch)"


def test_the_nine_with_one_setting_changed_are_paired_with_the_nine_and_named_by_the_setting(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each round's ``fsm_all_foreground`` (``checkpoint.background: false``) against the same round's
    ``fsm_all``: the median of the paired ratios, under the setting's name, and the loop sets that setting."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import compare
    import compare_loops

    work = compare.WORKLOADS["epochs"]

    results = [r for i, ratio in enumerate((1.05, 1.20, 1.10))
               for r in (_run(work.name, "fsm_all", i, 10.0), _run(work.name, "fsm_all_foreground", i, 10.0 * ratio))]
    summary = compare.summarize(results, ["fsm_all"], [work])
    variant = summary[work.name]["variants"]["fsm_all_foreground"]
    assert variant["ratio"] == pytest.approx(1.10) and variant["runs"] == 3
    assert "| checkpoint.background: false | 1.100 | +1.00 | 3 |" in compare._stall_lines(work, summary[work.name])
    import torch

    model = torch.nn.Linear(1, 1)
    job = compare_loops.Job(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            [(torch.zeros(4, 1), torch.zeros(4, 1))], [], 1, tmp_path)
    for background in (False, True):
        built = {type(c).__name__: c for c in compare_loops.nine_builtins(job, tmp_path / "run", background=background)}
        assert built["CheckpointCallback"].manager.background is background


def test_parts_are_differences_paired_within_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variant's epoch is the parts it has; every round adds its own load to all its runs. The parts come
    back exactly: a round's load cancels in its pairs, where medians of unpaired runs would mix the rounds."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import compare_loops
    import parts

    assert set(parts.VARIANTS) <= set(compare_loops.LOOPS)
    cost = {"raw": 10.0, "fsm": 10.5, "fsm_all_hollow": 10.6, "raw_all_unsaved": 11.4, "fsm_all_no_checkpoint": 12.0,
            "raw_all": 12.5, "raw_all_durable": 13.3, "fsm_all_unwritten": 13.4, "fsm_all": 14.8}
    runs = [{**_run("epochs", fw, n, ms + load), "round": n}
            for n, load in enumerate((0.0, 3.0, 0.5)) for fw, ms in cost.items()]
    assert parts.paired(runs, "fsm_all", "fsm_all_unwritten", "epoch_ms", "-") == pytest.approx(1.4)
    assert parts.paired(runs, "fsm", "raw", "epoch_ms", "/") == pytest.approx(statistics.median(
        [10.5 / 10.0, 13.5 / 13.0, 11.0 / 10.5]))
    report = parts.render([*runs, {"framework": "fsm", "round": 3, "error": "exit 1: boom"}], "--rounds 3", 200, 1.0)
    assert "| the writer thread's commit, as the training thread feels it | +1.40 / +1.40 | - |" in report
    assert "| the work of the eight that do not checkpoint | +1.40 / +1.40 | +1.40 / +1.40 |" in report
    assert "| `fsm_all_unwritten` / `raw_all_durable` | 1.007 | 1.007 |" in report
    assert "Failed runs, left out: fsm (round 4): exit 1: boom" in report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_hollow_and_unwritten_nine_dispatch_every_hook_and_write_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``fsm_all_hollow`` dispatches each of the nine's hooks (the log times all nine) while none does its
    work (no checkpoint file); ``fsm_all_unwritten`` hands every state over (the nine as usual) and writes
    none, and leaves the real commit in place after it."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import compare_loops
    import torch

    from fsmtrain.core.events import read_events
    from fsmtrain.training.checkpoint import CheckpointManager

    commit = CheckpointManager._commit
    for name in ("fsm_all_hollow", "fsm_all_unwritten"):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        scratch = tmp_path / name
        scratch.mkdir()
        job = compare_loops.Job(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                [(torch.randn(4, 2), torch.randn(4, 1))] * 3, [(torch.randn(4, 2), torch.randn(4, 1))],
                                3, scratch)
        compare_loops.LOOPS[name][0](job)
        assert len(job.marks) == 3
        epochs = [e for e in read_events(scratch / "run" / "events.jsonl") if e["event"] == "epoch"]
        assert len(epochs) == 3 and all(len(e["payload"]["callback_seconds"]) == 10 for e in epochs)  # nine + Mark
        assert not list((scratch / "run").rglob("*.pt"))
    assert CheckpointManager._commit is commit
