"""What one ``fsmtrain hpo`` command runs: the study, its storage, its budget and its workers."""

from __future__ import annotations

from dataclasses import dataclass

from fsmtrain.app.config import OptimizeConfig
from fsmtrain.app.hpo.storage import Heartbeat, StorageSpec
from fsmtrain.app.hpo.trial import TrialPlan

__all__ = ["StudyPlan"]


@dataclass(frozen=True)
class StudyPlan:
    trial: TrialPlan
    storage: StorageSpec
    heartbeat: Heartbeat | None
    optimize: OptimizeConfig
    n_trials: int
    deadline: float | None  # time.time() after which no trial starts
    workers: int
    config: str  # the config file as given, for the printed commands
    prior_trials: int = 0  # trials the study held when this command started (see sampler_seed)
