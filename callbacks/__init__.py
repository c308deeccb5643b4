"""Callbacks: the base class and the built-ins."""

from pipeline.hooks import ReplaySupport, Tier, TrainingCallback

__all__ = ["ReplaySupport", "Tier", "TrainingCallback"]
