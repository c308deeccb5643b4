"""Bounded collectives on real ``torchrun`` workers (gloo, 2 CPU ranks): an exception that will not
pickle reaches the other rank as text; an object that will not pickle fails on every rank; a
collective that one rank never joins ends within ``agreement_timeout_s``, naming the collective and
the bound; a peer's failure is a ``RankFailed``, which ``except Exception`` catches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_runs import config, finish, free_port, fsmtrain, torchrun

from fsmtrain.core.consensus import Failure, RankFailed

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

_WORKER = '''
import json, os, sys, threading, time, torch
import torch.distributed as dist
from fsmtrain.training.distributed import DistributedOptions, init_from_env

class Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"needs {a} and {b}")
        self.lock = threading.Lock()

c = init_from_env(DistributedOptions(agreement_timeout_s=3.0), torch.device("cpu"))
c.bind("test")
out = {}
def fail():
    raise Unpicklable(1, 2)
try:
    c.share(fail)
except Exception as exc:
    out["share"] = f"{type(exc).__name__}: {exc}"
try:
    c.broadcast_object(threading.Lock() if c.rank == 0 else None, 0)
except TypeError as exc:
    out["object"] = str(exc)
out["value"] = c.broadcast_object({"x": [1, 2]}, 0)
t0 = time.monotonic()
if c.rank == 0:
    try:
        c.all_reduce_sum(torch.ones(1))
    except Exception as exc:
        out["hang"] = [type(exc).__name__, str(exc), time.monotonic() - t0]
else:
    time.sleep(5)  # never joins: rank 0's all-reduce waits for it
with open(sys.argv[1] + f"/rank{c.rank}.json", "w") as fh:
    json.dump(out, fh)
os._exit(0)  # a collective is left pending: no teardown
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_collectives_are_bounded_and_failures_reach_every_rank_as_data(tmp_path: Path) -> None:

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    proc = torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), str(script), str(tmp_path),
                    cwd=tmp_path)
    out, _ = finish(proc, 100)
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r in (0, 1):
        assert got[r]["share"] == "RuntimeError: Unpicklable: needs 1 and 2", (r, got[r], out[-2000:])
        assert "rank 0 could not send its object to the other ranks: lock will not pickle" in got[r]["object"], got[r]
        assert got[r]["value"] == {"x": [1, 2]}
    name, said, seconds = got[0]["hang"]
    assert name == "AgreementTimeout" and "(all_reduce_sum)" in said and "distributed.agreement_timeout_s" in said
    assert "waited 3 s" in said and 3.0 <= seconds < 10.0, got[0]["hang"]


_BOUNDARY_WORKER = '''
import json, os, random, sys, time, torch
import fsmtrain.training.distributed as fd
from fsmtrain.training.distributed import DistributedOptions, init_from_env

fd._SLICE_S = float(sys.argv[2])  # short slices: many slice ends a second, each a chance to meet the race
c = init_from_env(DistributedOptions(agreement_timeout_s=30.0), torch.device("cpu"))
c.bind("test")
rnd, done, error = random.Random(c.rank), 0, None
try:
    for i in range(int(sys.argv[3])):
        if c.rank == 0:  # send about when rank 1's wait for a slice runs out
            time.sleep(fd._SLICE_S * rnd.randint(1, 2) + rnd.uniform(-2e-4, 2e-4))
        assert c.broadcast_object(i, 0) == i
        done += 1
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
with open(sys.argv[1] + f"/rank{c.rank}.json", "w") as fh:
    json.dump({"done": done, "error": error}, fh)
os._exit(0)
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_collective_that_completes_as_a_wait_slice_runs_out_is_done_not_a_failure(tmp_path: Path) -> None:
    """A rank waits for a collective in slices (reading the failure board between them). When the
    collective completes just after a slice's wait ran out, gloo's wait has already raised "Operation
    timed out!": that is a finished collective, not a failed one. Found in the stress rounds: a 2-rank
    run exited 1 while claiming its run directory, its peer reporting "Connection closed by peer"."""

    script, rounds = tmp_path / "worker.py", 600
    script.write_text(_BOUNDARY_WORKER)
    proc = torchrun("--standalone", "--nproc-per-node", "2", str(script), str(tmp_path), "0.005", str(rounds),
                    cwd=tmp_path)
    out, _ = finish(proc, 100)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got == [{"done": rounds, "error": None}] * 2, (got, out[-2000:])

def test_a_peers_failure_is_an_exception_user_code_catches() -> None:
    try:
        raise RankFailed(Failure(1, "forward", "ValueError: boom"))
    except Exception as exc:  # the point: user code's own `except Exception` sees it
        assert isinstance(exc, RankFailed) and not isinstance(exc, KeyboardInterrupt)
        assert str(exc) == "rank 1 failed in forward: ValueError: boom"


@pytest.mark.timeout(120)
def test_a_callback_that_needs_whole_tensors_is_refused_by_name_when_the_run_is_built(tmp_path: Path) -> None:
    cfg = config(tmp_path, epochs=1, log_every_n_steps=2, distributed={"strategy": "fsdp"},
                 checkpoint={"enabled": True, "every_minutes": 3})
    done = fsmtrain("validate", str(cfg), cwd=tmp_path, timeout=100)
    assert done.returncode != 0
    assert ("distributed.strategy: expected callbacks that work on sharded parameters (fsdp); found StepLogCallback; "
            "CheckpointCallback's checkpoints by the clock (every_minutes: each rank's clock") in (
        done.stdout + done.stderr), done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
