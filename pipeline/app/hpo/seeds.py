"""Sampler seeds no two workers of a study share (a seed proposes what it proposed before): each
taken seed is a study system attribute of its own, ``fsmtrain:sampler_seed:<seed>``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsmtrain.app.config.optimize import drawn_seed, sampler_seed

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

__all__ = ["SEED_ATTR_PREFIX", "claim_sampler_seed", "seeds_used"]

SEED_ATTR_PREFIX = "fsmtrain:sampler_seed:"


def seeds_used(attrs: Mapping[str, Any]) -> dict[int, Any]:
    """The seeds recorded in a study's system attributes, with who took each."""
    out: dict[int, Any] = {}
    for key, who in attrs.items():
        if key.startswith(SEED_ATTR_PREFIX):
            try:
                out[int(key.removeprefix(SEED_ATTR_PREFIX))] = who
            except ValueError:
                continue
    return out


def claim_sampler_seed(storage: BaseStorage, study: str, seed: int, *, worker: int, launch: str,
                       prior_trials: int, who: Mapping[str, Any],
                       say: Callable[[str], None] | None = None) -> int:
    """The seed worker ``worker`` of command ``launch`` takes, recorded as taken by ``who``; ``say``
    is told when it is not :func:`sampler_seed`'s."""
    study_id = storage.get_study_id_from_name(study)
    used = seeds_used(storage.get_study_system_attrs(study_id))
    first = candidate = sampler_seed(seed, worker=worker, prior_trials=prior_trials)
    attempt = 0
    while candidate in used:
        candidate = drawn_seed(seed, launch, worker, attempt)
        attempt += 1
    storage.set_study_system_attr(study_id, f"{SEED_ATTR_PREFIX}{candidate}", {**who, "worker": worker})
    if candidate != first and say is not None:
        taken = used[first]
        by = f" (by process {taken.get('pid')})" if isinstance(taken, Mapping) and taken.get("pid") else ""
        say(f"worker {worker}: sampler seed {candidate}, since seed {first} was taken by an earlier worker of "
            f"the study{by}: a seed proposes what it proposed before")
    return candidate
