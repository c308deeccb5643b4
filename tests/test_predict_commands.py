"""``fsmtrain predict`` and ``evaluate`` (real subprocesses, a user's modules in another folder, real
torchrun), ``Trainer.predict``, and the batch contract of ``validate --data`` and ``preflight``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain import Trainer
from fsmtrain.training.models import MLP

REPO = Path(__file__).resolve().parents[1]

# The val set (37 rows, batches of 8) divides neither by the batch size nor by 2 ranks x 8; its loader
# shuffles, and predictions still come in dataset order.
DATA = '''
import torch
from torch.utils.data import DataLoader, TensorDataset


def rows(n, seed):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return x, torch.cat([x.sum(1, keepdim=True), x[:, :1] * 2.0], 1)


def build(*, batch_size, seed):
    train, val = TensorDataset(*rows(120, 0)), TensorDataset(*rows(37, 1))
    return (DataLoader(train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)),
            DataLoader(val, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(5)))


def other(*, batch_size, seed, n=23):
    data = TensorDataset(*rows(n, 2))
    return DataLoader(data, batch_size=batch_size), DataLoader(data, batch_size=batch_size)


def keyed(*, batch_size, seed):
    x, y = rows(16, 0)
    data = [{"x": x[i], "y": y[i]} for i in range(16)]
    return DataLoader(data, batch_size=batch_size), DataLoader(data, batch_size=batch_size)


def no_val(*, batch_size, seed):
    return DataLoader(TensorDataset(*rows(16, 0)), batch_size=batch_size), None


def mae(output, target):
    return (output - target).abs().mean()
'''

CONFIG = {"project": "p", "name": "reg", "num_threads": 1, "data": "mydata.build", "epochs": 2, "batch_size": 8,
          "net": "fsmtrain.training.models.MLP", "net_config": {"in_features": 4, "out_features": 2, "hidden": [8]},
          "criterion": "torch.nn.MSELoss", "metrics": {"val_mae": "mydata.mae"}, "wandb": {"enabled": False}}


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_SERVICE", None)
    return env


def _fsmtrain(*args: str | Path, cwd: Path, code: int = 0, ranks: int = 1) -> str:
    """The console script (or torchrun's workers) from ``cwd``: the user's folder is on no path."""
    exe = shutil.which("fsmtrain")
    assert exe is not None
    head = [exe] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc-per-node", str(ranks), "-m", "fsmtrain"]
    done = subprocess.run([*head, *map(str, args)], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == code, out[-3000:]
    assert "Traceback" not in out, out
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A trained run of a config whose data builder and metric live in the user's own folder."""
    root = tmp_path_factory.mktemp("predict")
    project, elsewhere = root / "project", root / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "mydata.py").write_text(DATA, encoding="utf-8")
    (project / "reg.yaml").write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    _fsmtrain("train", project / "reg.yaml", "--run-dir", root / "runs", cwd=elsewhere)
    return {"project": project, "elsewhere": elsewhere, "run": root / "runs" / "reg-seed0"}


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``mydata.rows`` makes, written again here (the hand computation)."""
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return x, torch.cat([x.sum(1, keepdim=True), x[:, :1] * 2.0], 1)


def _model(weights: dict[str, torch.Tensor]) -> MLP:
    model = MLP(in_features=4, out_features=2, hidden=[8])
    model.load_state_dict(weights)
    return model.eval()


def _predictions(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    return loaded


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [1, 2])
def test_predict_gives_one_row_per_val_example_in_dataset_order(world: dict[str, Path], ranks: int) -> None:
    out = world["elsewhere"] / f"preds-{ranks}.pt"
    said = _fsmtrain("predict", world["run"], "--out", out, cwd=world["elsewhere"], ranks=ranks)
    assert f"wrote 37 predictions of {world['run']} (checkpoint checkpoints/best.pt)" in said
    got = _predictions(out)
    best = torch.load(world["run"] / "checkpoints" / "best.pt", weights_only=True)
    with torch.no_grad():
        want = _model(best["model"])(_rows(37, 1)[0])
    assert got["predictions"].shape == (37, 2)
    torch.testing.assert_close(got["predictions"], want, rtol=0, atol=1e-6)
    assert got["checkpoint"] == "checkpoints/best.pt" and got["data"] == "mydata.build"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluate_equals_a_hand_computation_with_the_final_model(world: dict[str, Path]) -> None:
    final = _model(torch.load(world["run"] / "model.pt", weights_only=True))
    for data, (x, y) in ((None, _rows(37, 1)), ("mydata.other", _rows(23, 2))):
        json_file = world["elsewhere"] / f"eval-{data}.json"
        extra = ("--data", data) if data else ()
        said = _fsmtrain("evaluate", world["run"], "--checkpoint", "latest", *extra, "--json", json_file,
                         cwd=world["elsewhere"])
        with torch.no_grad():
            out = final(x)
        record = json.loads(json_file.read_text())
        assert record["examples"] == len(x) and record["checkpoint"] == "checkpoints/latest.pt"
        assert record["data"] == (data or "mydata.build")
        assert record["metrics"]["val_loss"] == pytest.approx(float(nn.functional.mse_loss(out, y)), abs=1e-6)
        assert record["metrics"]["val_mae"] == pytest.approx(float((out - y).abs().mean()), abs=1e-6)
        assert f"  val_mae {record['metrics']['val_mae']:.6g}" in said.splitlines()


def _one_line(out: str, line: str) -> None:
    assert line in out.splitlines(), out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_predict_and_evaluate_refuse_user_mistakes_in_one_line(world: dict[str, Path], tmp_path: Path) -> None:
    here, run = world["elsewhere"], world["run"]
    out = _fsmtrain("predict", tmp_path / "nope", "--out", "p.pt", cwd=here, code=2)
    _one_line(out, f"fsmtrain predict: {tmp_path / 'nope'} does not exist: expected the run directory of an "
                   "fsmtrain run (runs/<project>/<name>-seed<s>)")
    out = _fsmtrain("evaluate", run, "--checkpoint", "epoch_9.pt", cwd=here, code=2)
    _one_line(out, f"fsmtrain evaluate: --checkpoint epoch_9.pt: expected best, latest or a checkpoint file the log "
                   f"of {run} committed; it committed: checkpoints/best.pt, checkpoints/epoch_1.pt, "
                   "checkpoints/epoch_2.pt, checkpoints/latest.pt")
    out = _fsmtrain("evaluate", run, "--set", "net_config.hidden=[3]", cwd=here, code=2)
    _one_line(out, "fsmtrain evaluate: --set net_config.hidden=[3]: evaluate may change only data, data_config, "
                   "batch_size, device, num_threads; the model and its training are the run's")
    out = _fsmtrain("predict", run, "--out", tmp_path / "no" / "p.pt", cwd=here, code=2)
    _one_line(out, f"fsmtrain predict: --out {tmp_path / 'no' / 'p.pt'}: the folder {tmp_path / 'no'} does not exist")
    out = _fsmtrain("evaluate", run, "--data", "mydata.no_val", cwd=here, code=2)
    _one_line(out, "fsmtrain evaluate: there is no data to run over: the data builder gave no val loader; name a "
                   "builder whose val loader has the examples")
    out = _fsmtrain("predict", run, "--data", "mydata.keyed", "--out", "p.pt", cwd=here, code=2)
    _one_line(out, "fsmtrain predict: val batch 0 of the data: a batch must be (inputs, targets) or a mapping with "
                   "'inputs' and 'targets'; got dict")
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    best = copy / "checkpoints" / "best.pt"
    damaged = bytearray((run / "checkpoints" / "best.pt").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    best.write_bytes(bytes(damaged))
    out = _fsmtrain("predict", copy, "--out", "p.pt", cwd=here, code=2)
    assert f"fsmtrain predict: --checkpoint best: checkpoint {best} does not match its committed sha256" in out, out
    assert not (here / "p.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_batch_that_breaks_the_contract_is_named_by_validate_data_and_preflight(world: dict[str, Path]) -> None:
    config = world["project"] / "reg.yaml"
    assert "ran its first training batch through the step on the CPU" in _fsmtrain(
        "validate", config, "--data", cwd=world["elsewhere"])
    for command, extra in (("validate", ("--data",)), ("preflight", ())):
        out = _fsmtrain(command, config, "--set", "data=mydata.keyed", *extra, cwd=world["elsewhere"], code=2)
        _one_line(out, f"fsmtrain {command}: --set data=mydata.keyed: data: expected batches that are (inputs, "
                       "targets) or a mapping with 'inputs' and 'targets' (a step: of your own takes any batch); "
                       "found mydata.keyed's first training batch "
                       "is dict {'x': (8, 4) float32, 'y': (8, 2) float32}")
    out = _fsmtrain("validate", config, "--set", "net_config.in_features=5", "--data", cwd=world["elsewhere"], code=2)
    assert "net: expected a net that takes the data's first training batch; found the step failed at the forward " \
           "of fsmtrain.training.models.MLP, in module net.0 " in out, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_without_a_best_checkpoint_predicts_with_its_latest_and_says_so(world: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    _fsmtrain("train", world["project"] / "reg.yaml", "--set", "checkpoint.save_best=false", "--set", "epochs=1",
              "--run-dir", tmp_path, cwd=world["elsewhere"])
    run = tmp_path / "reg-seed0"
    out = _fsmtrain("predict", run, "--out", tmp_path / "p.pt", cwd=world["elsewhere"])
    _one_line(out, f"note: {run} committed no best checkpoint (checkpoint.save_best off): using the latest")
    assert _predictions(tmp_path / "p.pt")["checkpoint"] == "checkpoints/latest.pt"


def test_trainer_predict_keeps_dataset_order_over_its_val_data_or_any(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = _rows(30, 1)
    model = MLP(in_features=4, out_features=2, hidden=[8])
    shuffled = DataLoader(TensorDataset(x, y), batch_size=7, shuffle=True)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), shuffled, shuffled,
                      max_epochs=1, default_callbacks=False, console_level="error")
    trainer.fit()
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(trainer.predict(), want, rtol=0, atol=1e-6)
    pairs = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4)]  # any iterable: in its own order
    torch.testing.assert_close(trainer.predict(pairs), want[:12], rtol=0, atol=1e-6)
