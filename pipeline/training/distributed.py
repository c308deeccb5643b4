"""Multi-process training with ``torch.distributed`` (one process per rank, started by ``torchrun``): the
collectives, one rank's loaders (training in equal padded shards so every rank takes the same moves,
validation in exact shards so summed metrics are the true mean) and the model in DDP."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Sequence, Sized
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from fsmtrain.core.consensus import AgreementTimeout, Failure, RankFailed
from fsmtrain.training.data_position import loader_like
from fsmtrain.training.driver import epoch_seed

__all__ = ["DistributedOptions", "TorchCollective", "group_threads", "init_from_env", "launched_by_torchrun",
           "shard_train_loader", "shard_val_loader", "shutdown", "wrap_model"]

T = TypeVar("T")
_SLICE_S = 0.25  # how often a rank waiting at an agreement point reads the failure board


@dataclass(frozen=True)
class DistributedOptions:
    """The config's ``distributed:`` section (defaults need none)."""

    backend: str | None = None  # gloo on CPU, nccl on CUDA
    timeout_s: float = 1800.0  # how long a collective waits for a rank before failing
    agreement_timeout_s: float = 600.0  # how long a rank waits at an agreement point for the others


def launched_by_torchrun() -> bool:
    """This process is one of several ranks started by ``torchrun`` (or its elastic agent)."""
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


class TorchCollective:
    """The collectives of one rank, and the run's :class:`~fsmtrain.core.consensus.FailureBoard` (a key in
    torchrun's rendezvous store, which outlives a failed rank). A wait ends as soon as another rank posts
    a failure (``RankFailed``) or after ``agreement_timeout_s`` (``AgreementTimeout``)."""

    def __init__(self, device: torch.device, agreement_timeout_s: float = 600.0) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (call init_from_env first)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = device  # where gathered tensors live: the rank's CUDA device under NCCL
        self.agreement_timeout_s = agreement_timeout_s
        self._board = f"fsmtrain/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._topic = "unbound"
        self._board_store: Any = None  # a torch.distributed.TCPStore client, made on first use
        self._flags: Any = None  # the process group of the per-batch signal rounds

    def bind(self, topic: str) -> None:
        """Name the run whose failures this collective posts and reads (the same on every rank)."""
        self._topic = topic

    def _store(self) -> Any:
        if self._board_store is None:
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not host or not port:
                raise RuntimeError("the failure board needs the rendezvous store of env:// (MASTER_ADDR and "
                                   "MASTER_PORT), as torchrun sets them; this process group was made without")
            # documented as torch.distributed.TCPStore; torch's __init__ does not re-export it for type checkers
            self._board_store = dist.TCPStore(host, int(port), is_master=False,  # type: ignore[attr-defined]
                                              timeout=timedelta(seconds=self.agreement_timeout_s))
        return self._board_store

    def post_failure(self, failure: Failure) -> Failure:
        first = self._store().compare_set(self._board + self._topic, "", failure.encode())
        return Failure.decode(bytes(first).decode("utf-8", "replace")) or failure

    def posted_failure(self) -> Failure | None:
        store, key = self._store(), self._board + self._topic
        if not store.check([key]):
            return None
        return Failure.decode(bytes(store.get(key)).decode("utf-8", "replace"))

    def all_reduce_max_async(self, values: Sequence[int]) -> Callable[[], list[int]]:
        """Start a non-blocking max of ``values`` over the ranks (on the host, through a gloo group of its
        own: never a GPU sync); the call returned waits for it."""
        if self._flags is None:  # made at the first batch, on every rank in the same order
            self._flags = dist.new_group(backend="gloo")  # its own: never queued behind DDP's all-reduces
        mine = torch.tensor(list(values), dtype=torch.int64)
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._flags, async_op=True)

        def read() -> list[int]:
            self._bounded_wait(work, "the per-batch signal round")
            return [int(v) for v in mine.tolist()]
        return read

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._bounded_wait(dist.all_gather(rows, mine, async_op=True), "all_gather_ints")
        return [[int(v) for v in row.tolist()] for row in rows]

    def _bounded_wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` (the collective ``what``) in slices; between them, read the failure board and the clock."""
        deadline = time.monotonic() + self.agreement_timeout_s
        gloo = dist.get_backend() == "gloo"
        pause = 1e-4
        while True:
            if gloo:  # gloo's wait takes a timeout and leaves the work intact when it runs out
                try:
                    work.wait(timeout=timedelta(seconds=_SLICE_S))
                    return
                except RuntimeError:
                    if work.is_completed():
                        # It may have completed just after the slice ran out (the error was the slice's):
                        # waiting again returns, or raises the collective's own error (a rank left).
                        work.wait()
                        return
            elif work.is_completed():
                work.wait()
                return
            else:
                time.sleep(pause)
                pause = min(pause * 2, _SLICE_S)
                if pause < _SLICE_S:
                    continue
            failure = self.posted_failure()
            if failure is not None and failure.rank != self.rank:
                raise RankFailed(failure)
            if time.monotonic() > deadline:
                raise AgreementTimeout(
                    f"rank {self.rank} waited {self.agreement_timeout_s:g} s at an agreement point ({what}) and "
                    f"not every rank of {self.world_size} came, and none posted a failure: a rank hangs or died "
                    "silently (the bound is distributed.agreement_timeout_s)")

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` as rank ``src`` has it, pickled into a tensor; one that will not pickle reaches every rank
        as a ``TypeError`` that names it, never as a hang."""
        data = b""
        if self.rank == src:
            try:
                data = b"\x01" + pickle.dumps(obj)
            except Exception as exc:
                data = b"\x00" + f"{type(obj).__name__} will not pickle ({type(exc).__name__}: {exc})".encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._bounded_wait(dist.broadcast(size, src=src, async_op=True), "broadcast_object (its size)")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        moved = buf.to(self.device)
        self._bounded_wait(dist.broadcast(moved, src=src, async_op=True), "broadcast_object")
        raw = bytes(moved.cpu().numpy().tobytes()) if self.rank != src else data
        if raw[:1] != b"\x01":
            said = raw[1:].decode(errors="replace")
            raise TypeError(f"rank {src} could not send its object to the other ranks: {said}")
        return pickle.loads(raw[1:])

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """``tensor`` becomes the sum over the ranks (in place), within ``agreement_timeout_s``."""
        self._bounded_wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True), "all_reduce_sum")

    def barrier(self) -> None:
        self._bounded_wait(dist.barrier(async_op=True), "barrier")

    def on_rank_zero(self, make: Callable[[], T], shown: Callable[[T], Any]) -> Any:
        """``make()`` on rank 0, which keeps it; the other ranks get ``shown(made)`` or rank 0's error."""
        kept: list[T] = []

        def decide() -> Any:
            kept.append(make())
            return shown(kept[0])

        value = self.share(decide)
        return kept[0] if kept else value

    def share(self, decide: Callable[[], T]) -> T:
        """Rank 0 runs ``decide``; every rank returns its result, or raises the error it raised."""
        outcome: tuple[bool, Any] | None = None
        if self.rank == 0:
            try:
                outcome = (True, decide())
            except Exception as exc:  # every rank must hear of it; each raises it (as text if it will not pickle)
                outcome = (False, exc if _pickles(exc) else RuntimeError(f"{type(exc).__name__}: {exc}"))
        ok, value = self.broadcast_object(outcome, 0)
        if not ok:
            raise value
        return cast(T, value)


def _pickles(obj: object) -> bool:
    try:
        pickle.loads(pickle.dumps(obj))
        return True
    except Exception:
        return False


def init_from_env(options: DistributedOptions, device: torch.device) -> TorchCollective:
    """Join the process group ``torchrun`` describes in the environment (on CUDA: the local rank's device)."""
    # Imported before the group exists, so its functions' default ``group.WORLD`` is None: else
    # those defaults keep the group alive into the interpreter's teardown (exit 134 after a good run).
    import torch.distributed.nn.functional

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = options.backend or ("nccl" if device.type == "cuda" else "gloo")
        timeout = timedelta(seconds=options.timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # A restarted agent reuses its store: each attempt gets keys of its own, or a rank could
            # read a dead attempt's address and fail to connect.
            from torch.distributed.rendezvous import rendezvous

            store, rank, world = next(rendezvous("env://", timeout=timeout))
            prefixed = dist.PrefixStore(f"fsmtrain/attempt/{attempt}", store)  # type: ignore[attr-defined]
            dist.init_process_group(backend=backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    return TorchCollective(device, options.agreement_timeout_s)


# The names Linux gives the native threads of a gloo process group (its device loop and workers).
_GROUP_THREADS = frozenset({"gloo_tcp_loop", "pt_gloo_runloop"})


def group_threads() -> list[str]:
    """The native threads of a process group still running in this process (Linux; elsewhere [])."""
    names: list[str] = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(OSError):  # the thread ended while we looked
            names.append(comm.read_text().strip())
    return sorted(n for n in names if n in _GROUP_THREADS)


def shutdown() -> list[str]:
    """End the process group and its threads in the teardown, not at interpreter exit; returns the group
    threads still running."""
    gc.collect()  # first: a sharded model in a cycle (a Trainer's) still holds its mesh
    if dist.is_initialized():
        dist.destroy_process_group()
    if "torch.distributed.tensor" in sys.modules:  # a sharded run: DTensor's caches hold its meshes, which hold
        from torch.distributed.tensor import _collective_utils, _redistribute  # the group's threads (torch has
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # no public way to free them)

        _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]
        _redistribute.clear_redistribute_planner_cache()
        _redistribute._gen_transform_infos.cache_clear()
        _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    gc.collect()
    return group_threads()


def wrap_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` in DistributedDataParallel (its gradients averaged over the ranks in backward)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


class _WrappingDistributedSampler(DistributedSampler[T]):
    """A ``DistributedSampler`` whose seed ``seed + epoch`` wraps around 2**64 (torch takes none above it)."""

    def __iter__(self) -> Iterator[T]:
        seed = self.seed
        self.seed = (seed + self.epoch) % 2**64 - self.epoch
        try:
            return iter(list(super().__iter__()))  # drawn now, while the seed is the wrapped one
        finally:
            self.seed = seed


def _loader_like(loader: DataLoader[Any], sampler: Sampler[int] | range) -> DataLoader[Any]:
    return loader_like(loader, sampler=sampler, batch_size=loader.batch_size, drop_last=loader.drop_last)


class _ShardedSampler(Sampler[int]):
    """One rank's share of a user's own sampler: every ``world``-th index of its draw, padded to equal
    shards; every rank draws alike (the RNGs seeded by the data seed and the epoch)."""

    def __init__(self, inner: Sampler[int], rank: int, world: int, seed: int) -> None:
        self.inner, self.rank, self.world, self.seed, self.epoch = inner, rank, world, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(cast(Sized, self.inner)) // self.world)

    def __iter__(self) -> Iterator[int]:
        seed = epoch_seed(self.seed, self.epoch)
        gen = getattr(self.inner, "generator", None)
        if isinstance(gen, torch.Generator):
            gen.manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drawn = list(self.inner)
        drawn += (drawn * self.world)[: -len(drawn) % self.world]  # padded with its own start, as DistributedSampler
        return iter(drawn[self.rank::self.world])


def _shardable(loader: Any, what: str) -> DataLoader[Any]:
    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        raise TypeError(f"a multi-process run shards its {what} loader by dataset index: it must be a "
                        f"torch DataLoader with a batch_size, got {type(loader).__name__}")
    return loader


def shard_train_loader(loader: Any, rank: int, world: int, seed: int) -> DataLoader[Any]:
    """This rank's share of the training data in equal, padded shards, shuffled (if the loader was) by
    ``seed`` and the epoch; a user's own sampler is kept, each rank taking its share of its draw."""
    loader = _shardable(loader, "training")
    if type(loader.sampler) not in (RandomSampler, SequentialSampler):
        return _loader_like(loader, _ShardedSampler(loader.sampler, rank, world, seed))  # the user's own: kept
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler: DistributedSampler[Any] = _WrappingDistributedSampler(
        loader.dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    return _loader_like(loader, sampler)


def shard_val_loader(loader: Any, rank: int, world: int) -> DataLoader[Any]:
    """This rank's share of the validation data, unpadded: summed over the ranks it is the whole set once."""
    loader = _shardable(loader, "validation")
    return _loader_like(loader, range(rank, len(loader.dataset), world))  # every world-th index: exact, unpadded
