"""A rank ends its process group, and every thread of it, in teardown.

A gloo thread still running at the interpreter's own teardown can print ``terminate called without
an active exception`` and exit 134 after the console said ``exit code 0 (OK)``. DDP imports
``torch.distributed.nn.functional``, whose functions take ``group.WORLD`` as a default argument:
imported after the group exists, those defaults hold the group past ``destroy_process_group``.
The test runs one real gloo rank (world size 1, so it needs no second process) through what a
worker does, and reads the process's native threads from ``/proc``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_RANK = """
import json, os, torch
from fsmtrain.training.distributed import DistributedOptions, init_from_env, shutdown, wrap_model

def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

init_from_env(DistributedOptions(), torch.device("cpu"))
model = torch.nn.Linear(4, 1)
ddp = wrap_model(model, torch.device("cpu"))
ddp(torch.ones(2, 4)).sum().backward()
during = threads()
cycle = [ddp]
cycle.append(cycle)  # a run's objects hold each other, as the trainer's do
del ddp, cycle
shutdown()
print(json.dumps({"during": during, "after": threads()}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads native thread names from Linux's /proc")
def test_shutdown_ends_the_group_and_its_threads_before_the_interpreter_exits() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _RANK], env=env, capture_output=True, text=True, timeout=100,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # the threads the check looks for do exist while the group does (a thread takes its name once it runs)
    assert {"gloo_tcp_loop", "pt_gloo_runloop"} & set(seen["during"]), seen
    assert not {"gloo_tcp_loop", "pt_gloo_runloop"} & set(seen["after"]), seen
