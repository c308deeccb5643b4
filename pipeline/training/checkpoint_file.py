"""One checkpoint file: its format (:func:`run_state`), written by ``torch.save`` and hashed as it is
written, read back only with the bytes its run's log committed. :func:`atomic_file` is the run's one
atomic write: a reader sees the old file or the whole new one, never a part, also after a crash."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from fsmtrain.core.context import EpochRecord, RunContext, epoch_number
from fsmtrain.core.events import EVENTS_FILE
from fsmtrain.core.ledger import committed_sha256, folder_digest, folder_files, sha256_of
from fsmtrain.core.log_file import FileWriteError, write_failure
from fsmtrain.training.resume_match import object_classes
from fsmtrain.training.sharding import checkpoint_states, load_shards, load_states, save_shards

__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointWriteError", "HashingWriter", "HistoryTexts",
           "SavedCheckpoint", "atomic_file", "atomic_link", "atomic_write_bytes", "capture_rng_state",
           "check_free_space", "folder_files", "fsync_dir", "history_text", "load_checkpoint", "read_history",
           "restore_rng_state", "restore_run_state", "run_state", "save_folder", "save_state", "sha256_of"]

HistoryTexts = dict[int, tuple[dict[str, float], str]]  # epoch -> (its metrics as encoded, the text)
FORMAT_VERSION = 2  # 2: "epoch" counts from 1, as the file names do


def fsync_dir(directory: Path) -> None:
    """Make the renames and removals in ``directory`` durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open a folder; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing(path: Path, sync_dir: bool) -> Iterator[Path]:
    """A temp name beside ``path`` that replaces it when the block ends, removed when it raises;
    ``sync_dir=False`` leaves the folder's fsync to a caller that makes several renames durable at once."""
    # One left by a killed process of the same pid is unlinked only when the exclusive open or the link finds
    # it: not before every write, which cost the writer thread a system call (and the GIL again) each time.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: Path, *, sync_dir: bool = True) -> Iterator[IO[bytes]]:
    """A new file, readable by its owner only, that replaces ``path`` fsync'd once the block ends."""
    with _replacing(path, sync_dir) as tmp, open(tmp, "wb", opener=_exclusive) as fh:
        yield fh
        fh.flush()
        os.fsync(fh.fileno())


def _exclusive(name: str, flags: int) -> int:
    """A new file, readable by its owner only. Never through an old name: a temp name left as a hard link
    of a committed file (a killed link) would take the write into that file."""
    try:
        return os.open(name, flags | os.O_EXCL, 0o600)
    except FileExistsError:  # left by a killed process of the same pid
        os.unlink(name)
        return os.open(name, flags | os.O_EXCL, 0o600)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_file(path) as fh:
        fh.write(data)


def atomic_link(source: Path, path: Path, *, sync_dir: bool = True) -> None:
    """Make ``path`` another name of ``source``, atomically: a hard link, or a copy where there is none
    (a folder's: a folder of its files' hard links, swapped in for the old one)."""
    if source.is_dir():
        tmp, old = path.with_name(f".{path.name}.new.tmp"), path.with_name(f".{path.name}.old.tmp")
        for stale in (tmp, old):
            shutil.rmtree(stale, ignore_errors=True)
        shutil.copytree(source, tmp, copy_function=os.link)
        fsync_dir(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        if sync_dir:
            fsync_dir(path.parent)
        return
    try:
        with _replacing(path, sync_dir) as tmp:
            try:
                os.link(source, tmp)
            except FileExistsError:  # left by a killed process of the same pid
                tmp.unlink()
                os.link(source, tmp)
    except OSError:  # a file system without hard links
        with open(source, "rb") as src, atomic_file(path, sync_dir=sync_dir) as fh:
            shutil.copyfileobj(src, fh, 1 << 20)


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or not an fsmtrain checkpoint."""


class CheckpointWriteError(FileWriteError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error); nothing committed changed."""

    @classmethod
    def of(cls, exc: OSError, epoch: int, path: Path, needs: int | None = None) -> CheckpointWriteError:
        need = f"; it needs at least {needs} bytes" if needs is not None else ""
        return cls(exc.errno, f"the checkpoint of epoch {epoch_number(epoch)} could not be written: "
                              f"{write_failure(exc, str(path), path)}{need}; the checkpoints committed before it "
                              "are unchanged")


def check_free_space(path: Path, needs: int) -> None:
    """Raise ``OSError(ENOSPC)`` when ``path``'s file system has fewer free bytes than ``needs``: a file that
    cannot fit is not begun, so it never fills the disk and starves the run's other writers."""
    try:
        vfs = os.statvfs(path.parent)
    except OSError:
        return  # the write itself will say what is wrong
    if needs > vfs.f_bfree * vfs.f_frsize:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@dataclass(frozen=True)
class SavedCheckpoint:
    path: Path
    sha256: str
    epoch: int
    kind: str
    roles: tuple[str, ...] = ()  # an epoch file: the other names it gets once it is committed
    step: int | None = None  # a checkpoint at a step (``step_<n>.pt``): its global step
    shards: Mapping[str, str] | None = None  # a sharded checkpoint's folder: each file's sha256


def save_folder(path: Path, state: dict[str, Any], group: Any) -> tuple[str, dict[str, str]] | None:
    """A sharded checkpoint: every rank writes ``rank_<r>.pt`` (its state but the tensors') and its shards
    into ``.<name>.tmp`` beside ``path``; rank 0, once DCP says all are written, renames it ``path`` and
    returns its digest and each file's (the others return None)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {k: state[k] for k in ("model", "optimizer", "grads") if state.get(k)}  # grads: by name
    save_state(tmp / f"rank_{rank}.pt", {**state, **dict.fromkeys(tensors)})
    save_shards(tmp, tensors, group)
    if rank:
        return None
    fsync_dir(tmp)
    found = folder_files(tmp)
    if path.exists():  # an uncommitted leftover of the same name
        shutil.rmtree(path)
    os.replace(tmp, path)
    return folder_digest(found), found


class HashingWriter:
    """A write-only file for ``torch.save`` that hashes what it passes on to ``out``. The first failed
    write is kept and the rest dropped, so torch's zip writer never meets an exception; :meth:`hexdigest` raises it."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.digest = hashlib.sha256()
        self.failure: OSError | None = None

    def write(self, data: Any) -> int:
        if self.failure is None:
            try:
                self.out.write(data)
            except OSError as exc:
                self.failure = exc
            self.digest.update(data)
        return memoryview(data).nbytes

    def flush(self) -> None:  # called after the zip writer is done: an error here is torch.save's own
        self.out.flush()

    def hexdigest(self) -> str:
        if self.failure is not None:
            raise self.failure
        return self.digest.hexdigest()


def save_state(path: Path, state: Any, data: memoryview | None = None) -> str:
    """``torch.save`` of ``state`` to ``path`` (or ``data``, its bytes, as saved already), atomically (the
    folder's fsync is the caller's); its sha256."""
    if data is not None:
        digest = hashlib.sha256(data).hexdigest()  # hashlib and the write let go of the GIL for the bytes
        with atomic_file(path, sync_dir=False) as fh:
            fh.write(data)
        return digest
    with atomic_file(path, sync_dir=False) as fh:
        hashing = HashingWriter(fh)
        torch.save(state, hashing)  # type: ignore[arg-type]  # a file object by duck typing
        return hashing.hexdigest()


def history_text(history: list[EpochRecord], epoch: int, metrics: Mapping[str, float] | None,
                 texts: HistoryTexts | None = None) -> str:
    """A checkpoint's ``history`` (the epochs up to ``epoch``) as one JSON text: one string pickles as one
    object, where a list of dicts costs ``torch.save`` a call per number. ``texts``, kept by the run from one
    checkpoint to the next, holds each finished epoch's text: encoding the whole history at every checkpoint
    would cost a long run time quadratic in its length."""
    texts = {} if texts is None else texts
    parts: list[str] = []
    for r in history:
        if r.epoch < epoch:
            kept = texts.get(r.epoch)
            if kept is None or kept[0] != r.metrics:  # a record replaced (by a resume) or changed: encoded again
                kept = texts[r.epoch] = (dict(r.metrics), _epoch_text(r.epoch, r.metrics))
            parts.append(kept[1])
    return "[" + ",".join(parts + ([] if metrics is None else [_epoch_text(epoch, metrics)])) + "]"


def _epoch_text(epoch: int, metrics: Mapping[str, float]) -> str:
    return json.dumps({"epoch": epoch, "metrics": {k: float(v) for k, v in metrics.items()}}, separators=(",", ":"))


def read_history(value: Any) -> list[dict[str, Any]]:
    """A checkpoint's ``history`` as ``{"epoch", "metrics"}`` dicts (older checkpoints hold the list)."""
    return json.loads(value) if isinstance(value, str) else list(value or [])


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *,
                    expected_sha256: str | None = None, verified: bool = False) -> dict[str, Any]:
    """Load a checkpoint (``weights_only``, memory-mapped) once its bytes match the sha256 its run's log
    committed, or ``expected_sha256`` (``verified``: the caller has just checked that). Damage, a mismatch
    or code in the pickle raise :class:`CheckpointError` naming the file."""
    p = Path(path)
    if not p.is_file() and not (p / "rank_0.pt").is_file():
        raise CheckpointError(f"checkpoint {p} does not exist")
    size, log = p.stat().st_size, p.parent.parent / EVENTS_FILE
    expected = expected_sha256 or (committed_sha256(log, p) if log.is_file() else None)
    if expected is not None and not verified:
        found = sha256_of(p)
        if found != expected:
            raise CheckpointError(
                f"checkpoint {p} does not match its committed sha256: the log recorded {expected}, "
                f"the file has {found} ({size} bytes); it was changed or damaged after it was written")
    try:
        state = torch.load(p / "rank_0.pt" if p.is_dir() else p, map_location=map_location, weights_only=True,
                           mmap=True)
    except Exception as exc:  # every reader failure means damage, but code in the pickle
        if isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc):
            what = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln), "a pickled object")
            raise CheckpointError(
                f"checkpoint {p} contains code, not only tensors and plain values ({what}); "
                "it was not loaded. fsmtrain never unpickles code from a checkpoint") from None
        raise CheckpointError(
            f"checkpoint {p} is corrupt or truncated ({size} bytes): {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"checkpoint {p} is not an fsmtrain checkpoint (no 'format' key)")
    if state["format"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {p} has format {state['format']!r}; this fsmtrain reads {FORMAT_VERSION}")
    if p.is_dir():  # a sharded checkpoint: its tensors load into the live model (:func:`restore_run_state`)
        state["folder"] = str(p)
    return state


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and CUDA when present) RNG states as tensors and plain values, which
    ``torch.load(weights_only=True)`` accepts."""
    version, internal, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    return {
        # one tensor, not 625 ints: each pickled object costs torch.save a persistent_id call
        "python": {"version": int(version), "state": torch.from_numpy(np.array(internal, dtype=np.int64)),
                   "gauss_next": gauss_next},
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (used by resume)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def stateful_callbacks(run: RunContext) -> dict[str, Any]:
    """The callbacks whose state a checkpoint holds, by key: the name, ``name#i`` for a repeated one."""
    found: dict[str, Any] = {}
    for i, cb in enumerate(run.callbacks):
        if getattr(cb, "stateful", False):
            found[cb.name if cb.name not in found else f"{cb.name}#{i}"] = cb
    return found


def run_state(run: RunContext, epoch: int, metrics: Mapping[str, float], best: dict[str, Any],
              at: tuple[int, int] | None = None, texts: HistoryTexts | None = None) -> dict[str, Any]:
    """The checkpoint of ``run`` at ``epoch``, a plain dict ``weights_only`` loads. ``at``: (global step,
    batches done) of a checkpoint inside the epoch, which adds the driver's sums and accumulating grads;
    ``texts``: the run's history texts (:func:`history_text`)."""
    model, optimizer, scheduler = run.model, run.optimizer, run.scheduler
    by_name = run.extras.get("strategy") == "fsdp"  # a folder of shards (DCP), keyed by parameter name
    model_sd, optim_sd = checkpoint_states(model, optimizer, by_name)
    state: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "run_id": run.run_id,
        "epoch": epoch_number(epoch),  # counted from 1, as its file's name (the position keeps the index)
        "chain_head": getattr(run.events, "head", None),  # pins the log as it was at this commit
        "position": {"phase": run.phase.value, "epoch": epoch, "next_epoch": epoch + 1, "batch": 0,
                     "global_step": run.global_step, "max_epochs": run.max_epochs},
        "metrics": {k: float(v) for k, v in metrics.items()},
        # this epoch's record is not in it yet; a checkpoint at a step holds the finished epochs only
        "history": history_text(run.history, epoch, metrics if at is None else None, texts),
        "model": model_sd,
        "optimizer": optim_sd,
        "scheduler": scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None,
        "scaler": run.scaler.state_dict() if run.scaler is not None else None,
        "exact_metrics": run.exact_metrics.state_dict() if run.exact_metrics else None,
        "callbacks": {key: cb.state_dict() for key, cb in stateful_callbacks(run).items()},
        "rng": capture_rng_state(),
        "data_order": {"seed": run.extras.get("data_seed")},
        "config_fingerprint": run.extras.get("config_fingerprint"),
        "classes": object_classes(model, optimizer, scheduler),  # what a Trainer resuming it must hold
        "best": best,  # the best-checkpoint policy's own record
        "extra": {},
    }
    if run.val_every_n_steps is not None:  # else one validation an epoch: the history counts them
        state["position"]["validations"] = run.validations
    if at is not None:
        named = list(model.named_parameters()) if model is not None else []
        grads: Any = {n: p.grad for n, p in named if p.grad is not None} if by_name else [p.grad for _, p in named]
        state.update(step=at[0],
                     grads=grads if any(g is not None for g in (grads.values() if by_name else grads)) else None)
        done = {k: v for k, v in run.epoch_state().items() if k != "batch"}  # the driver's own
        state["position"].update(next_epoch=epoch, batch=at[1], global_step=at[0], epoch_state=done)
    return state


def restore_run_state(run: RunContext, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """:func:`run_state`'s pieces back into ``run`` (its random streams aside: the caller restores them last,
    from the state returned: a sharded checkpoint's, this rank's own)."""
    if state.get("folder"):  # sharded: each rank's shards, resharded to this world; its own state, when there
        folder = Path(state["folder"])
        load_shards(run.model, run.optimizer, folder) if run.model is not None else None
        world, before = int(run.extras.get("world_size", 1)), len(list(folder.glob("rank_*.pt")))
        if (strategy := run.extras.get("strategy", "ddp")) != "fsdp":
            run.warn("resume", f"the sharded checkpoint {folder.name} (strategy fsdp) continues under strategy "
                               f"{strategy}: each rank loads the whole model from its shards",
                     strategy=["fsdp", strategy])
        if world != before:
            run.warn("resume", f"the sharded checkpoint {folder.name} was written by {before} rank(s): "
                               f"torch.distributed.checkpoint reshards it onto {world}", resharded=[before, world])
        else:  # the same ranks: each its own random streams, callbacks and sums of the epoch it is in
            mine = torch.load(folder / f"rank_{run.extras.get('rank', 0)}.pt", weights_only=True)
            state = {**state, "rng": mine["rng"], "callbacks": mine["callbacks"]}
            if run.resume_at is not None and "epoch_state" in mine["position"]:
                run.resume_at["epoch_state"] = mine["position"]["epoch_state"]
    elif run.model is not None and state.get("model") is not None:
        load_states(run.model, run.optimizer, state["model"], state.get("optimizer"))  # sharded or plain
        for p, grad in zip(run.model.parameters(), state.get("grads") or (), strict=False):  # accumulating
            p.grad = None if grad is None else grad.to(p.device)
    for key, part in (("scheduler", run.scheduler), ("scaler", run.scaler), ("exact_metrics", run.exact_metrics)):
        if part and state.get(key) and hasattr(part, "load_state_dict"):
            part.load_state_dict(state[key])
    saved = state.get("callbacks") or {}
    for key, cb in stateful_callbacks(run).items():
        if key in saved:
            cb.load_state_dict(saved[key])
    seed = (state.get("data_order") or {}).get("seed")
    if seed is not None:
        run.extras["data_seed"] = int(seed)
    return state
