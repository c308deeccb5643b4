"""Callbacks: the base class and the built-ins (one module each; they import only the core)."""

from callbacks.checkpoint import CheckpointCallback
from callbacks.early_stopping import EarlyStoppingCallback
from callbacks.epoch_summary import EpochSummaryCallback
from callbacks.gradient_accumulation import GradientAccumulationCallback
from callbacks.gradient_clipping import GradientClippingCallback
from callbacks.gradient_monitor import GradientMonitorCallback
from callbacks.loss_prediction import LossPredictionCallback
from callbacks.lr_scheduler import LRSchedulerCallback
from callbacks.metrics_csv import MetricsCsvCallback
from callbacks.nan_detection import NaNDetectionCallback
from callbacks.optimizer_mode import OptimizerModeCallback
from callbacks.overfit_detection import OverfitDetectionCallback
from callbacks.progress_bar import ProgressBarCallback
from callbacks.pruner import PrunerCallback, TrialEndedElsewhere
from callbacks.tensorboard_logging import TensorBoardLoggingCallback
from callbacks.wandb_logging import WandbLoggingCallback
from pipeline.core.hooks import ReplaySupport, Tier, TrainingCallback

__all__ = [
    "CheckpointCallback",
    "EarlyStoppingCallback",
    "EpochSummaryCallback",
    "GradientAccumulationCallback",
    "GradientClippingCallback",
    "GradientMonitorCallback",
    "LRSchedulerCallback",
    "LossPredictionCallback",
    "MetricsCsvCallback",
    "NaNDetectionCallback",
    "OptimizerModeCallback",
    "OverfitDetectionCallback",
    "PrunerCallback",
    "ProgressBarCallback",
    "ReplaySupport",
    "TensorBoardLoggingCallback",
    "Tier",
    "TrainingCallback",
    "TrialEndedElsewhere",
    "WandbLoggingCallback",
]
