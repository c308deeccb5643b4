"""Hyper-parameter search (``fsmtrain hpo``): the Optuna study a config's ``optimize:`` section
describes, each trial one ordinary run per seed.

Inside: ``study`` (a study and its worker processes), ``worker`` (one worker's trials and the
signals it catches), ``trial`` (one trial's seeds), ``recovery`` (trials lost to Ctrl-C or a dead
process, retried), ``seeds`` (sampler seeds no two workers share),
``monitor`` (the live line and the per-trial lines), ``pruner`` (:class:`PredictedFinalLossPruner`),
``storage`` (SQLite, journal file or a database URL) and ``cli`` (the subcommand). Names are
imported when first asked for, so building the ``fsmtrain`` parser imports no Optuna.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsmtrain.core.exports import lazy_exports

_STUDY = "fsmtrain.app.hpo.study"
_STORAGE = "fsmtrain.app.hpo.storage"
__getattr__, __dir__ = lazy_exports(__name__, {
    "StudyPlan": "fsmtrain.app.hpo.plan", "check_study": _STUDY, "prepare": _STUDY, "run_study": _STUDY,
    "PredictedFinalLossPruner": "fsmtrain.app.hpo.pruner",
    "StorageError": _STORAGE, "StorageSpec": _STORAGE, "open_storage": _STORAGE, "parse_storage": _STORAGE,
    "TrialPlan": "fsmtrain.app.hpo.trial", "run_trial": "fsmtrain.app.hpo.trial",
})

__all__ = [
    "PredictedFinalLossPruner", "StorageError", "StorageSpec", "StudyPlan", "TrialPlan", "check_study",
    "open_storage", "parse_storage", "prepare", "run_study", "run_trial",
]

if TYPE_CHECKING:
    from fsmtrain.app.hpo.plan import StudyPlan
    from fsmtrain.app.hpo.pruner import PredictedFinalLossPruner
    from fsmtrain.app.hpo.storage import StorageError, StorageSpec, open_storage, parse_storage
    from fsmtrain.app.hpo.study import check_study, prepare, run_study
    from fsmtrain.app.hpo.trial import TrialPlan, run_trial
