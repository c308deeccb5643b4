"""The torch side the engine drives: the driver, checkpoints and resume, signals, distributed runs,
precision, and the small data sets and models the examples use."""

from fsmtrain.training.driver import TorchDriver
from fsmtrain.training.optimizers import NamedOptimizers, NamedSchedulers, manual_step
from fsmtrain.training.step import StepFn

__all__ = ["NamedOptimizers", "NamedSchedulers", "StepFn", "TorchDriver", "manual_step"]
