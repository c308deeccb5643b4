"""The torch side the engine drives: the torch driver, the per-batch body, the checkpoint store,
and the small built-in data sets and models the examples use."""

from pipeline.training.batch import BatchBody, StepActions
from pipeline.training.driver import TorchDriver

__all__ = ["BatchBody", "StepActions", "TorchDriver"]
