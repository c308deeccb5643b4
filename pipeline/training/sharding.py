"""FSDP2 sharding of one rank's model (``distributed.strategy: fsdp``); the full state is gathered (rank 0
holds it, on the CPU) for ``model.pt``; checkpoints hold each rank's shards (DCP), and load back on any
number of ranks, resharded."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsmtrain.core.hooks import TrainingCallback

if TYPE_CHECKING:
    from torch.distributed.fsdp import OffloadPolicy

    from fsmtrain.training.distributed import TorchCollective

__all__ = ["AUTO_SHARE", "FsdpOptions", "Sharding", "checkpoint_states", "full_state", "gathered_weights",
           "global_norm", "is_sharded", "is_sharded_tensor", "load_shards", "load_states",
           "no_gradient_sync", "save_shards", "shard_model", "sharding_line", "unshardable", "writers_group"]

AUTO_SHARE = 0.1  # ``shard: auto``: a unit is a module holding at least this share of the parameters
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}


@dataclass(frozen=True)
class FsdpOptions:
    """The config's ``distributed.fsdp`` section."""

    shard: str | Sequence[str] = "auto"  # "auto" or module class names
    reshard_after_forward: bool = True
    param_dtype: str | None = None  # bf16 | fp16 | fp32
    reduce_dtype: str | None = None
    cpu_offload: bool = False


@dataclass
class Sharding:
    """What was sharded: the units (dotted names, "" the root) and each rank's parameter bytes."""

    units: list[str] = field(default_factory=list)
    bytes_per_rank: int = 0
    bytes_total: int = 0

    def record(self) -> dict[str, Any]:
        return {"units": self.units, "bytes_per_rank": self.bytes_per_rank, "bytes_total": self.bytes_total}

    def line(self, world: int) -> str:
        shown = ", ".join(u or "(root)" for u in self.units)
        return (f"FSDP2 over {world} ranks: {len(self.units)} unit(s) sharded ({shown}); parameters "
                f"{self.bytes_total / 2**20:.2f} MiB in all, {self.bytes_per_rank / 2**20:.2f} MiB on this rank")


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _auto_units(model: nn.Module, total: int) -> list[str]:
    """Top down: a child holding ``AUTO_SHARE`` of the parameters is a unit, unless a container (then its children)."""
    units: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        own = _count(module)
        for name, child in module.named_children():
            n = _count(child)
            if n < AUTO_SHARE * total:
                continue
            path = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or (n == own and any(child.children())):
                walk(child, path + ".")
            else:
                units.append(path)
    walk(model, "")
    return units


def _named_units(model: nn.Module, classes: Sequence[str]) -> list[str]:
    found = [name for name, m in model.named_modules() if name and type(m).__name__ in classes]
    missing = sorted(set(classes) - {type(m).__name__ for _, m in model.named_modules()})
    if missing:
        raise ValueError(f"distributed.fsdp.shard names {', '.join(missing)}, which the model "
                         f"({type(model).__name__}) does not hold; expected its module class names, or 'auto'")
    return [n for n in found if not any(n.startswith(o + ".") for o in found if o != n)]  # outermost only


def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer | None, options: FsdpOptions,
                device: torch.device | None = None) -> Sharding:
    """``fully_shard`` each unit, then the root, in place; the optimizer's groups then hold the sharded
    parameters. A model on the meta device gets its shards on ``device``, initialised by ``reset_parameters``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    before = dict(model.named_parameters())
    total = sum(p.numel() for p in before.values())
    units = _auto_units(model, total) if options.shard == "auto" else _named_units(model, list(options.shard))
    offload: OffloadPolicy = CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy()
    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[options.param_dtype], reduce_dtype=_DTYPES[options.reduce_dtype])
    kwargs: dict[str, Any] = {"reshard_after_forward": options.reshard_after_forward, "mp_policy": policy,
                              "offload_policy": offload}
    for name in units:
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    if torch.distributed.is_initialized():  # every rank, in the same order
        _WRITERS[model] = torch.distributed.new_group(backend="gloo")
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device or torch.device("cpu"))
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    after = dict(model.named_parameters())
    if optimizer is not None:
        moved = {id(before[name]): after[name] for name in before}
        for group in optimizer.param_groups:
            group["params"] = [moved[id(p)] for p in group["params"]]
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in after.values())
    return Sharding([*units, ""], local, sum(p.numel() * p.element_size() for p in before.values()))


def is_sharded(model: Any) -> bool:
    """``model`` is FSDP2's (never true before ``torch.distributed.fsdp`` was imported: no import cost)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def is_sharded_tensor(tensor: Any) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``tensors``; of FSDP2 shards, the local squares summed over the ranks."""
    if not tensors or not is_sharded_tensor(tensors[0]):
        return torch.nn.utils.get_total_norm(tensors, 2.0)
    shards: list[Any] = list(tensors)
    local = torch.stack([torch.linalg.vector_norm(t.to_local(), 2.0) for t in shards]).square().sum()
    torch.distributed.all_reduce(local, group=shards[0].device_mesh.get_group())
    return local.sqrt()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
    """The whole model's and optimizer's state, gathered (every rank calls it; rank 0 holds them, on the CPU)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=full)
    optim_sd = None if optimizer is None else get_optimizer_state_dict(model, optimizer, options=full)
    return model_sd, optim_sd


@contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync``: an accumulating backward keeps its gradients unreduced."""
    assert is_sharded(model)
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def unshardable(callbacks: Sequence[TrainingCallback]) -> list[str]:
    """The callbacks (by name) that need the whole parameters or gradients on one rank: refused under FSDP."""
    refused = [cb.name for cb in callbacks if not cb.works_sharded]
    return refused + [f"{cb.name}'s checkpoints by the clock (every_minutes: each rank's clock would decide apart, "
                      "and every rank writes each sharded checkpoint)" for cb in callbacks
                      if getattr(cb, "every_seconds", None)]


_WRITERS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()  # a sharded model's writers'


def writers_group(model: nn.Module | None) -> Any:
    """The process group the checkpoint writer threads of ``model``'s ranks use (their collectives, never the
    training thread's); it lives as long as the model. None: a single process."""
    return None if model is None else _WRITERS.get(model)


def checkpoint_states(model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
                      by_name: bool = False) -> tuple[Any, Any]:
    """The model's and optimizer's state a checkpoint holds (a sharded model's, or ``by_name``: as DCP saves
    them, keyed by parameter name; a sharded model's this rank's shards)."""
    if model is not None and (by_name or is_sharded(model)):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        return get_model_state_dict(model), None if optimizer is None else get_optimizer_state_dict(model, optimizer)
    return (None if model is None else model.state_dict()), (None if optimizer is None else optimizer.state_dict())


def save_shards(folder: Path, state: dict[str, Any], group: Any) -> None:
    """Every rank writes its shards of ``state`` into ``folder`` (DCP; rank 0 adds ``.metadata``), through the
    writers' own process group: a writer thread's collectives never meet the training thread's."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save
    save(state, storage_writer=FileSystemWriter(folder), process_group=group, no_dist=group is None)


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer | None, folder: Path) -> None:
    """A sharded checkpoint into ``model`` (sharded on any number of ranks, or plain): DCP reshards on load."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load
    model_sd, optim_sd = get_state_dict(model, [] if optimizer is None else [optimizer])
    reader, named = FileSystemReader(folder), dict(model.named_parameters())
    saved = reader.read_metadata().state_dict_metadata
    grads = {n: torch.zeros_like(p) for n, p in named.items() if f"grads.{n}" in saved}  # a step's, accumulating
    state: dict[str, Any] = {"model": model_sd, **({"optimizer": optim_sd} if optimizer is not None else {}),
                             **({"grads": grads} if grads else {})}
    load(state, storage_reader=reader, no_dist=not torch.distributed.is_initialized())
    set_state_dict(model, [] if optimizer is None else [optimizer], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
    for n, grad in grads.items():
        named[n].grad = grad


def load_states(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: Any, optim_sd: Any) -> None:
    """Load a checkpoint's full states into a sharded or a plain model, its optimizer's keyed by name or index;
    a sharded model's rank keeps its own shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    by_name = optim_sd is not None and any(isinstance(k, str) for k in optim_sd.get("state", {}))
    if not is_sharded(model) and not by_name:
        model.load_state_dict(model_sd)
        if optimizer is not None and optim_sd is not None:
            optimizer.load_state_dict(optim_sd)
        return
    if optim_sd is not None and not by_name:  # a plain run's, by index: the optimizer's own order names them
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in (optimizer.param_groups if optimizer is not None else ()) for p in g["params"]]
        groups = [{**g, "params": [order[i] for i in g["params"]]} for g in optim_sd["param_groups"]]
        optim_sd = {"state": {order[i]: v for i, v in optim_sd["state"].items()}, "param_groups": groups}
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, dict(model_sd), options=options)
    if optimizer is not None and optim_sd is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=options)


def sharding_line(sharding: Sharding | None, strategy: str, world: int) -> str | None:
    """What the console says of a run's sharding (None: a DDP run)."""
    if sharding is not None:
        return sharding.line(world)
    return "strategy fsdp on one process: nothing to shard, the model trains whole" if strategy == "fsdp" else None


def gathered_weights(model: nn.Module, collective: TorchCollective, finished: bool) -> tuple[dict[str, Any] | None,
                                                                                              str | None]:
    """A sharded model's whole weights (on rank 0) when every rank finished and none failed; else None, and why."""
    if collective.posted_failure() is not None:
        return None, "a rank failed, and the sharded weights cannot be gathered without it"
    if not all(row[0] for row in collective.all_gather_ints([int(finished)])):
        return None, "not every rank finished"
    return full_state(model, None)[0], None
