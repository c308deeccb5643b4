"""What touches parameters works on FSDP2's sharded tensors, on real ``torchrun`` workers (gloo, 2 CPU ranks), in one
run: a user's own step, clipping by norm, bf16 mixed precision, an optimizer with train/eval modes, gradient
accumulation and the NaN check. The gradient monitor's norm is the whole gradients' (gathered apart), equal on both
ranks; clipping holds it under ``max_norm``; the forward runs in bf16; the losses stay finite until rank 1's step
makes its loss NaN in the last epoch, and both ranks stop with the NaN stop reason naming rank 1; ``model.pt`` loads
strictly. A step checkpoint inside an accumulation window is skipped and said (FSDP2 keeps a window's gradients
unsharded)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dist_runs import clean, config, events, fsmtrain, log, run_dir, weights

from fsmtrain.training.models import MLP

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

NET = {"in_features": 8, "out_features": 1, "hidden": [64, 64, 64]}
MAX_NORM = 0.05


@pytest.mark.timeout(300)
def test_clipping_precision_modes_own_step_and_nan_work_sharded(tmp_path: Path) -> None:
    probe = {"target": "tests.fsdp_support.ShardedProbe", "kwargs": {"rank": 1, "poison_epoch": 2}}
    cfg = config(tmp_path, epochs=3, net_config=NET, scheduler=None, scheduler_config={}, extra=(probe,),
                 step="tests.fsdp_support.probe_step", optimizer="tests.fsdp_support.ModesAdam",
                 grad_clip={"max_norm": MAX_NORM}, early_stopping={"enabled": False}, grad_accumulation=2,
                 checkpoint={"enabled": True, "every_n_steps": 1, "keep_last_k": 1},
                 distributed={"strategy": "fsdp", "agreement_timeout_s": 20.0,
                              "fsdp": {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}})
    done = fsmtrain("train", str(cfg), "--nproc", "2", cwd=tmp_path, timeout=200)
    out = clean(done)
    assert done.returncode == 3, out[-4000:]  # the NaN stop's status
    path = run_dir(tmp_path)
    got = [json.loads((path / f"probe-rank{r}.json").read_text()) for r in (0, 1)]
    assert got[0]["norms"] == got[1]["norms"]  # the whole gradients: the same on both ranks
    norms = [n for n in got[0]["norms"] if n[0] < 2]  # before the poison
    assert len(norms) == 4 and all(before > MAX_NORM and after <= MAX_NORM * 1.001 for _, before, after in norms)
    for r, name in enumerate(("events.jsonl", "events-rank1.jsonl")):
        assert got[r]["dtypes"] == ["torch.bfloat16"] and got[r]["kinds"] == ["DTensor"], got[r]
        assert got[r]["modes"] == ["train", "eval"] * 3, got[r]
        ends = events(path / name, "epoch")
        assert [math.isfinite(float(e["payload"]["metrics"]["train_loss"])) for e in ends] == [True, True, False]
        for e in ends[:2]:  # the monitor's norm (before clipping) is the whole gradients' too
            want = max(before for i, before, _ in norms if i == e["epoch"])
            assert e["payload"]["slots"]["max_grad_norm"] == pytest.approx(want, rel=1e-4), (e, want)
        result = log(path / name)[-1]["payload"]
        assert result["stop_reason"] == "nan" and "first on rank 1" in result["stop_message"], result
    skipped = [e["payload"] for e in events(path / "events.jsonl", "checkpoint_skipped")]
    assert [s["step"] for s in skipped] == [1, 3, 5, 7, 9, 11], skipped
    assert all("inside a gradient accumulation window" in s["reason"] for s in skipped), skipped
    commits = [e["payload"]["path"] for e in events(path / "events.jsonl", "checkpoint")]
    assert [c for c in commits if "step_" in c] == [f"checkpoints/step_{n}" for n in (2, 4, 6, 8, 10, 12)], commits
    MLP(**NET).load_state_dict(weights(path / "model.pt"), strict=True)  # type: ignore[arg-type]
    audit = fsmtrain("audit", str(path), cwd=path, timeout=120)
    assert audit.returncode == 0 and "ended: nan from rank 1" in audit.stdout, audit.stdout[-4000:]
