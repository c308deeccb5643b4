"""Suite-wide settings: W&B never reaches the network, and tests train on one thread."""

from __future__ import annotations

import compileall
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Where ``PYTHONDONTWRITEBYTECODE`` is set, no process caches bytecode, and each of the hundreds
    of ``fsmtrain`` processes the suite starts would compile the same sources again (about a second of
    CPU). So the controller compiles them once, where they are imported from (the editable install's
    link tree), before the workers start."""
    if sys.dont_write_bytecode and not hasattr(config, "workerinput"):
        import fsmtrain

        for folder in (Path(fsmtrain.__file__).parent, REPO / "benchmarks"):
            compileall.compile_dir(folder, quiet=1)
    if hasattr(config.option, "loadscopereorder"):
        # xdist would hand out the files with the most tests first, which leaves the few long ones
        # (kill harnesses, torchrun) to the end on one worker; the order below goes to the workers as is.
        config.option.loadscopereorder = False


def _close_zygotes() -> None:
    """The forked children's zygotes and output folders go with the process that made them (see
    ``forked_cli.close_all``); a process that never forked one has not imported the module."""
    forked_cli = sys.modules.get("forked_cli")
    if forked_cli is not None:
        forked_cli.close_all()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """As the tests end, before an xdist worker says it has finished: from then on the worker has 5 s to end
    before execnet SIGINTs it, and what it frees on its way out (torch's caches, with weakref callbacks) takes
    some of them."""
    _close_zygotes()


def pytest_unconfigure(config: pytest.Config) -> None:
    _close_zygotes()  # a session cut short may not finish


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files whose tests declare the longest time limits (their ``timeout`` marks, summed) first,
    each file's tests kept together and in order: the longest work starts while the short files can
    still fill the other workers' time."""
    limits: Counter[Path] = Counter()
    for item in items:
        mark = item.get_closest_marker("timeout")
        limits[item.path] += int(mark.args[0]) if mark is not None and mark.args else 0
    items.sort(key=lambda item: -limits[item.path])  # stable: a file's tests stay in their order


# --- real runs for the audit and diagram tests (built once per session; see tests/audit_runs.py) ---

@pytest.fixture(scope="session")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> object:
    """Completed, early-stopped, NaN, pruned, errored and interrupted runs of the real Trainer."""
    from audit_runs import make_real_runs

    return make_real_runs(tmp_path_factory.mktemp("real_runs"))


@pytest.fixture(scope="session")
def quickstart_runs(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The quickstart (shortened, early-stopped), once without and once with a log key."""
    from audit_runs import make_quickstart_runs

    return make_quickstart_runs(tmp_path_factory.mktemp("quickstart_runs"))


@pytest.fixture(scope="session")
def keyed_run(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A small keyed run of two segments (interrupted, then resumed and stopped early): its run dir."""
    from audit_runs import make_keyed_run

    return make_keyed_run(tmp_path_factory.mktemp("keyed_run"))


@pytest.fixture(autouse=True)
def _no_inherited_wandb_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process W&B run leaves ``WANDB_SERVICE`` in ``os.environ``; a training subprocess that
    inherited it would attach to this test process's W&B service instead of its own, and its offline
    files would depend on that service's life. Each test starts without it."""
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
