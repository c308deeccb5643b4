"""The torch side the engine drives: the torch driver (the actions of the lifecycle program), the
checkpoint store, and the small built-in data sets and models the examples use."""

from fsmtrain.training.driver import TorchDriver

__all__ = ["TorchDriver"]
