"""A ``Trainer`` in a process group of the user's own (no torchrun, no agent to end the others):
when one rank fails, or hangs, the others do not wait for ``distributed.timeout_s`` (1,800 s by
default) at the next agreement point.

Two plain Python processes join a gloo group with ``init_process_group`` and train with the public
``Trainer``; rank 1 fails (or hangs) in ``on_epoch_end`` of epoch index 1, while rank 0 waits at the
agreement before leaving ``epoch_end``. Rank 1's process then stays alive, holding the group, as a
user's script that catches the error would: nothing closes rank 0's connections for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from dist_runs import env, free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

_SCRIPT = """
import json, os, sys, time
import torch, torch.distributed as dist
from fsmtrain import Trainer
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.training.data import synthetic_regression
from fsmtrain.training.distributed import TorchCollective
from fsmtrain.training.models import MLP

mode, rank = sys.argv[1], int(os.environ["RANK"])
dist.init_process_group("gloo")

class Trouble(TrainingCallback):
    def on_epoch_end(self, epoch):
        if rank == 1 and epoch.index == 1:
            if mode == "hang":
                time.sleep(300)
            raise ValueError("rank 1 gave up")

torch.manual_seed(0)
loaders = synthetic_regression(batch_size=32, seed=0, n_samples=256)
model = MLP(in_features=8, out_features=1, hidden=[16])
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.MSELoss(), loaders.train,
                  loaders.val, max_epochs=4, callbacks=[Trouble()], default_callbacks=False,
                  collective=TorchCollective(torch.device("cpu"), agreement_timeout_s=4.0))
try:
    trainer.fit()
    outcome = {"error": None}
except BaseException as exc:
    outcome = {"error": type(exc).__name__, "said": str(exc), "at": time.time()}
result = trainer.engine.result
outcome.update(reason=result.stop_reason.value, source=result.stop.source, message=result.stop.message)
print(json.dumps(outcome), flush=True)
if rank == 1:
    time.sleep(300)  # alive, holding the group: the test ends it
os._exit(0)  # this script's choice: its group may still wait on the rank that went quiet
"""


def _run(mode: str) -> tuple[dict[str, Any], float]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, mode], env=env(
        RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=150)
        assert procs[0].returncode == 0, out + err
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return lines[-1], time.time()
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.timeout(200)
def test_a_failure_on_another_rank_ends_the_wait_at_once() -> None:
    outcome, _ = _run("fail")
    assert outcome["error"] == "RankFailed", outcome
    assert outcome["said"] == "rank 1 failed in Trouble.on_epoch_end: ValueError: rank 1 gave up"
    assert outcome["message"] == "ValueError: rank 1 gave up"
    assert (outcome["reason"], outcome["source"]) == ("interrupted", "Trouble.on_epoch_end on rank 1")


@pytest.mark.timeout(200)
def test_a_rank_that_hangs_ends_the_wait_after_the_bound_with_a_clear_error() -> None:
    start = time.time()
    outcome, _ = _run("hang")
    assert outcome["error"] == "AgreementTimeout", outcome
    assert "waited 4 s at an agreement point" in str(outcome["said"])
    assert "distributed.agreement_timeout_s" in str(outcome["said"])
    assert outcome["reason"] == "error"
    assert float(outcome["at"]) - start < 100  # the bound, not distributed.timeout_s (1,800 s)
