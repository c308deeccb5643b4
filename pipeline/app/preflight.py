"""``fsmtrain preflight``: build everything a config names and run one training step on one batch. A
failing stage is one message (for a forward, the innermost module and its input shapes), exit 4; a first
batch that breaks the batch contract is a ConfigError (exit 2), here and in ``validate --data``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO, TypeVar

import torch
from torch import nn

from fsmtrain.app.config import RunConfig
from fsmtrain.app.config.checks import batches, checked_callbacks
from fsmtrain.app.config.problems import ConfigError, ConfigProblem
from fsmtrain.app.defaults import console_callbacks
from fsmtrain.app.job import RunParts, build_parts
from fsmtrain.core.runner import CallbackRunner
from fsmtrain.training.driver import split_batch
from fsmtrain.training.optimizers import is_manual, optimizers_of
from fsmtrain.training.step import step_name, step_result, to_device

__all__ = ["BATCH_CONTRACT", "PreflightFailed", "check_first_batch", "run_preflight", "shape_of"]

T = TypeVar("T")

BATCH_CONTRACT = ("batches that are (inputs, targets) or a mapping with 'inputs' and 'targets' (a step: of your "
                  "own takes any batch)")


class PreflightFailed(Exception):
    """One stage of the step failed; ``str()`` is the one-line report."""

    def __init__(self, stage: str, text: str) -> None:
        super().__init__(f"preflight FAILED at the {text}")
        self.stage, self.text = stage, text


def shape_of(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(shape_of(v) for v in x) + ")"
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k!r}: {shape_of(v)}" for k, v in x.items()) + "}"
    return type(x).__name__


@contextmanager
def _innermost_module(model: nn.Module, seen: list[tuple[str, nn.Module, str]]) -> Iterator[None]:
    """While the block runs, ``seen`` is the stack of modules whose forward has begun and not ended
    (name, module, input shapes): after a failure, its top is where it failed."""
    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            seen.append((name or type(model).__name__, module, ", ".join(shape_of(a) for a in args) or "no input"))
        return hook

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if seen:
            seen.pop()
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _stage(name: str, fn: Callable[[], T], detail: Callable[[], str] = lambda: "") -> T:
    try:
        return fn()
    except Exception as exc:  # torch's words, in one line, with where it happened
        where = detail()
        text = " ".join(str(exc).split())
        raise PreflightFailed(name, f"{name}{where}: {type(exc).__name__}: {text}") from None


def _batch_error(cfg: RunConfig, found: str) -> ConfigError:
    return cfg.error([ConfigProblem("data", BATCH_CONTRACT, f"{cfg.data}'s first training batch {found}")])


def _first_step(cfg: RunConfig, parts: RunParts, device: torch.device) -> tuple[Any, Any, Any, torch.Tensor]:
    """The first training batch through forward, loss and backward: inputs, targets, output, loss."""
    try:
        batch = next(iter(parts.train_loader))
    except StopIteration:
        raise _batch_error(cfg, "is missing: the training loader is empty") from None
    except Exception as exc:
        raise _batch_error(cfg, f"could not be read: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    step = parts.steps[0]
    if step is None:
        try:
            inputs, targets = split_batch(batch)
        except TypeError:
            raise _batch_error(cfg, f"is {type(batch).__name__} {shape_of(batch)}") from None
    else:  # the user's step takes the batch as it comes
        inputs, targets = batch, None
    inputs, targets = to_device(inputs, device), to_device(targets, device)
    model = parts.model.train()
    stack: list[tuple[str, nn.Module, str]] = []

    def in_module() -> str:
        if not stack:
            return f" of {cfg.net} on input {shape_of(inputs)}"
        name, module, shapes = stack[-1]
        return f" of {cfg.net}, in module {name} ({module!r}) given {shapes}".replace("\n", " ")
    manual = is_manual(step)  # it runs its own backward and optimizer steps, on the optimizers by name
    if step is not None:  # the user's step is the forward and the loss
        with _innermost_module(model, stack):
            extra = [optimizers_of(parts.optimizer)] if manual else []
            result = _stage(f"step {step_name(step)}", lambda: step(model, inputs, *extra), in_module)
        loss, output = _stage(f"step {step_name(step)}", lambda: step_result(result, step_name(step)))
        targets = output.get("target")
    else:
        with _innermost_module(model, stack):
            output = _stage("forward", lambda: model(inputs), in_module)
        loss = _stage("loss", lambda: parts.criterion(output, targets),
                      lambda: f" ({cfg.criterion}) of output {shape_of(output)} and target {shape_of(targets)}")
    if not manual:
        _stage("backward", lambda: loss.backward(), lambda: f" of the loss {shape_of(loss)}")  # type: ignore[no-untyped-call]
    return inputs, targets, output, loss


def check_first_batch(cfg: RunConfig) -> str:
    """``validate --data``: the first training batch through the step on the CPU; what was done."""
    parts = build_parts(cfg, cfg.seeds[0])
    parts.model.cpu()
    try:
        inputs, _, output, loss = _first_step(cfg, parts, torch.device("cpu"))
    except PreflightFailed as exc:
        at = "net" if exc.stage == "forward" else "step" if exc.stage.startswith("step") else "criterion"
        raise cfg.error([ConfigProblem(at, f"a {at} that takes the data's first training batch",
                                       f"the step failed at the {exc.text}")]) from None
    return (f"called the data builder (batches: train {batches(parts.train_loader)}, val {batches(parts.val_loader)}) "
            f"and ran its first training batch through the step on the CPU (input {shape_of(inputs)}, output "
            f"{shape_of(output)}, loss {float(loss.detach()):.6g})")


def run_preflight(cfg: RunConfig, out: TextIO) -> bool:
    """Print the preflight report; True when the step ran and everything is finite."""
    callbacks = checked_callbacks(cfg, extra=console_callbacks())  # train adds the console's too
    parts = build_parts(cfg, cfg.seeds[0])
    model, device = parts.model, torch.device(cfg.device)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    inputs, targets, output, loss = _first_step(cfg, parts, device)
    grads = [(n, p.grad) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, g in grads if g is None]
    bad = [n for n, g in grads if g is not None and not bool(torch.isfinite(g).all())]
    named = ", ".join(optimizers_of(parts.optimizer)) if cfg.optimizers else cfg.optimizer
    if not is_manual(parts.steps[0]):  # a manual step stepped them itself
        _stage("optimizer step", parts.optimizer.step, lambda: f" ({named})")
    parts.optimizer.zero_grad(set_to_none=True)
    after_ok = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    value = float(loss.detach())
    print(f"model      {cfg.net}: {n_params:,} parameters ({n_trainable:,} trainable) on {device}", file=out)
    val = parts.val_loader
    print(f"batches    train {batches(parts.train_loader)}, val {batches(val)} (batch_size {cfg.batch_size})",
          file=out)
    print(f"input      {shape_of(inputs)}   target {shape_of(targets)}", file=out)
    print(f"output     {shape_of(output)}", file=out)
    print(f"loss       {value:.6g} ({cfg.step or cfg.criterion})", file=out)
    print(f"gradients  {len(grads) - len(missing) - len(bad)}/{len(grads)} tensors finite"
          + (f"; non-finite: {', '.join(bad)}" if bad else "")
          + (f"; no gradient: {', '.join(missing)}" if missing else ""), file=out)
    print(f"optimizer  {named} step ok, parameters {'finite' if after_ok else 'NON-FINITE'}", file=out)
    ordered = CallbackRunner(callbacks).callbacks  # the order train runs them in
    print("callbacks  " + ", ".join(f"{cb.name}({cb.priority})" for cb in ordered), file=out)
    ok = math.isfinite(value) and not bad and after_ok
    print("preflight passed" if ok else "preflight FAILED: non-finite loss, gradients or parameters", file=out)
    return ok
