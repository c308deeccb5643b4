"""The real ``fsmtrain`` CLI in subprocesses (``python -m fsmtrain``), W&B offline, CI mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fsmtrain.app.config import load_config
from fsmtrain.cli import ExitCode, main
from fsmtrain.core.events import read_events

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
FAST = ["--set", "epochs=3", "--set", "scheduler_config.T_max=3", "--set", "early_stopping.patience=2"]


def fsmtrain(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "CI": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "fsmtrain", *map(str, args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )


@pytest.mark.slow
def test_quickstart_trains_to_completed_with_a_full_run_dir(tmp_path: Path) -> None:
    proc = fsmtrain("train", QUICKSTART, *FAST, "--set", "optimizer_config.lr=0.01", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    run_dir = tmp_path / "runs" / "quickstart" / "mlp-regression-seed0"
    assert {"config.yaml", "events.jsonl", "checkpoints", "model.pt", "wandb"} <= {p.name for p in run_dir.iterdir()}
    assert list((run_dir / "checkpoints").glob("*.pt")) and list((run_dir / "wandb").glob("offline-run-*"))
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optimizer_config"]["lr"] == 0.01
    events = read_events(run_dir / "events.jsonl")
    transitions = [e for e in events if e["event"] == "transition"]
    assert transitions[-1]["to"] == "train_end" and events[-1]["event"] == "result"
    assert events[0]["payload"]["config"]["optimizer_config"]["lr"] == 0.01 and events[0]["payload"]["seed"] == 0
    val = [e["payload"]["metrics"]["val_loss"] for e in events if e["event"] == "epoch"]
    assert len(val) == 3 and val[-1] < val[0]
    assert "seed 0: COMPLETED after 3 epoch(s)" in proc.stdout
    assert f"run dir: {Path('runs/quickstart/mlp-regression-seed0')}" in proc.stdout
    assert "best val_loss" in proc.stdout
    rows = [line.split()[0] for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert rows == ["1/3", "2/3", "3/3"]  # one console table row per epoch
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values())


def test_three_mistakes_one_error_and_nothing_on_disk(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "net: fsmtrain.training.models.MLP\nnet_config: {in_features: 8, out_features: 1}\n"
        "data: fsmtrain.training.data.synthetic_regression\noptimizer: torch.optim.Adamm\n"
        "epochs: -1\nbatch_size: 32\nearly_stoping: {patience: 3}\n"
    )
    proc = fsmtrain("train", config, cwd=tmp_path)
    assert proc.returncode == ExitCode.CONFIG
    assert "has 3 problems" in proc.stderr and "Traceback" not in proc.stderr
    for needle in ("optimizer:", "did you mean torch.optim.Adam?", "epochs:", "found -1",
                   "early_stoping:", "did you mean early_stopping?"):
        assert needle in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["bad.yaml"]
    proc = fsmtrain("validate", config, cwd=tmp_path)
    assert proc.returncode == ExitCode.CONFIG and "has 3 problems" in proc.stderr


@pytest.mark.slow
def test_multi_seed_mean_and_same_seed_bit_identical(tmp_path: Path) -> None:
    common = [*FAST, "--set", "epochs=2", "--set", "scheduler_config.T_max=2", "--set", "wandb.enabled=false"]
    proc = fsmtrain("train", QUICKSTART, *common, "--set", "seeds=[1, 2, 3]", "--run-dir", "a", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [f"mlp-regression-seed{s}" for s in (1, 2, 3)]
    assert "mean objective (best val_loss) over 3 seeds:" in proc.stdout
    proc = fsmtrain("train", QUICKSTART, *common, "--set", "seeds=[1]", "--run-dir", "b", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr

    def weights(path: Path) -> dict[str, torch.Tensor]:
        return torch.load(path / "model.pt", weights_only=True)

    first, again = weights(tmp_path / "a" / "mlp-regression-seed1"), weights(tmp_path / "b" / "mlp-regression-seed1")
    other = weights(tmp_path / "a" / "mlp-regression-seed2")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_validate_good_config_prints_warnings(tmp_path: Path) -> None:
    proc = fsmtrain("validate", QUICKSTART, "--set", "epochs=5", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert "valid" in proc.stdout and "warning: early_stopping.patience" in proc.stdout
    assert "warning: scheduler_config.T_max" in proc.stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_preflight_good_and_non_finite(tmp_path: Path) -> None:
    proc = fsmtrain("preflight", QUICKSTART, cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert "4,801 parameters" in proc.stdout and "input      (64, 8) float32" in proc.stdout
    assert "output     (64, 1) float32" in proc.stdout and "6/6 tensors finite" in proc.stdout
    assert "preflight passed" in proc.stdout
    proc = fsmtrain("preflight", QUICKSTART, "--set", "data_config.noise=.nan", cwd=tmp_path)
    assert proc.returncode == ExitCode.PREFLIGHT
    assert "non-finite" in proc.stdout and "preflight FAILED" in proc.stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_nan_run_exits_with_the_nan_code(tmp_path: Path) -> None:
    proc = fsmtrain("train", QUICKSTART, *FAST, "--set", "data_config.noise=.nan", "--set", "wandb.enabled=false",
                    cwd=tmp_path)
    assert proc.returncode == ExitCode.NAN, proc.stderr
    assert "seed 0: NAN after 1 epoch(s) (requested by NaNDetectionCallback" in proc.stdout


def test_init_writes_a_starter_that_validates(tmp_path: Path) -> None:
    proc = fsmtrain("init", "starter", cwd=tmp_path)
    assert proc.returncode == ExitCode.OK, proc.stderr
    path = tmp_path / "starter" / "fsmtrain.yaml"
    text = path.read_text()
    assert text.count("#") > 20  # commented
    assert load_config(path).warnings == []
    assert main(["init", str(tmp_path / "starter")]) == ExitCode.CONFIG  # no silent overwrite



@pytest.mark.parametrize(("args", "line"), [
    # each was a traceback (FileExistsError, FileNotFoundError, IsADirectoryError) or, for the
    # climbing name, a file written outside DIR without a word
    (("afile",), "fsmtrain init: DIR afile: expected a folder to write fsmtrain.yaml into; found a file"),
    (("afile/deeper",), "fsmtrain init: DIR afile/deeper: expected a folder to write fsmtrain.yaml into; found "
                        "afile, a file"),
    (("ini", "--name", "sub/x.yaml"), "fsmtrain init: --name: expected a plain file name (the config is written "
                                      "inside DIR, ini); found 'sub/x.yaml' (a path); to write ini/sub/x.yaml, run: "
                                      "fsmtrain init ini/sub --name x.yaml"),
    (("ini", "--name", "../../escape.yaml"), "fsmtrain init: --name: expected a plain file name (the config is "
                                             "written inside DIR, ini); found '../../escape.yaml' (a path)"),
    (("ini", "--name", "", "--force"), "fsmtrain init: --name: expected a plain file name (the config is written "
                                       "inside DIR, ini); found '' (an empty name)"),
    (("ini", "--name", ".."), "fsmtrain init: --name: expected a plain file name (the config is written inside DIR, "
                              "ini); found '..' (a folder)"),
    ((".", "--name", "somedir", "--force"), "fsmtrain init: --name: expected a file name; found somedir, a folder"),
])
def test_init_refuses_a_dir_or_name_it_cannot_write_in_one_line(
        tmp_path: Path, args: tuple[str, ...], line: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (work / "afile").write_text("mine\n")
    (work / "somedir").mkdir()
    monkeypatch.chdir(work)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    assert main(["init", *args]) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert err.splitlines() == [line]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written or made
    assert (work / "afile").read_text() == "mine\n"

FAULTY = '''
from fsmtrain.core.hooks import TrainingCallback


class Fault(TrainingCallback):
    def __init__(self, kind: str, at_epoch: int = 1) -> None:
        self.kind, self.at_epoch = kind, at_epoch

    def on_train_epoch_begin(self, epoch):
        if epoch.index == self.at_epoch:
            raise KeyboardInterrupt() if self.kind == "interrupt" else RuntimeError("boom")
'''


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "code", "reason"), [("error", ExitCode.ERROR, "ERROR"),
                                                      ("interrupt", ExitCode.INTERRUPTED, "INTERRUPTED")])
def test_error_and_interrupt_exit_codes(tmp_path: Path, kind: str, code: ExitCode, reason: str) -> None:
    (tmp_path / "faulty_cb.py").write_text(FAULTY)
    extra = f"callbacks.extra=[{{target: faulty_cb.Fault, kwargs: {{kind: {kind}}}}}]"
    proc = fsmtrain("train", QUICKSTART, *FAST, "--set", "wandb.enabled=false", "--set", "seeds=[0, 1]",
                    "--set", extra, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert f"seed 0: {reason} after 1 epoch(s)" in proc.stdout
    run_dir = tmp_path / "runs" / "quickstart" / "mlp-regression-seed0"
    assert not (run_dir / "model.pt").exists()
    events = read_events(run_dir / "events.jsonl")
    assert [e for e in events if e["event"] == "transition"][-1]["to"] == "train_end"
    # an interrupt stops the remaining seeds; an error moves on to the next one
    assert ("seed 1:" in proc.stdout) == (kind == "error")


FAILING_END = '''
from fsmtrain.core.hooks import TrainingCallback


class FailingEnd(TrainingCallback):
    def on_train_end(self, run):
        raise RuntimeError("teardown boom")
'''


@pytest.mark.slow
def test_an_error_raised_in_train_end_after_all_epochs_fails_the_command(tmp_path: Path) -> None:
    """Found with the signal race: fit() raised after the run had reached train_end by a normal move
    (its result says COMPLETED), and ``fsmtrain train`` exited 0. A failing ``on_train_end`` on a run
    that trained every epoch is the same case, reachable by any user."""
    (tmp_path / "failing_end.py").write_text(FAILING_END)
    proc = fsmtrain("train", QUICKSTART, *FAST, "--set", "wandb.enabled=false",
                    "--set", "callbacks.extra=[{target: failing_end.FailingEnd}]", cwd=tmp_path)
    assert proc.returncode == ExitCode.ERROR, proc.stdout + proc.stderr
    assert "seed 0: COMPLETED after" in proc.stdout
    assert "ERROR after train_end: RuntimeError: teardown boom" in proc.stdout


def test_every_stop_reason_has_an_exit_code() -> None:
    from fsmtrain.cli import exit_code_for
    from fsmtrain.core.stop import StopReason

    codes = {reason: exit_code_for(reason) for reason in StopReason}
    assert {r for r, c in codes.items() if c is ExitCode.OK} == {
        StopReason.COMPLETED, StopReason.STEPS, StopReason.EARLY_STOP, StopReason.PRUNED, StopReason.TARGET_REACHED}
    failing = [codes[StopReason.NAN], codes[StopReason.ERROR], codes[StopReason.INTERRUPTED], ExitCode.CONFIG]
    assert len(set(failing)) == 4 and ExitCode.OK not in failing


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["audit", "validate"])
def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path, command: str) -> None:
    """Found: `fsmtrain audit --json | head` ended in a BrokenPipeError traceback. The reader of
    stdout here is gone before the command writes its first byte, as `head` is once it has its lines."""
    if command == "audit":
        from audit_runs import _trainer

        _trainer(tmp_path / "run", [], epochs=2).fit()
        args = ["audit", "--json", str(tmp_path / "run")]
    else:
        args = ["validate", str(QUICKSTART)]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "fsmtrain", *args], cwd=tmp_path, env=env, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=100)
    finally:
        os.close(write_end)
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == ExitCode.BROKEN_PIPE.value == 141


def test_preflight_lists_the_console_callback_train_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback order preflight prints is train's: the console callback included."""
    from fsmtrain.app.defaults import console_callbacks

    monkeypatch.chdir(tmp_path)
    assert main(["preflight", str(QUICKSTART)]) == ExitCode.OK
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("callbacks  "))
    assert all(f"{cb.name}(" in line for cb in console_callbacks()), line
    assert not list(tmp_path.iterdir())
