"""Blame a constructor's rejection on the config leaf that caused it (``optimizer_config.lr``): the
key without which the constructor accepts the rest."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fsmtrain.app.config.problems import ConfigError, ConfigProblem
from fsmtrain.app.config.schema import RunConfig

__all__ = ["blamed", "built_from"]


def blamed(cfg: RunConfig, section: str, what: str, build: Callable[[Mapping[str, Any]], Any],
           kwargs: Mapping[str, Any], target: str | None = None) -> Any:
    """``build(kwargs)``; a rejection becomes a ConfigError at ``section.<leaf>``, or at ``target``
    (the key naming the constructor) when there were no kwargs."""
    try:
        return build(kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # a constructor's own check, whatever it raises
        leaf = _culprit(kwargs, build, exc)
        why = f"{type(exc).__name__}: {exc}".strip()
        if not kwargs and target is not None:
            problem = ConfigProblem(target, f"{what} to build with no arguments (the config gives it none in "
                                    f"{section})", f"{what}() raised {why}")
        elif leaf is None:
            problem = ConfigProblem(section, f"arguments {what} accepts", why)
        else:
            problem = ConfigProblem(f"{section}.{leaf}", f"a value {what} accepts", f"{kwargs[leaf]!r} ({why})")
        raise ConfigError([problem], cfg.source_of(problem.path)) from exc


def _culprit(kwargs: Mapping[str, Any], build: Callable[[Mapping[str, Any]], Any], exc: Exception) -> str | None:
    for key in kwargs:
        try:
            build({k: v for k, v in kwargs.items() if k != key})
        except Exception:
            continue
        return key
    text = str(exc)
    return next((key for key in kwargs if key in text), None)


def built_from(cfg: RunConfig, section: str, what: str, build: Callable[[RunConfig], Any],
               target: str | None = None) -> Any:
    """``build(cfg)`` with the kwargs of ``section`` (``optimizer_config``), blamed as :func:`blamed` does."""
    return blamed(cfg, section, what, lambda kw: build(cfg.model_copy(update={section: dict(kw)})),
                  getattr(cfg, section), target)
