import ast
import inspect
from pathlib import Path

from fsmtrain import callbacks
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback

PACKAGE = Path(callbacks.__file__).parent

EXPECTED = {
    "NaNDetectionCallback": 5, "OptimizerModeCallback": 10, "GradientMonitorCallback": 12,
    "LossPredictionCallback": 70, "OverfitDetectionCallback": 75, "WandbLoggingCallback": 80, "PrunerCallback": 85,
    "EarlyStoppingCallback": 90, "CheckpointCallback": 95,
}


def test_modules_import_only_the_core():
    for path in PACKAGE.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("fsmtrain.callbacks"), f"{path.name} imports {node.module}"
                if node.module.startswith("fsmtrain."):
                    assert node.module.startswith("fsmtrain.core.") or node.module in (
                        "fsmtrain.training.checkpoint", "fsmtrain.training.sharding", "fsmtrain.training.optimizers"), (
                        f"{path.name} imports {node.module}: callbacks use the core, the checkpoint store, the "
                        "sharded-tensor helpers and the named optimizers only")


def test_exports_priorities_and_tier():
    for name, priority in EXPECTED.items():
        cls = getattr(callbacks, name)
        assert issubclass(cls, TrainingCallback) and cls.priority == priority and cls.tier is Tier.CORE
    assert callbacks.TrainingCallback is TrainingCallback
    exported = {n for n, v in vars(callbacks).items() if inspect.isclass(v) and issubclass(v, TrainingCallback)}
    assert exported >= set(EXPECTED) | {"LRSchedulerCallback", "GradientClippingCallback",
                                        "GradientAccumulationCallback", "ProgressBarCallback", "EpochSummaryCallback"}


def test_replay_support_declared():
    # model-bound callbacks only record intent in a replay (fsmtrain.tools.replay feeds recorded slot values)
    dry = {"OptimizerModeCallback", "GradientMonitorCallback", "WandbLoggingCallback", "CheckpointCallback"}
    for name in EXPECTED:
        expected = ReplaySupport.DRY if name in dry else ReplaySupport.FULL
        assert getattr(callbacks, name).replay is expected, name
