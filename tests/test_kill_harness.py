"""Real processes killed at 30 random moments between start-up and exit
(teardown included), each run continued with ``fsmtrain resume`` until it completes, ends with the
weights of an uninterrupted run to the bit, an audit that passes and no ``.lock`` left behind.

Three seeds of ten moments each (``FSMTRAIN_KILL_SEED`` shifts them, for a stress run). Tiny: eight
short epochs (seven batches each) of the quickstart without W&B, so a process lives a few seconds,
mostly its start-up (importing torch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kill_harness import kill_until_done
from resume_harness import REPO, fsmtrain, same_weights

from fsmtrain.tools.audit import audit_file

QUICK = REPO / "configs" / "quickstart.yaml"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"
EPOCHS = 8
TINY = (f"epochs={EPOCHS}", "wandb.enabled=false", "data_config.n_samples=512", "checkpoint.keep_last_k=1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("reference")
    proc = fsmtrain("train", str(QUICK), *[a for o in TINY for a in ("--set", o)], cwd=work)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    return work / RUN / "model.pt"


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ten_kills_at_random_moments_then_resume_ends_bit_identical(reference: Path, tmp_path: Path,
                                                                    seed: int) -> None:
    seed += 1000 * int(os.environ.get("FSMTRAIN_KILL_SEED", "0"))
    run = tmp_path / RUN
    log = kill_until_done(QUICK, tmp_path, run, 10, seed, EPOCHS, *TINY)
    what = "\n".join(log.kills)
    print(f"seed {seed}: {len(log.processes)} processes ({', '.join(log.processes)}); kills:\n{what}")
    assert len(log.kills) == 10, what
    assert same_weights(run / "model.pt", reference), what
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render(False) + "\n" + what
    assert not (run / ".lock").exists(), what
    assert sorted(run.parent.iterdir()) == sorted([run, *log.moved_aside]), what  # never a -seed0-2
