"""Sampler seeds no two workers of a study share.

A seeded sampler in a worker proposes what the same seed proposed before: a replacement worker
given the dead worker's seed proposes that worker's trials again. So every seed a worker of the
study took is kept in the study's system attributes (``fsmtrain:sampler_seed:<seed>``, one key a
seed, so workers that claim at once never overwrite each other's), and a worker takes the seed
:func:`fsmtrain.app.config.optimize.sampler_seed` gives it, unless an earlier worker took it:
then one drawn from its command's launch id, its index and the attempt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsmtrain.app.config.optimize import sampler_seed

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


def _drawn(seed: int, launch: str, worker: int, attempt: int) -> int:
    digest = hashlib.sha256(f"fsmtrain-sampler-seed:{seed}:{launch}:{worker}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "little")  # numpy's RandomState takes seeds below 2**32


def claim_sampler_seed(storage: BaseStorage, study: str, seed: int, *, worker: int, launch: str,
                       prior_trials: int, who: Mapping[str, Any],
                       say: Callable[[str], None] | None = None) -> int:
    """The seed worker ``worker`` of command ``launch`` takes, recorded as taken by ``who``;
    ``say`` is told when it is not the one :func:`sampler_seed` gives (an earlier worker took that)."""
    study_id = storage.get_study_id_from_name(study)
    used = seeds_used(storage.get_study_system_attrs(study_id))
    first = candidate = sampler_seed(seed, worker=worker, prior_trials=prior_trials)
    attempt = 0
    while candidate in used:
        candidate = _drawn(seed, launch, worker, attempt)
        attempt += 1
    storage.set_study_system_attr(study_id, f"{SEED_ATTR_PREFIX}{candidate}", {**who, "worker": worker})
    if candidate != first and say is not None:
        taken = used[first]
        by = f" (by process {taken.get('pid')})" if isinstance(taken, Mapping) and taken.get("pid") else ""
        say(f"worker {worker}: sampler seed {candidate}, since seed {first} was taken by an earlier worker of "
            f"the study{by}: a seed proposes what it proposed before")
    return candidate
