"""Does a Trainer hold what its checkpoint was trained with (classes, parameter groups, tensor names and
shapes)? A ``Trainer(resume_from=...)`` with other objects is refused in one line before anything loads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["mismatches", "object_classes"]

# Added to a parameter group by a scheduler, not by the optimizer: the scheduler's own comparison covers it.
_SCHEDULER_KEYS = frozenset({"initial_lr"})


def _class_of(obj: Any) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _short(name: str | None) -> str:
    return "none" if name is None else name.rsplit(".", 1)[-1]


def object_classes(model: Any, optimizer: Any, scheduler: Any) -> dict[str, str | None]:
    """What a checkpoint records of the objects it was written from."""
    return {"model": _class_of(model), "optimizer": _class_of(optimizer), "scheduler": _class_of(scheduler)}


def mismatches(state: Mapping[str, Any], model: nn.Module, optimizer: Any, scheduler: Any) -> list[str]:
    """What in ``model``, ``optimizer`` and ``scheduler`` differs from the checkpoint ``state``'s."""
    classes = state.get("classes") if isinstance(state.get("classes"), Mapping) else None
    return [*_optimizer(state.get("optimizer"), optimizer, classes), *_scheduler(state, scheduler, classes),
            *_model(state.get("model"), model)]


def _optimizer(saved: Any, optimizer: Any, classes: Mapping[str, Any] | None) -> list[str]:
    if optimizer is None or not isinstance(saved, Mapping):
        return []
    if classes is not None and _short(classes.get("optimizer")) != _short(_class_of(optimizer)):
        return [f"optimizer: the run was trained with {_short(classes.get('optimizer'))}, this Trainer has "
                f"{_short(_class_of(optimizer))}"]
    named = getattr(optimizer, "optimizers", None)  # several, by name (NamedOptimizers)
    if isinstance(named, Mapping):
        theirs_named = saved.get("optimizers") or {}
        if set(theirs_named) != set(named):
            return [f"optimizer: the run was trained with optimizers {sorted(theirs_named)}, this Trainer has "
                    f"{sorted(named)}"]
        return [f"{out} (optimizer {name!r})" for name, opt in named.items()
                for out in _optimizer(theirs_named[name], opt, None)]
    ours = optimizer.state_dict()["param_groups"]
    theirs = saved.get("param_groups") or []
    if len(ours) != len(theirs):
        return [f"optimizer: the run was trained with {len(theirs)} parameter group(s), this Trainer has {len(ours)}"]
    out: list[str] = []
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if len(a.get("params", ())) != len(b.get("params", ())):
            out.append(f"optimizer: parameter group {i} held {len(a.get('params', ()))} tensors, this one holds "
                       f"{len(b.get('params', ()))}")
        keys_a, keys_b = set(a) - {"params"} - _SCHEDULER_KEYS, set(b) - {"params"} - _SCHEDULER_KEYS
        if classes is None and keys_a != keys_b:
            out.append(f"optimizer: the run's has hyper-parameters {sorted(keys_a - keys_b)} that this "
                       f"{_short(_class_of(optimizer))} lacks (and {sorted(keys_b - keys_a)} it does not): "
                       "another optimizer class")
    return out


def _scheduler(state: Mapping[str, Any], scheduler: Any, classes: Mapping[str, Any] | None) -> list[str]:
    saved = state.get("scheduler")
    here = _class_of(scheduler) if scheduler is not None and hasattr(scheduler, "state_dict") else None
    if classes is not None:
        there = classes.get("scheduler")
        if (there is None) != (scheduler is None) or _short(there) != _short(_class_of(scheduler)):
            return [f"scheduler: the run was trained with {_short(there)}, this Trainer has "
                    f"{_short(_class_of(scheduler))}"]
        return []
    if (saved is None) != (here is None):
        return [f"scheduler: the run was trained {'without one' if saved is None else 'with one'}, this Trainer "
                f"has {_short(here)}"]
    if isinstance(saved, Mapping) and here is not None and set(saved) != set(scheduler.state_dict()):
        return [f"scheduler: its state holds {sorted(saved)}, this {_short(here)}'s holds "
                f"{sorted(scheduler.state_dict())}: another scheduler class"]
    return []


def _model(saved: Any, model: nn.Module) -> list[str]:
    if not isinstance(saved, Mapping):
        return []
    ours = model.state_dict()
    shapes = [f"{k} {tuple(saved[k].shape)} -> {tuple(ours[k].shape)}" for k in saved
              if k in ours and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(ours[k].shape)]
    found = [("lacks {} tensor(s) of the run's", [k for k in saved if k not in ours]),
             ("has {} tensor(s) the run's did not", [k for k in ours if k not in saved]),
             ("{} tensor(s) changed shape", shapes)]
    return [f"model: {what.format(len(names))} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for what, names in found if names]
