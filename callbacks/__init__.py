"""Callbacks: the base class and the built-ins (one module each; they import only the core)."""

from fsmtrain.callbacks.checkpoint import CheckpointCallback
from fsmtrain.callbacks.early_stopping import EarlyStoppingCallback
from fsmtrain.callbacks.epoch_summary import EpochSummaryCallback
from fsmtrain.callbacks.gradient_accumulation import GradientAccumulationCallback
from fsmtrain.callbacks.gradient_clipping import GradientClippingCallback
from fsmtrain.callbacks.gradient_monitor import GradientMonitorCallback
from fsmtrain.callbacks.loss_prediction import LossPredictionCallback
from fsmtrain.callbacks.lr_scheduler import LRSchedulerCallback
from fsmtrain.callbacks.metrics_csv import MetricsCsvCallback
from fsmtrain.callbacks.nan_detection import NaNDetectionCallback
from fsmtrain.callbacks.optimizer_mode import OptimizerModeCallback
from fsmtrain.callbacks.overfit_detection import OverfitDetectionCallback
from fsmtrain.callbacks.progress_bar import ProgressBarCallback
from fsmtrain.callbacks.pruner import PrunerCallback, TrialEndedElsewhere
from fsmtrain.callbacks.step_log import StepLogCallback
from fsmtrain.callbacks.tensorboard_logging import TensorBoardLoggingCallback
from fsmtrain.callbacks.wandb_logging import WandbLoggingCallback
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback

__all__ = [
    "CheckpointCallback", "EarlyStoppingCallback", "EpochSummaryCallback", "GradientAccumulationCallback",
    "GradientClippingCallback", "GradientMonitorCallback", "LRSchedulerCallback", "LossPredictionCallback",
    "MetricsCsvCallback", "NaNDetectionCallback", "OptimizerModeCallback", "OverfitDetectionCallback",
    "PrunerCallback", "ProgressBarCallback", "ReplaySupport", "StepLogCallback", "TensorBoardLoggingCallback",
    "Tier", "TrainingCallback", "TrialEndedElsewhere", "WandbLoggingCallback",
]
