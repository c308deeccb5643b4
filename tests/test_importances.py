"""Parameter importances are Optuna's own: ``hpo-report`` (text and JSON) and the study page show
exactly what ``optuna.importance.get_param_importances(study)`` gives, named as Optuna's default."""

from __future__ import annotations

import json
import re
from html import unescape
from pathlib import Path

import optuna
import pytest

from fsmtrain.cli import main

METHOD = "Optuna's default evaluator, as optuna.importance.get_param_importances(study)"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A SQLite study of 30 trials over two parameters, ``x`` mattering far more than ``y``."""
    path = tmp_path / "study.db"
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{path}",
                                sampler=optuna.samplers.RandomSampler(seed=1))
    study.optimize(lambda t: t.suggest_float("x", -3, 3) ** 2 + 0.3 * t.suggest_float("y", -1, 1), n_trials=30)
    return path


def _expected(db: Path) -> dict[str, float]:
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{db}")
    return optuna.importance.get_param_importances(study)


def test_hpo_report_json_gives_optunas_default_importances(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hpo-report", str(db), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = _expected(db)
    assert len(expected) == 2
    assert report["importances"] == expected
    assert list(report["importances"]) == list(expected)  # the same order
    assert report.get("importances_method") == METHOD


def test_hpo_report_text_names_the_method_and_shows_the_figures(db: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hpo-report", str(db)]) == 0
    out = capsys.readouterr().out
    assert f"parameter importances ({METHOD}):" in out
    for name, value in _expected(db).items():
        assert re.search(rf"^  {re.escape(name)} +{value:.3f}$", out, re.M), out


def test_the_study_page_shows_the_same_importances(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "page.html"
    assert main(["report", str(db), "-o", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    figure = page[page.index('id="plot-importances"'):]
    figure = figure[:figure.index("</figure>")]
    assert METHOD in unescape(figure)
    shown = {m[1]: m[2] for m in re.finditer(r"<title>([^<:]+): ([^ <]+) </title>", figure)}
    assert shown == {name: f"{value:.6g}" for name, value in _expected(db).items()}
