"""A user's mistake gets one clear line and the right exit code, never a traceback, through the real
command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
pytestmark = pytest.mark.timeout(120)

CSV_BUILDER = '''
import csv

def load_csv(*, batch_size, seed, path):
    with open(path) as fh:
        rows = list(csv.reader(fh))
    raise AssertionError("not reached in these tests")
'''


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)  # the project only: the working folder is not on it
    env["WANDB_MODE"] = "offline"
    env.pop("WANDB_SERVICE", None)
    return env


def _write(folder: Path, name: str, **changes: Any) -> Path:
    cfg = json.loads(json.dumps(QUICKSTART))
    cfg["wandb"] = {"enabled": False}
    cfg["epochs"] = 2
    cfg["scheduler_config"] = {"T_max": 2}
    cfg["early_stopping"] = {"enabled": True, "patience": 1}
    for key, value in changes.items():
        node = cfg
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    path = folder / name
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _cli(*args: str, cwd: Path, entry: str = "module") -> subprocess.CompletedProcess[str]:
    if entry == "script":
        exe = shutil.which("fsmtrain")
        assert exe is not None, "the fsmtrain console script is not installed"
        cmd = [exe, *args]
    else:
        cmd = [sys.executable, "-m", "fsmtrain", *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=110, check=False)


def _main(*args: str, cwd: Path, capsys: pytest.CaptureFixture[str],
          monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess[str]:
    """The same command through ``fsmtrain.cli.main`` in this process (the console script calls it),
    for the cases whose point is the message, not the process."""
    from fsmtrain.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def _one_line(done: subprocess.CompletedProcess[str], code: int, line: str) -> None:
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out
    assert done.returncode == code, out
    assert line in out.splitlines(), out


def test_preflight_names_the_failing_forward_in_one_line(tmp_path: Path) -> None:
    config = _write(tmp_path, "shape.yaml", net_config__in_features=5)
    done = _cli("preflight", str(config), cwd=tmp_path, entry="script")
    _one_line(done, 4, "preflight FAILED at the forward of fsmtrain.training.models.MLP, in module net.0 "
                       "(Linear(in_features=5, out_features=64, bias=True)) given (64, 8) float32: RuntimeError: "
                       "mat1 and mat2 shapes cannot be multiplied (64x8 and 5x64)")


def test_a_data_builder_that_raises_is_a_config_error_before_any_run(tmp_path: Path) -> None:
    (tmp_path / "mydata.py").write_text(CSV_BUILDER)
    config = _write(tmp_path, "csv.yaml", data="mydata.load_csv", data_config={"path": "missing.csv"})
    done = _cli("train", str(config), "--run-dir", "runs", cwd=tmp_path, entry="script")
    _one_line(done, 2, f"fsmtrain train: config {config}: data_config.path: expected a data builder call that "
                       "returns (train, val) (mydata.load_csv with batch_size, seed and data_config); found "
                       "mydata.load_csv raised FileNotFoundError: [Errno 2] No such file or directory: 'missing.csv'")
    assert not (tmp_path / "runs").exists()


def test_a_data_builder_argument_problem_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mydata.py").write_text(CSV_BUILDER)
    config = _write(tmp_path, "csv.yaml", data="mydata.load_csv", data_config={"paht": "data.csv"})
    for command in ("validate", "train"):
        extra = ("--run-dir", "runs") if command == "train" else ()
        done = _main(command, str(config), *extra, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
        _one_line(done, 2, "  - data_config.paht: expected an argument of function 'load_csv': batch_size, seed, "
                           "path; found unknown argument 'paht' (did you mean path?)")
        assert f"fsmtrain {command}: config {config} has 2 problems:" in done.stderr
    assert not any((tmp_path / "runs").rglob("events.jsonl")) if (tmp_path / "runs").exists() else True


def test_binary_and_empty_files_are_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "image.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    _one_line(_main("validate", "image.yaml", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch), 2,
              "fsmtrain validate: config image.yaml: <root>: expected a YAML text file (UTF-8); found binary content "
              "(NUL byte at byte 8)")
    _one_line(_cli("train", "empty.yaml", cwd=tmp_path), 2,
              "fsmtrain train: config empty.yaml: <root>: expected a mapping of config keys; found an empty file "
              "(no keys at all)")


@pytest.mark.parametrize(("change", "line"), [
    ({"optimizer_config__lr": -0.001}, "optimizer_config.lr: expected a value torch.optim.Adam accepts; found -0.001 "
                                       "(ValueError: Invalid learning rate: -0.001)"),
    ({"optimizer_config__lr": float("nan")}, "optimizer_config.lr: expected a value torch.optim.Adam accepts; found "
                                             "nan (ValueError: Invalid learning rate: nan)"),
    ({"optimizer_config__betas": 0.9}, "optimizer_config.betas: expected a value torch.optim.Adam accepts; found 0.9 "
                                       "(TypeError: 'float' object is not subscriptable)"),
    ({"net_config__hidden": "64,64"}, "net_config.hidden: expected a value fsmtrain.training.models.MLP accepts; "
                                      "found '64,64' (TypeError: empty(): argument 'size' (position 1) must be tuple "
                                      "of ints, but found element of type str at pos 0)"),
    ({"data_config__n_features": "eight"}, "data_config.n_features: expected int "
                                           "(fsmtrain.training.data.synthetic_regression says so); found 'eight'"),
    # caught by validate, not as an ERROR at the run's first step (LBFGS's step() needs a closure)
    ({"optimizer": "torch.optim.LBFGS"}, "optimizer: expected an optimizer whose step() needs no closure (fsmtrain "
                                         "calls optimizer.step() once a batch); found torch.optim.LBFGS, whose step() "
                                         "requires a closure"),
])
def test_validate_rejects_what_train_rejects_naming_the_leaf_and_the_file(
        tmp_path: Path, change: dict[str, Any], line: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = _write(tmp_path, "bad.yaml", **change)
    _one_line(_main("validate", "bad.yaml", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch), 2,
              f"fsmtrain validate: config bad.yaml: {line}")
    if "optimizer_config__lr" in change and change["optimizer_config__lr"] == -0.001:
        done = _main("train", str(config), "--run-dir", "runs", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
        assert f"fsmtrain train: config {config}: {line}" in done.stderr.splitlines()
        assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr
        assert not list((tmp_path / "runs").rglob("*")) if (tmp_path / "runs").exists() else True


def test_validate_says_it_ran_no_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "shape.yaml", net_config__in_features=5)  # its forward fails: only preflight runs one
    done = _main("validate", "shape.yaml", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    _one_line(done, 0, "shape.yaml: valid (1 seed(s), 2 epochs, net fsmtrain.training.models.MLP, optimizer "
                       "torch.optim.Adam, 0 warning(s)); built model, loss, optimizer, scheduler and checked the data "
                       "builder's arguments (the data was not built: --data builds it); no batch was run: "
                       "`fsmtrain preflight shape.yaml` runs one step")


def test_a_set_mistake_blames_the_set(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "ok.yaml")
    _one_line(_main("validate", "ok.yaml", "--set", "epochs=abc", cwd=tmp_path, capsys=capsys,
                    monkeypatch=monkeypatch), 2,
              "fsmtrain validate: --set epochs=abc: epochs: expected a valid integer; found 'abc'")
    _one_line(_main("validate", "ok.yaml", "--set", "optimizer_config.lr=-1", cwd=tmp_path, capsys=capsys,
                    monkeypatch=monkeypatch), 2,
              "fsmtrain validate: --set optimizer_config.lr=-1: optimizer_config.lr: expected a value "
              "torch.optim.Adam accepts; found -1 (ValueError: Invalid learning rate: -1)")


@pytest.mark.parametrize("entry", ["script", "module"])
def test_user_modules_beside_the_config_or_in_the_working_folder_import(tmp_path: Path, entry: str) -> None:
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "mydata.py").write_text("from fsmtrain.training.data import synthetic_regression as build\n")
    (project / "configs" / "netlib.py").write_text("from fsmtrain.training.models import MLP\n")
    _write(project / "configs", "run.yaml", data="mydata.build", net="netlib.MLP")
    done = _cli("validate", "configs/run.yaml", cwd=project, entry=entry)  # mydata: working folder; netlib: beside
    assert done.returncode == 0, done.stdout + done.stderr
    _write(project / "configs", "typo.yaml", data="mydatx.build")
    _one_line(_cli("validate", "configs/typo.yaml", cwd=project, entry=entry), 2,
              "fsmtrain validate: config configs/typo.yaml: data: expected an importable dotted path to a data builder "
              "function (batch_size=, seed=, **data_config) -> (train, val); found no module named 'mydatx' (did you "
              "mean mydata.build?)")


def test_an_extra_callback_that_rejects_its_kwargs_is_named_by_validate_and_train(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`callbacks.extra: [{target: fsmtrain.callbacks.EarlyStoppingCallback, kwargs: {patience: -1}}]` is
    refused by validate and by train in one line naming the kwarg, not a ValueError traceback."""
    extra = "callbacks.extra=[{target: fsmtrain.callbacks.EarlyStoppingCallback, kwargs: {patience: -1}}]"
    _write(tmp_path, "c.yaml")
    line = (f"--set {extra}: callbacks.extra.0.kwargs.patience: expected a value "
            "fsmtrain.callbacks.EarlyStoppingCallback accepts; found -1 "
            "(ValueError: patience must be an integer >= 1, got -1)")
    _one_line(_main("validate", "c.yaml", "--set", extra, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch), 2,
              f"fsmtrain validate: {line}")
    done = _main("train", "c.yaml", "--set", extra, "--run-dir", "runs", cwd=tmp_path, capsys=capsys,
                 monkeypatch=monkeypatch)
    assert done.returncode == 2 and f"fsmtrain train: {line}" in done.stderr.splitlines(), done.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("*"))
    ok = "callbacks.extra=[{target: fsmtrain.callbacks.EarlyStoppingCallback, kwargs: {patience: 3}}]"
    done = _main("validate", "c.yaml", "--set", ok, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert done.returncode == 0 and "built model, loss, optimizer, scheduler, extra callbacks" in done.stdout


def test_a_seed_torch_cannot_take_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "ok.yaml")
    line = ("fsmtrain {}: --set seeds=[18446744073709551616]: seeds: expected seeds from -2**63 to 2**64-1 (what "
            "torch.manual_seed accepts); 18446744073709551616 outside that range; found [18446744073709551616]")
    for command, extra in (("validate", ()), ("train", ("--run-dir", "runs"))):
        done = _main(command, "ok.yaml", "--set", "seeds=[18446744073709551616]", *extra, cwd=tmp_path,
                     capsys=capsys, monkeypatch=monkeypatch)
        _one_line(done, 2, line.format(command))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("args", "line"), [
    # --nproc 0 and -1 ran one process; --top -3 printed "top 1" and -1 "top 3" (negative slices)
    (("train", "c.yaml", "--nproc", "0"), "fsmtrain train: error: argument --nproc: expected a whole number >= 1; "
                                          "found '0'"),
    (("train", "c.yaml", "--nproc", "-1"), "fsmtrain train: error: argument --nproc: expected a whole number >= 1; "
                                           "found '-1'"),
    (("hpo-report", "study.db", "--top", "-3"), "fsmtrain hpo-report: error: argument --top: expected a whole "
                                                "number >= 1; found '-3'"),
    (("hpo-report", "study.db", "--top", "0"), "fsmtrain hpo-report: error: argument --top: expected a whole "
                                               "number >= 1; found '0'"),
])
def test_counts_on_the_command_line_are_positive_whole_numbers(
        tmp_path: Path, args: tuple[str, ...], line: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as info:  # argparse's usage error, before anything is read or run
        _main(*args, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert line in err.splitlines() and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def _alias_bomb(path: Path) -> Path:
    """The "billion laughs": nine levels of ``&b [*a, *a, ...]``, under 1 kB of text, 9**9 leaves
    once expanded."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _huge(path: Path, size: int = 50 * 2**20) -> Path:
    """A valid-looking config of ``size`` bytes: the quickstart, then a long list of data options."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(yaml.safe_dump(QUICKSTART) + "net_config_extra:\n")
        row = "  - [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]\n"
        fh.write(row * (size // len(row) + 1))
    return path


@pytest.mark.timeout(60)  # expanded, the bomb runs for minutes and the 50 MB file for 21 s
@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize("kind", ["bomb", "huge"])
def test_an_alias_bomb_and_a_huge_file_are_refused_unexpanded(tmp_path: Path, command: str, kind: str) -> None:
    """An 878-byte YAML alias bomb and a 50 MB config are refused before they are expanded or read
    whole (expanded, the bomb hangs validate and train for minutes)."""
    if kind == "bomb":
        config = _alias_bomb(tmp_path / "bomb.yaml")
        line = ("<root>: expected at most 100,000 nodes with its aliases expanded; found config expands to more "
                "than 100,000 nodes (YAML aliases)")
    else:
        config = _huge(tmp_path / "huge.yaml")
        line = (f"<root>: expected a config file of at most 1,000,000 bytes (FSMTRAIN_MAX_CONFIG_BYTES sets the "
                f"limit); found {config.stat().st_size:,} bytes")
    done = _cli(command, config.name, cwd=tmp_path)
    _one_line(done, 2, f"fsmtrain {command}: config {config.name}: {line}")
    assert not (tmp_path / "runs").exists()


def test_the_size_limit_is_set_by_the_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config = _write(tmp_path, "ok.yaml")
    size = config.stat().st_size
    monkeypatch.setenv("FSMTRAIN_MAX_CONFIG_BYTES", str(size - 1))
    _one_line(_main("validate", "ok.yaml", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch), 2,
              f"fsmtrain validate: config ok.yaml: <root>: expected a config file of at most {size - 1:,} bytes "
              f"(FSMTRAIN_MAX_CONFIG_BYTES sets the limit); found {size:,} bytes")
    monkeypatch.setenv("FSMTRAIN_MAX_CONFIG_BYTES", str(size))
    assert _main("validate", "ok.yaml", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch).returncode == 0
    monkeypatch.setenv("FSMTRAIN_MAX_CONFIG_BYTES", "1MB")
    _one_line(_main("validate", "ok.yaml", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch), 2,
              "fsmtrain validate: config ok.yaml: $FSMTRAIN_MAX_CONFIG_BYTES (environment): expected a positive whole "
              "number of bytes; found '1MB'")


@pytest.mark.parametrize(("text", "found"), [
    ("a: &x [*x]\n", "config contains itself (a recursive YAML alias)"),
    ("a: " + "[" * 50_000 + "\n", "collections nested too deeply to read"),
], ids=["recursive", "deep"])
def test_a_self_containing_or_too_deep_config_is_one_line(tmp_path: Path, text: str, found: str,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "odd.yaml").write_text(text, encoding="utf-8")
    done = _main("validate", "odd.yaml", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert done.returncode == 2 and "Traceback" not in done.stderr and found in done.stderr, done.stderr


_NOT_A_LOSS = ("criterion: expected a loss: an nn.Module subclass or a function (output, target) -> tensor; found "
               "{} is a function of Python's standard library, not a loss")


@pytest.mark.parametrize(("change", "line"), [
    # callables that are not losses: refused by validate, not an ERROR at the run's first batch
    ({"criterion": "os.system"}, _NOT_A_LOSS.format("os.system")),
    ({"criterion": "builtins.eval"}, _NOT_A_LOSS.format("builtins.eval")),
    # a non-finite hyperparameter: refused by validate, not a run that ends NAN (exit 3)
    ({"optimizer_config__lr": float("inf")}, "optimizer_config.lr: expected a finite number (torch.optim.Adam steps "
                                             "with it); found inf"),
    ({"optimizer": "torch.optim.SGD", "optimizer_config": {"lr": 0.01, "momentum": float("inf")}},
     "optimizer_config.momentum: expected a finite number (torch.optim.SGD steps with it); found inf"),
    ({"criterion": "torch.nn.functional.relu"}, "criterion: expected a loss: an nn.Module subclass or a function "
                                                "(output, target) -> tensor; found torch.nn.functional.relu is a "
                                                "function taking (input, inplace=False), not "
                                                "(output, target, ...) with both required"),
], ids=["os.system", "builtins.eval", "lr-inf", "momentum-inf", "relu"])
def test_validate_and_train_refuse_what_cannot_be_a_loss_or_a_step(
        tmp_path: Path, change: dict[str, Any], line: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = _write(tmp_path, "bad.yaml", **change)
    for command in ("validate", "train"):
        done = _main(command, "bad.yaml", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
        _one_line(done, 2, f"fsmtrain {command}: config bad.yaml: {line}")
    assert not (tmp_path / "runs").exists()
    assert config.is_file()


def test_loss_functions_of_torch_and_of_the_user_still_resolve(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "halved_losses.py").write_text("def halved(output, target, *, half=0.5):\n"
                                          "    return half * ((output - target) ** 2).mean()\n")
    for criterion in ("torch.nn.functional.mse_loss", "torch.nn.functional.smooth_l1_loss", "torch.nn.L1Loss",
                      "halved_losses.halved"):
        _write(tmp_path, "ok.yaml", criterion=criterion)
        done = _main("validate", "ok.yaml", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
        assert done.returncode == 0, done.stderr
