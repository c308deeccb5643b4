"""What one optimizer step sees, in words, from ``run_start``'s ``global_batch`` (torch-free, for the report)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["describe_global_batch"]


def describe_global_batch(batch: Mapping[str, Any] | None) -> str | None:
    """``128 (64 per rank x 2 ranks x 1 accumulation step)``, from ``run_start``'s ``global_batch``."""
    if batch is None or not all(type(batch.get(k)) is int for k in ("global", "per_rank", "ranks", "accumulation")):
        return None
    steps = batch["accumulation"]
    return (f"{batch['global']} ({batch['per_rank']} per rank x {batch['ranks']} rank(s) x {steps} accumulation "
            f"step{'' if steps == 1 else 's'})")
