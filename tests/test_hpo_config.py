"""Bad study input: one line naming the field, exit 2, nothing created (``validate`` and ``hpo``)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from hpo_support import LR_SPACE, _free_port, study_config

from fsmtrain.cli import build_parser, main


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _fails(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], *needles: str) -> str:
    before = _files(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    assert _files(tmp_path) == before, "a failed check created files"
    return err


BAD: dict[str, tuple[dict[str, object], tuple[str, ...]]] = {
    "unknown path": (
        {"search_space": {"optimizer_config.lrr": {"type": "float", "low": 1e-3, "high": 1e-1}}},
        ("optimize.search_space.optimizer_config.lrr", "unknown argument 'lrr'", "did you mean optimizer_config.lr?")),
    "unknown top-level key": (
        {"search_space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1}}},
        ("optimize.search_space.learning_rate", "unknown key 'learning_rate'")),
    "low > high": (
        {"search_space": {"optimizer_config.lr": {"type": "float", "low": 0.1, "high": 0.001}}},
        ("optimize.search_space.optimizer_config.lr: expected low <= high",)),
    "wrong type for the field": (
        {"search_space": {"epochs": {"type": "float", "low": 1.5, "high": 3.5}}},
        ("optimize.search_space.epochs", "valid integer")),
    "unknown sampler": (
        {"sampler": "optuna.samplers.TPESamplr"},
        ("optimize.sampler", "did you mean optuna.samplers.TPESampler?")),
    "unknown bare sampler": (
        {"sampler": "RandomSampel"}, ("optimize.sampler", "did you mean optuna.samplers.RandomSampler?")),
    "unknown pruner": (
        {"pruner": "MedianPrunner"}, ("optimize.pruner", "did you mean optuna.pruners.MedianPruner?")),
    "not a pruner": (
        {"pruner": "optuna.samplers.TPESampler"}, ("optimize.pruner", "BasePruner subclass")),
    "unknown pruner argument": (
        {"pruner_config": {"n_startup_trial": 2}}, ("optimize.pruner_config.n_startup_trial",
                                                     "did you mean n_startup_trials?")),
    "pruner constructor refuses": (
        {"pruner": "ThresholdPruner"}, ("optimize.pruner_config", "ThresholdPruner")),
    "grid over a float range": (
        {"sampler": "GridSampler"}, ("optimize.search_space.optimizer_config.lr", "categorical")),
    "more seeds than listed": ({"n_seeds": 3}, ("optimize.n_seeds", "at most the 1 seed(s)")),
    "empty search space": ({"search_space": {}}, ("optimize.search_space: expected at least one parameter",)),
    "bad study name": ({"study_name": "a/b"}, ("optimize.study_name",)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_optimize_section_validate_and_hpo(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    optimize, needles = BAD[case]
    monkeypatch.chdir(tmp_path)
    cfg = study_config(tmp_path, optimize)
    for command in ("validate", "hpo"):
        _fails(capsys, tmp_path, [command, str(cfg)], *needles)


def test_unreachable_storage(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"postgresql://fsm@127.0.0.1:{_free_port()}/nowhere"  # nothing listens there
    cfg = study_config(tmp_path, {})
    _fails(capsys, tmp_path, ["hpo", str(cfg), "--storage", url], "--storage: expected a reachable database",
           "127.0.0.1")
    cfg = study_config(tmp_path, {"storage": url}, name="with_storage.yaml")
    for command in ("validate", "hpo"):
        _fails(capsys, tmp_path, [command, str(cfg)], "optimize.storage: expected a reachable database")


def test_existing_study_with_another_direction(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "other.db"
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    optuna.create_study(study_name="s", storage=f"sqlite:///{db}", direction="maximize")
    cfg = study_config(tmp_path, {"storage": str(db)})
    _fails(capsys, tmp_path, ["hpo", str(cfg)], "optimize.direction: expected maximize, the direction of the "
           "existing study 's'", "found minimize")
    _fails(capsys, tmp_path, ["validate", str(cfg)], "optimize.direction")
    assert optuna.load_study(study_name="s", storage=f"sqlite:///{db}").trials == []


def test_sqlite_with_several_workers_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = study_config(tmp_path, {})
    _fails(capsys, tmp_path, ["hpo", str(cfg), "--workers", "2", "--storage", "s.db"],
           "--workers: expected 1 with a SQLite storage")
    _fails(capsys, tmp_path, ["hpo", str(cfg), "--study", "../x"], "--study: expected a study name")


def test_hpo_without_optimize_section(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = study_config(tmp_path, {})
    cfg.write_text(cfg.read_text().split("optimize:")[0])
    _fails(capsys, tmp_path, ["hpo", str(cfg)], "optimize: expected an optimize: section")


def test_valid_study_config_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    space = {**LR_SPACE, "batch_size": {"type": "int", "low": 16, "high": 64, "step": 16},
             "net_config.dropout": {"type": "categorical", "choices": [0.0, 0.1]}}
    cfg = study_config(tmp_path, {"search_space": space, "pruner": "PredictedFinalLossPruner",
                                  "pruner_config": {"margin": 0.2}})
    assert main(["validate", str(cfg)]) == 0
    assert "valid" in capsys.readouterr().out
    assert _files(tmp_path) == {"study.yaml"}


def test_train_on_a_study_config_says_hpo_runs_the_study(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = study_config(tmp_path, {})
    assert main(["train", str(cfg), "--set", "checkpoint.enabled=false"]) == 0
    err = capsys.readouterr().err
    assert f"`fsmtrain hpo {cfg}` runs the study" in err and "train runs it once" in err
    assert len(list((tmp_path / "runs").rglob("events.jsonl"))) == 1  # one training, no trials


def test_the_parser_knows_the_commands() -> None:
    text = build_parser().format_help()
    assert "hpo-report" in text and "hpo " in text
