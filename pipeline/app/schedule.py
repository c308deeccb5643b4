"""Resume keeps the schedule: extending a run past a scheduler horizon its epochs set (a cosine's
``T_max``) is refused unless the horizon is re-planned, which continues as if planned so from the start."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsmtrain.app.config import ConfigError, ConfigProblem, RunConfig, build_optimizer, build_scheduler
from fsmtrain.training.resume import Resumption

__all__ = ["HORIZONS", "Replan", "replan_schedule", "resume_schedule"]

# Schedulers with a horizon (torch.optim.lr_scheduler class name -> the scheduler_config keys that set it).
HORIZONS: Mapping[str, tuple[str, ...]] = {
    "CosineAnnealingLR": ("T_max",),
    "OneCycleLR": ("total_steps", "epochs"),
    "LinearLR": ("total_iters",),
    "PolynomialLR": ("total_iters",),
    "ConstantLR": ("total_iters",),
}
# What a scheduler changes in an optimizer's param group besides the lr (OneCycle cycles momentum).
_SCHEDULED = ("lr", "initial_lr", "momentum", "betas", "max_lr", "min_lr", "max_momentum", "base_momentum")


@dataclass(frozen=True)
class Replan:
    """A horizon the resume changes: ``scheduler_config.<key>`` from ``before`` to ``after``."""

    key: str
    before: Any
    after: Any

    @property
    def path(self) -> str:
        return f"scheduler_config.{self.key}"


def _horizon_key(resolved: Mapping[str, Any]) -> str | None:
    scheduler = resolved.get("scheduler")
    if not isinstance(scheduler, str):
        return None
    keys = HORIZONS.get(scheduler.rsplit(".", 1)[-1], ())
    config = resolved.get("scheduler_config") or {}
    return next((k for k in keys if k in config), None)


def resume_schedule(before: Mapping[str, Any], after: Mapping[str, Any], where: str,
                    source: str | None = None) -> Replan | None:
    """A horizon changed from ``before`` to ``after`` (to re-plan), or a ConfigError for an extension
    past a horizon the epochs set; ``where`` is the resuming command, ``source`` the new epochs'."""
    if before.get("scheduler") != after.get("scheduler"):
        return None  # another scheduler is a training change, refused with the others
    key = _horizon_key(before)
    if key is None:
        return None
    horizon, new = (before.get("scheduler_config") or {}).get(key), (after.get("scheduler_config") or {}).get(key)
    if horizon != new:
        return Replan(key, horizon, new)
    planned, epochs = before.get("epochs"), after.get("epochs")
    if isinstance(epochs, int) and isinstance(planned, int) and epochs > planned and horizon == planned:
        raise ConfigError([ConfigProblem(
            f"scheduler_config.{key}", f"a horizon that covers the {epochs} epochs, or no extension",
            f"{horizon}, the {planned} epochs the run was planned for: epochs {planned + 1}-{epochs} would run "
            f"{after['scheduler']} past its end (from the end of the schedule the lr goes back up); re-plan it: "
            f"{where} --set epochs={epochs} --set scheduler_config.{key}={epochs} (the new lr of every epoch is "
            f"shown), or keep epochs={planned}")], source)
    return None


def _lr_curve(cfg: RunConfig, steps: int) -> tuple[dict[str, Any], list[dict[str, Any]], list[tuple[int, float]]]:
    """``cfg``'s schedule on a stand-in parameter: scheduler state and param groups after ``steps``
    epochs, and the lr of each epoch after them."""
    import torch
    optimizer = build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])
    scheduler = build_scheduler(cfg, optimizer)
    curve: list[tuple[int, float]] = []
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    with warnings.catch_warnings():  # the stand-in's optimizer steps with no gradient: nothing to warn of
        warnings.simplefilter("ignore")
        for epoch in range(cfg.epochs if cfg.epochs is not None else steps + 1):
            if epoch == steps:
                state = scheduler.state_dict()
                groups = [{k: v for k, v in g.items() if k in _SCHEDULED} for g in optimizer.param_groups]
            if epoch >= steps:
                curve.append((epoch + 1, float(optimizer.param_groups[0]["lr"])))
            optimizer.step()
            scheduler.step()
    return state, groups, curve


def replan_schedule(cfg: RunConfig, resumption: Resumption, replan: Replan) -> None:
    """Set the checkpoint's scheduler and lr to the re-planned schedule, and have the resume say so."""
    state = resumption.state
    recorded = state.get("scheduler") or {}
    steps = int(recorded.get("last_epoch", resumption.next_epoch))
    sched_state, groups, curve = _lr_curve(cfg, steps)
    if not sched_state:  # resumed at or past the new horizon's last epoch: nothing left to plan
        return
    state["scheduler"] = sched_state
    for target, planned in zip((state.get("optimizer") or {}).get("param_groups", []), groups, strict=False):
        target.update(planned)
    shown = ", ".join(f"{epoch} {lr:.2e}" for epoch, lr in curve)
    resumption.notices.append(("schedule_replanned", {
        "message": f"{replan.path} re-planned from {replan.before} to {replan.after}: the schedule continues as if "
                   f"the run had been planned for it from the start (the {steps} epoch(s) trained keep their lr); "
                   f"lr by epoch: {shown}",
        "key": replan.path, "before": replan.before, "after": replan.after,
    }))  # the exact lr of every epoch is in its `epoch` event, as always
