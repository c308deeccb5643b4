"""One set of checks of the user's callbacks and data: ``validate`` and ``preflight`` refuse what
``train`` refuses, in the same one line.

The cases: a callback with a wrong hook signature (a one-line problem, not a traceback); the
seed-style ``super().__init__(priority)`` (accepted; a constructor that fails is the class's fault,
not ``callbacks.extra.0.kwargs``'); a data builder pointing at a missing CSV (a config error before
any run, not exit 4, the code of a non-finite loss).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from fsmtrain.cli import main

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


def _config(folder: Path, **changes: object) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    cfg.update({"epochs": 2, "scheduler_config": {"T_max": 2}, "wandb": {"enabled": False},
                "data_config": {**cfg["data_config"], "n_samples": 128}}, **changes)
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _cli(*args: str, cwd: Path, capsys: pytest.CaptureFixture[str],
         monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess[str]:
    """The command through ``fsmtrain.cli.main`` in this process (what the console script calls).
    Each test names its modules uniquely: this process imports them once."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def _error_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out
    assert done.returncode == code, out
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("fsmtrain ")]
    return line.split(": ", 1)[1]


def test_a_wrong_hook_signature_is_refused_by_validate_preflight_and_train_alike(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cbs_signature.py").write_text(
        "from fsmtrain.callbacks import TrainingCallback\n\n"
        "class TwoArgs(TrainingCallback):\n"
        "    def on_val_end(self, epoch, extra):\n"
        "        pass\n", encoding="utf-8")
    config = _config(tmp_path, callbacks={"extra": [{"target": "cbs_signature.TwoArgs"}]})
    lines = {command: _error_line(_cli(command, str(config), *extra, cwd=tmp_path, capsys=capsys,
                                       monkeypatch=monkeypatch), 2)
             for command, extra in (("train", ("--run-dir", "runs")), ("validate", ()), ("preflight", ()))}
    assert len(set(lines.values())) == 1, lines
    assert ("callbacks: expected callbacks the runner accepts; found TwoArgs.on_val_end(self, epoch, extra) must "
            "take exactly one context argument: on_val_end(self, epoch: EpochContext)") in lines["preflight"]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("events.jsonl"))


def test_a_priority_per_instance_through_super_init(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cbs_priority.py").write_text(
        "from fsmtrain.callbacks import TrainingCallback\n\n"
        "class Keyword(TrainingCallback):\n"
        "    def __init__(self):\n"
        "        super().__init__(priority=61)\n\n"
        "class Positional(TrainingCallback):\n"      # the seed's own style
        "    def __init__(self, level=1):\n"
        "        super().__init__(62)\n"
        "        self.level = level\n\n"
        "class Broken(TrainingCallback):\n"
        "    def __init__(self):\n"
        "        raise RuntimeError('not built today')\n", encoding="utf-8")
    config = _config(tmp_path, callbacks={"extra": [{"target": "cbs_priority.Keyword"},
                                                    {"target": "cbs_priority.Positional"}]})
    done = _cli("preflight", str(config), cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert done.returncode == 0, done.stderr
    assert "Keyword(61), Positional(62)" in done.stdout
    assert _cli("validate", str(config), cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch).returncode == 0
    # A constructor that fails with no kwargs given is the class's fault, not the kwargs'.
    broken = _config(tmp_path, callbacks={"extra": [{"target": "cbs_priority.Broken"}]})
    line = _error_line(_cli("validate", str(broken), cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch), 2)
    assert line.startswith(f"config {broken}: callbacks.extra.0.target: expected cbs_priority.Broken to build with "
                           "no arguments"), line
    assert "RuntimeError: not built today" in line and "kwargs:" not in line
    assert "super().__init__(priority=" in (REPO / "README.md").read_text()  # the README says how


def test_a_missing_data_file_is_a_config_error_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data_csv.py").write_text(
        "import csv\n\n"
        "def load(*, batch_size, seed, path):\n"
        "    with open(path) as fh:\n"
        "        rows = list(csv.reader(fh))\n", encoding="utf-8")
    config = _config(tmp_path, data="data_csv.load", data_config={"path": "missing.csv"})
    expected = (f"config {config}: data_config.path: expected a data builder call that returns (train, val) "
                "(data_csv.load with batch_size, seed and data_config); found data_csv.load raised "
                "FileNotFoundError: [Errno 2] No such file or directory: 'missing.csv'")
    for args in (("validate", str(config), "--data"), ("preflight", str(config))):
        assert _error_line(_cli(*args, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch), 2) == expected
    plain = _cli("validate", str(config), cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert plain.returncode == 0 and "checked the data builder's arguments" in plain.stdout  # --data calls it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "data_csv.py"]
    # train builds the data before it claims a run folder: the same error, and nothing written
    done = _cli("train", str(config), "--run-dir", "runs", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert _error_line(done, 2) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "data_csv.py"]
