"""The tools start at once: ``fsmtrain --help``, ``audit`` and ``diagram`` import no torch, W&B, Optuna or
structlog (a run's console: 0.1 s), and ``validate`` (which builds the model, so it needs torch) none of the
others. Checked on
``sys.modules`` after the real command ran in a fresh interpreter, never by timing; a command that
does train (``preflight``, ``train``) is the control that the probe sees torch and structlog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "wandb", "optuna", "structlog")

# Runs the real CLI entry point in this interpreter, then reports what the command imported.
_PROBE = """
import json, sys
from fsmtrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # argparse's --help and usage errors
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
print("PROBE " + json.dumps({"code": code, "heavy": heavy}))
""".replace("HEAVY", repr(HEAVY))


def probe(*args: str | Path, cwd: Path) -> dict[str, Any]:
    path = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"the probe printed nothing; stderr:\n{proc.stderr}"
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("PROBE "))
    result["stdout"], result["stderr"] = proc.stdout, proc.stderr
    return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [
    ("--help",), ("audit", "--help"), ("diagram", "--help"), ("replay", "--help"), ("train", "--help"),
])
def test_help_imports_nothing_heavy(args: tuple[str, ...], tmp_path: Path) -> None:
    out = probe(*args, cwd=tmp_path)
    assert out["code"] == 0, out["stderr"]
    assert out["heavy"] == [], f"fsmtrain {' '.join(args)} imported {out['heavy']}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["mermaid", "dot"])
def test_diagram_imports_nothing_heavy(fmt: str, tmp_path: Path) -> None:
    out = probe("diagram", "--format", fmt, cwd=tmp_path)
    assert out["code"] == 0, out["stderr"]
    assert "train_end" in out["stdout"]  # it drew the lifecycle
    assert out["heavy"] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_audit_and_run_diagram_of_a_real_run_import_nothing_heavy(real_runs: Any, tmp_path: Path) -> None:
    events = real_runs.events("completed")
    audit = probe("audit", events, cwd=tmp_path)
    assert audit["code"] == 0, audit["stdout"] + audit["stderr"]
    assert "OK" in audit["stdout"]
    assert audit["heavy"] == []
    drawn = probe("diagram", "--run", events, cwd=tmp_path)
    assert drawn["code"] == 0, drawn["stderr"]
    assert drawn["heavy"] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", ["quickstart.yaml", "digits.yaml"])
def test_validate_of_the_shipped_configs_imports_no_wandb_or_optuna(config: str, tmp_path: Path) -> None:
    # validate builds the model, the loss and the optimizer on a dummy parameter (so it rejects what
    # train would): that takes torch. W&B and Optuna stay out.
    out = probe("validate", REPO / "configs" / config, cwd=tmp_path)
    assert out["code"] == 0, out["stderr"]
    assert "valid" in out["stdout"]
    assert out["heavy"] == ["torch"]


@pytest.mark.timeout(120)
def test_validate_still_checks_arguments_read_from_source(tmp_path: Path) -> None:
    # optimizer_config.lrr is wrong: the source says so, the real import words it (and may load torch)
    out = probe("validate", REPO / "configs" / "quickstart.yaml", "--set", "optimizer_config.lrr=0.1", cwd=tmp_path)
    assert out["code"] == 2
    assert "optimizer_config.lrr" in out["stderr"] and "did you mean lr?" in out["stderr"]


@pytest.mark.timeout(120)
def test_validate_imports_a_users_own_module(tmp_path: Path) -> None:
    # A user's module is imported for real: that it imports is part of what validate checks.
    (tmp_path / "mynet.py").write_text("import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n"
                                       "        super().__init__()\n")
    config = tmp_path / "c.yaml"
    config.write_text((REPO / "configs" / "quickstart.yaml").read_text()
                      .replace("net: fsmtrain.training.models.MLP", "net: mynet.Net")
                      .replace("net_config:\n  in_features: 8\n  out_features: 1\n  hidden: [64, 64]\n", ""))
    out = probe("validate", config, cwd=tmp_path)
    assert out["code"] == 0, out["stderr"]
    assert "torch" in out["heavy"]
    (tmp_path / "mynet.py").write_text("import torch\nraise RuntimeError('broken on purpose')\n")
    broken = probe("validate", config, cwd=tmp_path)
    assert broken["code"] == 2 and "broken on purpose" in broken["stderr"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_control_a_command_that_trains_does_import_torch(tmp_path: Path) -> None:
    out = probe("preflight", REPO / "configs" / "quickstart.yaml", cwd=tmp_path)
    assert out["code"] == 0, out["stderr"]
    assert "torch" in out["heavy"]
    trained = probe("train", REPO / "configs" / "quickstart.yaml", "--set", "epochs=1", cwd=tmp_path)
    assert trained["code"] == 0, trained["stderr"]
    assert "structlog" in trained["heavy"]  # a run prints its console through it
