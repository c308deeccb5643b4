"""Beyond one agent on one machine, and what ranks change.

- **Multi-node.** Two torchrun agents on this machine, as node 0 and node 1 (``--nnodes 2``, c10d
  rendezvous on localhost), one rank each:
  - in one working folder (a shared filesystem): one run directory; the audit checks it as one run,
    and the weights equal those of ``--nproc 2`` on one node, bitwise;
  - in two working folders (node-local disks; here through the short form ``fsmtrain train --nnodes 2
    --node-rank R --rdzv HOST:PORT``): each node's rank writes under the same run dir path on its own
    disk, says so in its log, and ``fsmtrain audit DIR0 DIR1`` passes; without node 1's log it names it.
- **Elastic restarts.** Under ``torchrun --max-restarts 2``, a callback that kills its own rank once
  (``os._exit(1)`` at epoch 3) gives a run that completes, with the weights of an uninterrupted run,
  bitwise, and one ``resume`` with restart count 1 in its log. Killed before the first checkpoint,
  the run starts from the beginning, and says so. The console has one exit line, the last attempt's.
- **Ranks say what they change.** ``--nproc 2`` prints the global batch (per rank x ranks x
  accumulation), records it in ``run_start`` and the report shows it; a user callback's ``print``
  comes once per rank, the other ranks' tagged ``[rank r]``, never two on one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_runs import clean, config, env, events, finish, free_port, fsmtrain, log, run_dir, same_weights, torchrun

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

EPOCHS = 5
_PRINT = {"target": "tests.dist_support.PrintEachEpoch"}


def _config(folder: Path, *extra: dict[str, Any]) -> Path:
    return config(folder, extra=[_PRINT, *extra], epochs=EPOCHS, early_stopping={"enabled": False})


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 400) -> list[str]:
    outs = []
    try:
        for p in procs:
            out, _ = finish(p, timeout)
            assert p.returncode == 0, out[-4000:]
            outs.append(out)
    finally:
        for p in procs:  # a node left waiting for one that failed: stopped, with its workers
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=60)
    return outs


class _Runs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Any] = {}

    def once(self, key: str, make: Any) -> Any:
        if key not in self.made:
            self.made[key] = make(self.root / key)
        return self.made[key]

    def one_node(self) -> tuple[Path, subprocess.CompletedProcess[str]]:
        def make(folder: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
            done = fsmtrain("train", str(_config(folder)), "--nproc", "2", cwd=folder, timeout=300)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            return run_dir(folder), done
        made: tuple[Path, subprocess.CompletedProcess[str]] = self.once("one_node", make)
        return made

    def two_nodes_shared(self) -> tuple[Path, list[str]]:
        def make(folder: Path) -> tuple[Path, list[str]]:
            cfg, port = _config(folder), free_port()
            args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"localhost:{port}", "--rdzv-id", "shared", "-m", "fsmtrain", "train", str(cfg)]
            outs = _finish([torchrun(*args, cwd=folder), torchrun(*args, cwd=folder)])
            return run_dir(folder), outs
        made: tuple[Path, list[str]] = self.once("two_nodes_shared", make)
        return made

    def two_nodes_local(self) -> list[Path]:
        def make(root: Path) -> list[Path]:
            port = free_port()
            folders = [root / "node0", root / "node1"]
            procs = [subprocess.Popen(
                [sys.executable, "-m", "fsmtrain", "train", str(_config(folder)), "--nnodes", "2", "--node-rank",
                 str(node), "--rdzv", f"localhost:{port}", "--rdzv-id", "local"], cwd=folder, env=env(),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node, folder in enumerate(folders)]
            _finish(procs)
            return [run_dir(f) for f in folders]
        made: list[Path] = self.once("two_nodes_local", make)
        return made

    def elastic(self, epoch: int) -> tuple[Path, str]:
        def make(folder: Path) -> tuple[Path, str]:
            kill = {"target": "tests.dist_support.ExitOnceOnRank",
                    "kwargs": {"rank": 1, "epoch": epoch, "marker": str(folder / "exited")}}
            cfg = _config(folder, kill)
            (out,) = _finish([torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "-m",
                                       "fsmtrain", "train", str(cfg), cwd=folder)])
            assert (folder / "exited").is_file()  # the rank did die once
            found = sorted(p.parent for p in (folder / "runs").rglob("events.jsonl"))
            return found[-1], out
        made: tuple[Path, str] = self.once(f"elastic{epoch}", make)
        return made


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("scale"))


def _run_start(path: Path) -> dict[str, Any]:
    payload: dict[str, Any] = events(path, "run_start")[0]["payload"]
    return payload


# --- multi-node ---------------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_two_nodes_on_a_shared_filesystem_are_one_run_with_one_node_s_weights(runs: _Runs) -> None:
    run, outs = runs.two_nodes_shared()
    for out in outs:
        clean(out)
    starts = {name: _run_start(run / name) for name in ("events.jsonl", "events-rank1.jsonl")}
    assert {(s["rank"], s["world_size"], s["local_rank"], s["layout"]) for s in starts.values()} == {
        (0, 2, 0, "shared"), (1, 2, 0, "shared")}
    assert {s["node"] for s in starts.values()} == {0, 1}  # one rank on each node
    audit = fsmtrain("audit", str(run), cwd=run, timeout=120)
    assert audit.returncode == 0, audit.stdout[-4000:]
    assert "2 ranks agree" in audit.stdout
    one_node, _ = runs.one_node()
    same_weights(one_node / "model.pt", run / "model.pt")


@pytest.mark.timeout(900)
def test_two_nodes_on_local_disks_audit_as_one_run(runs: _Runs, tmp_path: Path) -> None:
    dirs = runs.two_nodes_local()
    holds = {name: [d for d in dirs if (d / name).is_file()] for name in ("events.jsonl", "events-rank1.jsonl")}
    assert [len(v) for v in holds.values()] == [1, 1] and holds["events.jsonl"] != holds["events-rank1.jsonl"]
    rank1 = holds["events-rank1.jsonl"][0]
    start = _run_start(rank1 / "events-rank1.jsonl")
    assert start["layout"] == "node-local"  # rank 1 found no claim by rank 0, and says so
    assert not (rank1 / "checkpoints").exists()  # only rank 0's node holds the checkpoints
    assert _run_start(holds["events.jsonl"][0] / "events.jsonl")["layout"] == "node-local"
    audit = fsmtrain("audit", *map(str, dirs), cwd=tmp_path, timeout=120)
    assert audit.returncode == 0, audit.stdout[-4000:]
    assert "2 ranks agree" in audit.stdout
    (rank1 / "events-rank1.jsonl").rename(tmp_path / "aside.jsonl")  # node 1's log deleted
    try:
        audit = fsmtrain("audit", *map(str, dirs), cwd=tmp_path, timeout=120)
    finally:
        (tmp_path / "aside.jsonl").rename(rank1 / "events-rank1.jsonl")
    assert audit.returncode == 1, audit.stdout[-4000:]
    assert "run_start says world_size 2; events-rank1.jsonl is missing" in audit.stdout


# --- elastic restarts ---------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_a_rank_that_dies_is_restarted_and_the_run_resumes_by_itself(runs: _Runs) -> None:
    run, out = runs.elastic(epoch=2)  # os._exit(1) at the start of epoch 3
    assert "elastic restart 1 of 2: continuing" in out
    # The console says what happened: the attempt that lost a rank is restarted by the agent, then
    # the run completes; the one exit line is the completed run's.
    assert "the elastic agent restarts every rank (restart 1 of 2)" in out, out[-4000:]
    assert [line for line in out.splitlines() if "exit code" in line] == ["exit code 0 (OK)"], out[-4000:]
    resumes = [e["payload"] for e in events(run / "events.jsonl", "resume")]
    assert [r["restart"] for r in resumes] == [1]
    last = log(run / "events.jsonl")[-1]
    assert (last["event"], last["payload"]["stop_reason"], last["payload"]["epochs_completed"]) == (
        "result", "completed", EPOCHS)
    one_node, _ = runs.one_node()
    same_weights(one_node / "model.pt", run / "model.pt")
    audit = fsmtrain("audit", str(run), cwd=run, timeout=120)
    assert audit.returncode == 0, audit.stdout[-4000:]


@pytest.mark.timeout(900)
def test_a_rank_that_dies_before_the_first_checkpoint_restarts_from_the_beginning(runs: _Runs) -> None:
    run, out = runs.elastic(epoch=0)
    assert "committed no checkpoint" in out and "starts from the beginning" in out
    elastic = _run_start(run / "events.jsonl")["elastic"]
    assert elastic["restart"] == 1 and "starts from the beginning" in elastic["note"]
    assert events(run / "events.jsonl", "resume") == []
    assert log(run / "events.jsonl")[-1]["payload"]["stop_reason"] == "completed"


@pytest.mark.timeout(300)
def test_a_rank_that_fails_in_every_attempt_ends_the_run_with_one_exit_line(tmp_path: Path) -> None:
    raise_ = {"target": "tests.dist_support.RaiseOnRank", "kwargs": {"rank": 1, "epoch": 1}}
    cfg = _config(tmp_path, raise_)
    proc = torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "fsmtrain", "train", str(cfg),
                    cwd=tmp_path)
    out, _ = finish(proc, 250)
    assert proc.returncode == 1, out[-4000:]
    # The first attempt is restarted, the second ends the run: rank 0 names the agent's SIGTERM
    # that ends each attempt, and says one exit status, the last attempt's.
    assert "the elastic agent restarts every rank (restart 1 of 1)" in out, out[-4000:]
    assert [line for line in out.splitlines() if "exit code" in line] == ["exit code 1 (ERROR)"], out[-4000:]
    # The agent's SIGTERM: named as the agent's (stopping the attempt for its restart, or ending the
    # last one) when it comes before rank 0's status is decided, else the default action ends the
    # process (no line at all); never a second exit status.
    said = [line for line in out.splitlines() if "SIGTERM received" in line]
    agent = ("the elastic agent stopping this attempt's ranks for its restart 1 of 1",
             "the agent ending every rank of the failed attempt")
    assert all(any(f"SIGTERM received: {why}" in line for why in agent) for line in said), out[-4000:]


# --- what ranks change --------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_the_global_batch_is_said_and_a_callback_s_print_is_whole_and_tagged(runs: _Runs) -> None:
    run, done = runs.one_node()
    clean(done)
    assert "global batch 128 (64 per rank x 2 rank(s) x 1 accumulation step); batch_size is per rank" in done.stdout
    assert _run_start(run / "events.jsonl")["global_batch"] == {"per_rank": 64, "ranks": 2, "accumulation": 1,
                                                                "global": 128}
    said = [line for line in done.stdout.splitlines() if "said a callback" in line]
    for epoch in range(EPOCHS):
        text = f"epoch {epoch} ended, said a callback"
        assert said.count(text) == 1 and said.count(f"[rank 1] {text}") == 1, said
    assert all(line.count("said a callback") == 1 for line in said), said
    report = fsmtrain("report", str(run), "--output", str(run / "report.html"), cwd=run, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    assert "64 per rank x 2 rank(s) x 1 accumulation step" in (run / "report.html").read_text()
    assert json.loads(json.dumps(_run_start(run / "events-rank1.jsonl")["global_batch"]))["global"] == 128
