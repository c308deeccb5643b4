"""``fsmtrain hpo`` in this process on a SQLite study: trial semantics (NaN, exceptions, pruning),
every trial an audited run, the study readable by Optuna, optuna-dashboard and ``hpo-report``, and
every sampler and pruner Optuna ships."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import optuna
import pytest
from hpo_support import LR_SPACE, load, study_config
from optuna.trial import TrialState

from fsmtrain.cli import main
from fsmtrain.core.events import read_events
from fsmtrain.tools.audit import audit_file
from fsmtrain.training.models import MLP


class RaisingMLP(MLP):
    """The quickstart's MLP, except that it raises in forward when told to."""

    def __init__(self, *args: Any, explode: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.explode = explode

    def forward(self, x: Any) -> Any:
        if self.explode:
            raise RuntimeError("boom: this model raises on purpose")
        return super().forward(x)


def _hpo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         cfg: Path, *args: str, expect: int = 0) -> str:
    monkeypatch.chdir(tmp_path)
    code = main(["hpo", str(cfg), *args])
    out = capsys.readouterr()
    assert code == expect, out.out + out.err
    return out.out


def _study(tmp_path: Path, name: str = "s") -> optuna.study.Study:
    return load(f"sqlite:///{tmp_path / 'runs' / 'quickstart' / name / 'study.db'}", name)


def _audited(trial: optuna.trial.FrozenTrial, study: str) -> list[Path]:
    dirs = [Path(d) for d in trial.user_attrs["run_dirs"].values()]
    for run_dir in dirs:
        report = audit_file(run_dir / "events.jsonl")
        assert report.ok, report.render()
        start = read_events(run_dir / "events.jsonl")[0]["payload"]
        assert start["hpo"]["study"] == study and start["hpo"]["trial"] == trial.number
        assert start["hpo"]["params"] == trial.params
        assert run_dir.name.startswith(f"trial-{trial.number}-seed")
    return dirs


def test_nan_trials_are_inf_and_stop_their_seeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    space = {"optimizer_config.lr": {"type": "categorical", "choices": [0.01, 1000.0]}}
    cfg = study_config(tmp_path, {"n_trials": 2, "sampler": "GridSampler", "search_space": space},
                       optimizer="torch.optim.SGD", seeds=[0, 1])
    out = _hpo(tmp_path, monkeypatch, capsys, cfg)
    study = _study(tmp_path)
    by_lr = {t.params["optimizer_config.lr"]: t for t in study.trials}
    diverged, fine = by_lr[1000.0], by_lr[0.01]
    assert diverged.state is TrialState.COMPLETE and diverged.value == math.inf
    assert diverged.user_attrs["seed_objectives"] == {"0": "NaN"}  # seed 1 never ran
    assert list(diverged.user_attrs["run_dirs"]) == ["0"]
    assert not any((tmp_path / "runs" / "quickstart" / "s").glob(f"trial-{diverged.number}-seed1"))
    assert fine.value is not None and math.isfinite(fine.value)
    assert fine.value == pytest.approx(sum(fine.user_attrs["seed_objectives"].values()) / 2)
    assert study.best_value == fine.value
    assert f"trial {diverged.number} COMPLETE inf (seed 0 diverged: NaN)" in out
    for trial in study.trials:
        _audited(trial, "s")


def test_a_raising_model_fails_its_trial_and_the_study_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    space = {"net_config.explode": {"type": "categorical", "choices": [True, False]}}
    cfg = study_config(tmp_path, {"n_trials": 2, "sampler": "GridSampler", "search_space": space},
                       net=f"{__name__}.RaisingMLP")
    out = _hpo(tmp_path, monkeypatch, capsys, cfg)
    study = _study(tmp_path)
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "FAIL"]
    failed = next(t for t in study.trials if t.state is TrialState.FAIL)
    assert failed.params == {"net_config.explode": True}
    assert failed.user_attrs["error"] == "RuntimeError: boom: this model raises on purpose"
    assert "Traceback (most recent call last)" in failed.user_attrs["traceback"]
    assert "in forward" in failed.user_attrs["traceback"]
    assert f"trial {failed.number} FAIL RuntimeError: boom" in out
    # the failed run still ended through train_end and explains itself
    report = audit_file(Path(failed.user_attrs["run_dirs"]["0"]) / "events.jsonl")
    assert report.ok and report.explanation.stop_reason == "error"


def test_median_pruner_prunes_bad_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "median.db"
    study = load_or_create(f"sqlite:///{db}")
    for lr in (0.03, 0.03, 1e-7, 1e-7, 1e-7):  # two good trials first, then three that cannot learn
        study.enqueue_trial({"optimizer_config.lr": lr})
    space = {"optimizer_config.lr": {"type": "float", "low": 1e-8, "high": 0.1, "log": True}}
    cfg = study_config(tmp_path, {"n_trials": 5, "storage": str(db), "search_space": space,
                                  "pruner": "MedianPruner", "pruner_config": {"n_startup_trials": 2,
                                                                              "n_warmup_steps": 2}}, epochs=4)
    _hpo(tmp_path, monkeypatch, capsys, cfg)
    trials = load(f"sqlite:///{db}").trials
    assert [t.state.name for t in trials[:2]] == ["COMPLETE", "COMPLETE"]
    pruned = [t for t in trials[2:] if t.state is TrialState.PRUNED]
    assert pruned, [t.state for t in trials]
    for t in pruned:
        # Optuna's steps count validations: warm-up 2, so the first decision is at validation 2 (4 batches an epoch)
        assert t.user_attrs["pruned"]["pruner"] == "MedianPruner" and t.last_step == 2
        assert [t.user_attrs["pruned"][k] for k in ("validation", "epoch", "step")] == [2, 2, 8]
        events = read_events(Path(t.user_attrs["run_dirs"]["0"]) / "events.jsonl")
        assert events[-1]["payload"]["stop_reason"] == "pruned"  # ended through train_end, result written
        _audited(t, "s")
    monkeypatch.chdir(tmp_path)
    assert main(["hpo-report", str(db)]) == 0
    text = capsys.readouterr().out
    assert f"trial {pruned[0].number} pruned at validation 2 (epoch 2, step 8, val_loss" in text
    assert "by MedianPruner" in text


def load_or_create(url: str) -> optuna.study.Study:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.create_study(study_name="s", storage=url, direction="minimize")


def test_study_opens_everywhere_and_the_report_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    space = {**LR_SPACE, "batch_size": {"type": "int", "low": 16, "high": 64, "step": 16}}
    cfg = study_config(tmp_path, {"n_trials": 4, "search_space": space, "sampler": "RandomSampler",
                                  "sampler_config": {"seed": 3}})
    out = _hpo(tmp_path, monkeypatch, capsys, cfg)
    url = "sqlite:///runs/quickstart/s/study.db"
    assert f"optuna-dashboard {url}" in out and f"optuna.load_study(study_name='s', storage='{url}')" in out
    study = load(url)
    assert len(study.trials) == 4 and all(t.state.is_finished() for t in study.trials)

    from optuna_dashboard._storage import get_studies
    from optuna_dashboard._storage_url import get_storage

    dashboard = get_storage(url)  # what `optuna-dashboard URL` opens
    assert [s.study_name for s in get_studies(dashboard)] == ["s"]

    assert main(["hpo-report", "runs/quickstart/s", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    counts = {s: sum(t.state.name == s for t in study.trials) for s in report["counts"]}
    assert report["counts"] == counts and report["n_trials"] == len(study.trials)
    complete = [t for t in study.trials if t.state is TrialState.COMPLETE]
    if complete:
        assert report["best"]["number"] == study.best_trial.number
        assert report["best"]["value"] == study.best_value and report["best"]["params"] == study.best_params
        assert report["best"]["run_dirs"] == study.best_trial.user_attrs["run_dirs"]
        assert [t["value"] for t in report["top"]] == sorted(t.value for t in complete if t.value is not None)[:5]
    for trial in study.trials:
        _audited(trial, "s")
    assert main(["hpo-report", "runs/quickstart/s", "--study", "nope"]) == 2
    assert "--study: expected one of the studies" in capsys.readouterr().err


# --- every sampler and pruner Optuna ships -------------------------------------------------------
TWO_PARAMS = {**LR_SPACE, "batch_size": {"type": "int", "low": 16, "high": 64, "step": 16}}
GRID = {"optimizer_config.lr": {"type": "categorical", "choices": [0.003, 0.01, 0.03]}}
SAMPLERS: dict[str, dict[str, Any]] = {
    "TPESampler": {"sampler_config": {"seed": 0, "n_startup_trials": 1}},
    "GPSampler": {"sampler_config": {"seed": 0, "n_startup_trials": 1}},
    "CmaEsSampler": {"sampler_config": {"seed": 0, "n_startup_trials": 1}},
    "QMCSampler": {"sampler_config": {"seed": 0}},
    "RandomSampler": {"sampler_config": {"seed": 0}},
    "GridSampler": {"search_space": GRID},
}
PRUNERS: dict[str, dict[str, Any]] = {
    "MedianPruner": {"n_startup_trials": 1},
    "PercentilePruner": {"percentile": 25.0, "n_startup_trials": 1},
    "HyperbandPruner": {"min_resource": 1, "max_resource": 3},
    "SuccessiveHalvingPruner": {"min_resource": 1},
    "PatientPruner": {"wrapped_pruner": {"target": "optuna.pruners.MedianPruner",
                                         "kwargs": {"n_startup_trials": 1}}, "patience": 1},
    "WilcoxonPruner": {"p_threshold": 0.1},
    "ThresholdPruner": {"upper": 100.0},
    "NopPruner": {},
    "PredictedFinalLossPruner": {"n_warmup_steps": 1},
}


def _three_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                  optimize: dict[str, Any]) -> optuna.study.Study:
    cfg = study_config(tmp_path, {"n_trials": 3, "search_space": TWO_PARAMS, **optimize})
    _hpo(tmp_path, monkeypatch, capsys, cfg)
    study = _study(tmp_path)
    assert len(study.trials) == 3 and sorted(t.number for t in study.trials) == [0, 1, 2]
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials), \
        [(t.state, t.user_attrs.get("error")) for t in study.trials]
    return study


@pytest.mark.slow
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_every_sampler_runs_a_study(sampler: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    study = _three_trials(tmp_path, monkeypatch, capsys, {"sampler": sampler, **SAMPLERS[sampler]})
    space = SAMPLERS[sampler].get("search_space", TWO_PARAMS)
    for trial in study.trials:
        assert set(trial.params) == set(space)
        lr = trial.params["optimizer_config.lr"]
        assert 1e-3 <= lr <= 1e-1
    if sampler == "GridSampler":
        assert sorted(t.params["optimizer_config.lr"] for t in study.trials) == [0.003, 0.01, 0.03]


@pytest.mark.slow
@pytest.mark.parametrize("pruner", sorted(PRUNERS))
def test_every_pruner_runs_a_study(pruner: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    study = _three_trials(tmp_path, monkeypatch, capsys, {"pruner": pruner, "pruner_config": PRUNERS[pruner],
                                                          "sampler_config": {"seed": 0}})
    for trial in study.trials:
        events = read_events(Path(trial.user_attrs["run_dirs"]["0"]) / "events.jsonl")
        first = next(e["payload"]["validation"] for e in events if e["event"] == "trial_report")
        assert first == min(trial.intermediate_values) == 1  # the first seed reported its validations, from 1
    assert study.user_attrs["fsmtrain"]["pruner"] == pruner


def test_live_display_on_a_terminal() -> None:
    """Trial lines scroll; the status line (done of total, running, pruned, failed, best) is redrawn."""
    import io

    from optuna.distributions import BaseDistribution, FloatDistribution
    from optuna.trial import create_trial

    from fsmtrain.app.hpo.monitor import Monitor

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study()
    mine = {"worker": {"host": "h", "pid": 1, "launch": "L"}}
    dist: dict[str, BaseDistribution] = {"optimizer_config.lr": FloatDistribution(1e-3, 1e-1, log=True)}
    out = io.StringIO()
    monitor = Monitor(study, "L", 5, out, live=True)
    for state, value, attrs in ((TrialState.COMPLETE, 0.5, {}), (TrialState.COMPLETE, 0.25, {}),
                                (TrialState.PRUNED, None,
                                 {"pruned": {"pruner": "MedianPruner", "validation": 1, "epoch": 1, "step": 4}}),
                                (TrialState.FAIL, None, {"error": "ValueError: nope"})):
        study.add_trial(create_trial(state=state, value=value, params={"optimizer_config.lr": 0.01},
                                     distributions=dist, user_attrs={**mine, **attrs},
                                     intermediate_values={1: 1.0}))
    study.enqueue_trial({"optimizer_config.lr": 0.02}, user_attrs=mine)
    study.ask()  # RUNNING
    monitor.poll()
    text = out.getvalue()
    assert text.startswith("\r\x1b[K")
    assert "trial 1 COMPLETE 0.25  optimizer_config.lr=0.01" in text
    assert "trial 2 PRUNED at validation 1 (epoch 1, step 4) by MedianPruner" in text
    assert "trial 3 FAIL ValueError: nope" in text
    assert text.endswith("[4/5] running 1, pruned 1, failed 1 | best 0.25 (trial 1)")
    monitor.poll()  # nothing new: only the status line again
    assert out.getvalue()[len(text):] == "\r\x1b[K[4/5] running 1, pruned 1, failed 1 | best 0.25 (trial 1)"


def test_a_second_command_on_a_seeded_study_proposes_new_parameters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each `fsmtrain hpo` on an existing study seeds its sampler anew, not with the configured seed
    again (which would propose the first command's parameters a second time)."""
    cfg = study_config(tmp_path, {"n_trials": 2, "search_space": LR_SPACE, "sampler": "RandomSampler",
                                  "sampler_config": {"seed": 3}})
    for _ in range(3):
        _hpo(tmp_path, monkeypatch, capsys, cfg)
    lrs = [t.params["optimizer_config.lr"] for t in _study(tmp_path).trials]
    assert len(lrs) == 6 and len(set(lrs)) == 6, lrs
    # a fresh study's first command still draws what the configured seed draws in Optuna itself
    first = optuna.samplers.RandomSampler(seed=3)
    study = optuna.create_study(sampler=first)
    space = optuna.distributions.FloatDistribution(LR_SPACE["optimizer_config.lr"]["low"],
                                                   LR_SPACE["optimizer_config.lr"]["high"], log=True)
    assert [study.ask({"optimizer_config.lr": space}).params["optimizer_config.lr"] for _ in range(2)] == lrs[:2]


def test_a_study_folder_is_not_reused_by_a_storage_without_its_study(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`hpo` on SQLite, then `hpo --workers 2` (a journal) on the same study: the journal's new study
    is refused, since its trials would be numbered from 0 into the first study's run dirs."""
    cfg = study_config(tmp_path, {"n_trials": 1})
    _hpo(tmp_path, monkeypatch, capsys, cfg)
    folder = tmp_path / "runs" / "quickstart" / "s"
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    for args, blamed in ((("--workers", "2"), "--workers"), (("--storage", "sqlite:///other.db"), "--storage")):
        monkeypatch.chdir(tmp_path)
        assert main(["hpo", str(cfg), *args]) == 2
        err = capsys.readouterr().err
        assert (f"{blamed}: expected the storage that holds the trials already in runs/quickstart/s (study.db there), "
                "or another --study name; found") in err and "which holds no study 's'" in err, err
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
        assert not (tmp_path / "other.db").exists()
    _hpo(tmp_path, monkeypatch, capsys, cfg, "--study", "s2", "--workers", "2")  # a new study is fine
