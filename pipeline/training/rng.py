"""The RNG states (Python, numpy, torch, CUDA) for a checkpoint, as tensors and plain values so that
``torch.load(weights_only=True)`` accepts them."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and CUDA when present) RNG states as tensors / lists of ints."""
    version, internal, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    return {
        # one tensor, not 625 ints: each pickled object costs torch.save a persistent_id call
        "python": {"version": int(version), "state": torch.from_numpy(np.array(internal, dtype=np.int64)),
                   "gauss_next": gauss_next},
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (used by resume)."""
    py = state["python"]
    internal = py["state"].tolist() if isinstance(py["state"], torch.Tensor) else py["state"]
    random.setstate((py["version"], tuple(int(v) for v in internal), py["gauss_next"]))
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
