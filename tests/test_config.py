"""Config loading and validation tiers (in-process; the CLI tests drive the same code in subprocesses)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from fsmtrain.app.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    build_callbacks,
    config_from_dict,
    load_config,
    load_yaml,
    resolve_dotted,
    resolved_dict,
)

REPO = Path(__file__).resolve().parents[1]


def minimal(**extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "net": "fsmtrain.training.models.MLP",
        "net_config": {"in_features": 8, "out_features": 1},
        "data": "fsmtrain.training.data.synthetic_regression",
        "epochs": 5,
        "batch_size": 32,
    }
    data.update(extra)
    return data


def problems(data: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return {p.path: p for p in info.value.problems}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_floats_in_every_python_spelling(tmp_path: Path) -> None:
    data = load_yaml(write(tmp_path, "a: 1e-3\nb: 1.e-3\nc: 2E5\nd: -1e+2\ne: 1_000\nf: .5\n"))
    assert data == {"a": 1e-3, "b": 1e-3, "c": 2e5, "d": -100.0, "e": 1000, "f": 0.5}
    assert isinstance(data["a"], float) and isinstance(data["e"], int)


def test_duplicate_keys_are_all_reported_with_path_and_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "net: a.B\nnet: a.C\noptimizer_config:\n  lr: 1\n  lr: 2\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    by_path = {p.path: p.found for p in info.value.problems}
    assert by_path == {
        "net": "duplicate key 'net' at line 2 (first at line 1)",
        "optimizer_config.lr": "duplicate key 'lr' at line 5 (first at line 4)",
    }


def test_three_mistakes_in_one_error_with_paths_and_suggestions() -> None:
    found = problems(minimal(optimizer="torch.optim.Adamm", epochs=-1, early_stoping={"patience": 3}))
    assert set(found) == {"optimizer", "epochs", "early_stoping"}
    assert found["optimizer"].suggestion == "torch.optim.Adam"
    assert found["early_stoping"].suggestion == "early_stopping"
    assert "-1" in found["epochs"].found and "greater than 0" in found["epochs"].expected
    text = str(ConfigError(list(found.values())))
    assert "did you mean torch.optim.Adam?" in text and text.count("\n  - ") == 3


def test_nested_unknown_key_literal_and_kwarg_suggestions() -> None:
    found = problems(minimal(
        checkpoint={"mode": "mni", "keep_lats_k": 2},
        net_config={"in_features": 8, "out_features": 1, "hiden": [4]},
    ))
    assert found["checkpoint.mode"].suggestion == "min"
    assert found["checkpoint.keep_lats_k"].suggestion == "keep_last_k"
    assert found["net_config.hiden"].suggestion == "hidden"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("net", "torch.optim.Adam", "nn.Module subclass"),
        ("optimizer", "torch.nn.Linear", "Optimizer subclass"),
        ("scheduler", "torch.optim.Adam", "LR scheduler"),
        ("data", "fsmtrain.training.models.MLP", "data builder function"),
        ("criterion", "torch.optim.SGD", "a loss"),
    ],
)
def test_dotted_paths_must_be_the_right_kind(key: str, value: str, expected: str) -> None:
    found = problems(minimal(**{key: value}))
    assert expected in found[key].expected
    assert value in found[key].found


def test_missing_module_and_required_kwargs() -> None:
    found = problems(minimal(optimizer="torch.optimm.Adam", net_config={"in_features": 8}))
    assert found["optimizer"].suggestion == "torch.optim.Adam"
    assert "required argument 'out_features'" in found["net_config.out_features"].expected


def test_schema_types_ranges_and_seeds() -> None:
    found = problems(minimal(batch_size=0, seeds=[1, 1], epochs="3", device="gpu"))
    assert set(found) == {"batch_size", "seeds", "epochs", "device"}
    assert "[1] repeated" in found["seeds"].expected
    assert problems(minimal(seeds=[]))["seeds"].expected.startswith("a non-empty list")


def test_seeds_are_bounded_to_what_torch_manual_seed_accepts() -> None:
    """validate refuses a seed torch cannot take (2**64 would die in training with "Overflow when
    unpacking long long")."""
    found = problems(minimal(seeds=[2**64, 3, -(2**63) - 1]))["seeds"]
    assert found.expected == ("seeds from -2**63 to 2**64-1 (what torch.manual_seed accepts); "
                              "18446744073709551616, -9223372036854775809 outside that range")
    assert config_from_dict(minimal(seeds=[-(2**63), -1, 0, 2**64 - 1])).seeds == [-(2**63), -1, 0, 2**64 - 1]


def test_cuda_without_gpu_is_a_resolution_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert problems(minimal(device="cuda"))["device"].suggestion == "cpu"


def test_semantic_warnings_do_not_fail() -> None:
    cfg = config_from_dict(minimal(
        epochs=10, early_stopping={"patience": 10},
        scheduler="torch.optim.lr_scheduler.CosineAnnealingLR", scheduler_config={"T_max": 50},
    ))
    assert {w.path for w in cfg.warnings} == {"early_stopping.patience", "scheduler_config.T_max"}
    fine = config_from_dict(minimal(scheduler="torch.optim.lr_scheduler.CosineAnnealingLR",
                                    scheduler_config={"T_max": 5}, early_stopping={"patience": 4}))
    assert fine.warnings == []


def test_overrides_parse_yaml_scalars_and_reject_bad_input() -> None:
    out = apply_overrides(minimal(), ["optimizer_config.lr=1e-2", "seeds=[1, 2]", "scheduler=null", "name=x"])
    assert out["optimizer_config"] == {"lr": 0.01} and out["seeds"] == [1, 2] and out["scheduler"] is None
    with pytest.raises(ConfigError) as info:
        apply_overrides(minimal(), ["epochs", "net.x=1"])
    assert [p.path for p in info.value.problems] == ["epochs", "net.x"]


def test_resolved_dict_round_trips_through_yaml(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "quickstart.yaml", ["optimizer_config.lr=0.01"])
    resolved = resolved_dict(cfg)
    assert resolved["optimizer_config"]["lr"] == 0.01 and resolved["early_stopping"]["min_delta"] == 1e-4
    path = write(tmp_path, yaml.safe_dump(resolved))
    assert load_config(path) == cfg


def test_shipped_configs_validate_without_warnings() -> None:
    for name in ("quickstart.yaml", "digits.yaml"):
        cfg = load_config(REPO / "configs" / name)
        assert isinstance(cfg, RunConfig) and cfg.warnings == []


def test_pytorch_optimizer_by_dotted_path() -> None:
    cfg = config_from_dict(minimal(optimizer="pytorch_optimizer.SPlus", optimizer_config={"lr": 1e-3}))
    assert cfg.optimizer == "pytorch_optimizer.SPlus"
    with pytest.raises(ConfigError, match=r"pytorch_optimizer\.SPlus"):
        config_from_dict(minimal(optimizer="pytorch_optimizer.SPluss"))


def test_default_callbacks_follow_the_config(tmp_path: Path) -> None:
    cfg = config_from_dict(minimal(
        wandb={"enabled": True}, grad_clip={"max_norm": 1.0}, grad_accumulation=2,
        callbacks={"gradient_monitor": {"warn_threshold": 5.0}, "overfit_detection": {"window_size": 2},
                   "extra": [{"target": "fsmtrain.callbacks.EpochSummaryCallback", "kwargs": {"every_n_epochs": 2}}]},
    ))
    names = [cb.name for cb in build_callbacks(cfg, run_dir=tmp_path)]
    assert names == [
        "NaNDetectionCallback", "OptimizerModeCallback", "GradientMonitorCallback", "LossPredictionCallback",
        "OverfitDetectionCallback", "WandbLoggingCallback", "EarlyStoppingCallback", "MetricsCsvCallback",
        "CheckpointCallback", "GradientClippingCallback", "GradientAccumulationCallback", "EpochSummaryCallback",
    ]
    off = config_from_dict(minimal(early_stopping={"enabled": False}, checkpoint={"enabled": False},
                                   callbacks={"loss_prediction": {"enabled": False}}))
    names = [cb.name for cb in build_callbacks(off, run_dir=tmp_path)]
    assert "EarlyStoppingCallback" not in names and "CheckpointCallback" not in names
    assert "LossPredictionCallback" not in names and "WandbLoggingCallback" not in names
    bad = problems(minimal(callbacks={"extra": [{"target": "fsmtrain.training.models.MLP"}]}))
    assert "TrainingCallback subclass" in bad["callbacks.extra.0.target"].expected


def test_resolve_dotted_raises_config_error() -> None:
    assert resolve_dotted("torch.optim.Adam").__name__ == "Adam"
    with pytest.raises(ConfigError, match=r"did you mean torch\.optim\.Adam"):
        resolve_dotted("torch.optim.Adamm")


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "syntax.yaml"
    bad.write_text("epochs: 3\nnet: a: b\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert "expected valid YAML" in message and "at line 2, column 7" in message
    assert "^" not in message  # PyYAML's source snippet is not pasted into the one-line problem


@pytest.mark.parametrize("name", ["val_loss", "train_loss", "lr"])
def test_a_metric_named_like_a_builtin_one_is_refused(name: str) -> None:
    """A user metric may not take a built-in name: `metrics: {val_loss: ...accuracy}` would have early
    stopping, the best checkpoint and the objective all minimise accuracy."""
    accuracy = "fsmtrain.training.models.accuracy"
    found = problems(minimal(metrics={name: accuracy, "acc": accuracy}))
    assert set(found) == {"metrics"}
    assert f"{name} would replace fsmtrain's own" in found["metrics"].expected
    config_from_dict(minimal(metrics={"val_accuracy": accuracy}))  # any other name is fine


def test_a_loss_function_takes_output_and_target_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss function (the README says "loss class or function") gets output and target from fsmtrain:
    criterion_config supplies only its other arguments, checked by name."""
    (tmp_path / "mylosses.py").write_text(
        "def scaled(output, target, scale):\n    return scale * ((output - target) ** 2).mean()\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # a user's function is imported, torch's read from source
    config_from_dict(minimal(criterion="torch.nn.functional.mse_loss"))
    config_from_dict(minimal(criterion="torch.nn.functional.huber_loss", criterion_config={"delta": 0.5}))
    config_from_dict(minimal(criterion="mylosses.scaled", criterion_config={"scale": 2.0}))
    found = problems(minimal(criterion="torch.nn.functional.huber_loss", criterion_config={"dlta": 0.5}))
    assert found["criterion_config.dlta"].suggestion == "delta"
    found = problems(minimal(criterion="mylosses.scaled"))
    assert set(found) == {"criterion_config.scale"}  # output and target are fsmtrain's to pass


def test_the_default_patience_warns_on_a_short_run() -> None:
    """The default patience (20) on a 5-epoch config can never fire: one warning names both values."""
    cfg = config_from_dict(minimal())
    said = [str(w) for w in cfg.warnings if w.path == "early_stopping.patience"]
    assert said == ["early_stopping.patience: expected patience < epochs (5) for early stopping to ever fire; "
                    "found 20 (the default)"], said
    assert config_from_dict(minimal(early_stopping={"enabled": False})).warnings == []
