"""Continue a run in place from the newest checkpoint its log committed, or start it over in place.
Only committed bytes are trusted: a changed file goes to ``damaged/``, a file the log never committed to
``uncommitted/``, a commit a kill cut short is finished, and each is said on the console and in the log."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from fsmtrain.core.chain import KEY_ENV, Chain
from fsmtrain.core.context import CheckpointContext, EpochRecord, RunContext, epoch_number
from fsmtrain.core.events import EVENTS_FILE, first_run_start
from fsmtrain.core.ledger import CHECKPOINT_NAME, CheckpointLedger, CommittedFile
from fsmtrain.training import checkpoint_file as files
from fsmtrain.training.checkpoint import UNCOMMITTED_DIR, DamagedState, find_damaged, quarantine

__all__ = ["NeverStarted", "NothingCommitted", "RecordedStart", "Restart", "ResumeError", "Resumption",
           "check_log_key", "find_resumption", "prepare_restart", "rank_log_tail", "read_log_tail", "recorded_start",
           "resumption_or_restart"]

_TEMP = re.compile(r"^\..+\.tmp$")  # a write cut short


class ResumeError(ValueError):
    """The run cannot be continued: no log, no committed checkpoint left, or a mismatch."""


class NeverStarted(ResumeError):
    """The run's log holds no whole line: its process was stopped before the run started."""


class NothingCommitted(ResumeError):
    """The run's log commits no checkpoint (still there) to continue from: start it over in place."""


@dataclass(frozen=True)
class RecordedStart:
    """What a run directory's first ``run_start`` says of how the run was trained."""

    seed: int
    world_size: int  # how many ranks trained it (1 when the log names none)


def recorded_start(run_dir: Path) -> RecordedStart:
    """The seed and world size of the run in ``run_dir``, from its log's first ``run_start``."""
    log = run_dir / EVENTS_FILE
    if not log.is_file():
        raise ResumeError(f"{run_dir} has no {EVENTS_FILE}: there is no run to resume there")
    found = first_run_start(log)
    if found is None and b"\n" not in log.read_bytes():
        raise NeverStarted(f"{log} holds no event yet: the run was stopped before it started")
    payload = found or {}
    seed, world = payload.get("seed"), payload.get("world_size")
    if type(seed) is int:
        return RecordedStart(seed, world if type(world) is int and world > 0 else 1)
    raise ResumeError(f"{log} holds no run_start event with the run's seed: it is not the log of an fsmtrain "
                      "run, or it was damaged (fsmtrain audit tells which)")


def check_log_key(run_dir: Path, key: bytes | None) -> None:
    """A resumed log goes on with the key its run was started with, or no one key would verify it."""
    log = run_dir / EVENTS_FILE
    payload = first_run_start(log) if log.is_file() else None
    described = payload.get("chain") if payload is not None else None
    if not isinstance(described, dict):
        return  # no run_start to go on from: the resume itself says what is wrong
    recorded, given = Chain.key_id_of(described), None if key is None else Chain(key).key_id
    if recorded == given:
        return
    if recorded is None:
        why = f"is chained without a key, and a key (key id {given}) is set: unset {KEY_ENV} to resume it"
    elif given is None:
        why = f"is keyed (key id {recorded}), and no key is set: set {KEY_ENV} to the run's key to resume it"
    else:
        why = f"is keyed with key id {recorded}, and the key set has key id {given}: resume it with the run's own key"
    raise ResumeError(f"{log} {why}")


@dataclass(frozen=True)
class LogTail:
    """What a resume needs from the log it appends to."""

    next_seq: int
    run_id: str | None
    ledger: CheckpointLedger  # the checkpoint files the log committed (the log's own reader)
    torn_bytes: int  # bytes of a torn last line cut off


def read_log_tail(run_dir: Path, name: str = EVENTS_FILE, *, repair: bool = True) -> LogTail:
    """Read ``run_dir/<name>``; with ``repair``, cut off a torn last line (a process killed mid-write)."""
    log = run_dir / name
    if not log.is_file():
        raise ResumeError(f"{run_dir} has no {name}: there is no run to resume there")
    raw = log.read_bytes()
    cut = raw.rfind(b"\n") + 1
    torn = len(raw) - cut
    if torn and repair:
        with open(log, "r+b") as fh:
            fh.truncate(cut)
            os.fsync(fh.fileno())
    ledger = CheckpointLedger()
    next_seq, run_id = 0, None
    for line in raw[:cut].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the audit reports it; resume only needs the committed checkpoints
        if not isinstance(rec, dict):
            continue
        if isinstance(rec.get("seq"), int):
            next_seq = rec["seq"] + 1
        run_id = rec.get("run_id", run_id)
        ledger.feed(rec)
    return LogTail(next_seq, run_id, ledger, torn)


@dataclass
class Resumption:
    """A verified checkpoint to continue from, and what the resume cleaned up."""

    run_dir: Path
    path: Path
    shown: str  # as the log names it
    sha256: str
    state: dict[str, Any]
    tail: LogTail
    removed: list[str] = field(default_factory=list)
    announce: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # warnings logged before it restores
    # what the resume changed on purpose (a re-planned schedule): warnings logged after ``resume``
    notices: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    damaged: list[DamagedState] = field(default_factory=list)  # moved aside and announced in train_begin
    notes: dict[str, Any] = field(default_factory=dict)  # what the resume event says besides (world sizes...)
    completes: list[str] = field(default_factory=list)  # role files a kill left between commit and move

    @property
    def epoch(self) -> int:
        """The checkpoint's epoch index (its content counts from 1, as its file's name)."""
        return int(self.state["epoch"]) - 1

    @property
    def next_epoch(self) -> int:
        return int(self.state["position"]["next_epoch"])

    @property
    def global_step(self) -> int:
        return int(self.state["position"]["global_step"])

    def prepare(self, run: RunContext) -> None:
        """Before ``run_start``: the position and the history of the epochs already done."""
        run.epoch, run.global_step, position = self.next_epoch, self.global_step, self.state["position"]
        if "epoch_state" in position:  # a checkpoint at a step: its epoch goes on after the batches it had done
            before, now = self.notes.get("world_size_before", 1), self.notes.get("world_size", 1)
            # On another world size the epoch goes on after as many of its examples as were seen (a rank's
            # batch then holds another share of them), in the new world's data order.
            run.resume_at = {"batch": int(position["batch"]) * before // now, "epoch_state": position["epoch_state"]}
        run.history = [EpochRecord(int(h["epoch"]), {k: float(v) for k, v in h["metrics"].items()})
                       for h in files.read_history(self.state.get("history"))]
        run.extras["resumed_from"] = self.shown
        run.validations = int(position.get("validations", len(run.history)))  # older files: one an epoch

    def restore(self, run: RunContext) -> None:
        """In ``train_begin``: damaged files moved aside, the state restored, ``on_load_checkpoint``, ``resume``."""
        for damaged in self.damaged:
            self._quarantine(run, damaged)
        self._complete(run)
        for event, payload in self.announce:
            run.emit(event, level="warning", **payload)
        state = self.state
        own = files.restore_run_state(run, state)
        run.dispatch("on_load_checkpoint", CheckpointContext(run, state, str(self.path)))
        run.emit("resume", checkpoint=self.shown, sha256=self.sha256, checkpoint_epoch=self.epoch,
                 next_epoch=self.next_epoch, global_step=self.global_step, removed=self.removed,
                 **_inside_epoch(run), torn_line_bytes=self.tail.torn_bytes, **self.notes)
        for event, payload in self.notices:
            run.emit(event, level="warning", **payload)
        # Last, after every callback's own set-up: the random streams continue exactly where they were.
        files.restore_rng_state(own["rng"])

    def _complete(self, run: RunContext) -> None:
        """Finish the commit a kill cut short between the epoch file's commit and its roles' moves."""
        if not self.completes:
            return
        epoch = self.epoch
        for shown in self.completes:
            files.atomic_link(self.path, self.run_dir / shown, sync_dir=False)
        files.fsync_dir(self.path.parent)
        for shown in self.completes:
            run.emit("checkpoint", path=shown, sha256=self.sha256, epoch=epoch, kind=Path(shown).stem,
                     completes=self.shown)
        run.warn("resume", f"the commit of epoch {epoch_number(epoch)} was cut short after {self.shown} was "
                           f"committed: {', '.join(self.completes)} now name it, as the log intended",
                 completed=list(self.completes))

    def _quarantine(self, run: RunContext, d: DamagedState) -> None:
        moved = quarantine(self.run_dir, d)
        first, others = d.paths[0], d.paths[1:]
        also = f" (and {', '.join(others)}: the same file)" if others else ""
        digests = ", ".join(dict.fromkeys(d.found_sha256))
        run.emit("checkpoint_damaged", level="warning", paths=list(d.paths), moved_to=list(moved), epoch=d.epoch,
                 committed_sha256=d.committed_sha256, found_sha256=list(d.found_sha256),
                 falls_back_to=self.shown, falls_back_to_epoch=self.epoch,
                 message=f"checkpoint {first}{also} is damaged: the log committed sha256 {d.committed_sha256}, the "
                         f"file has {digests}; moved to {os.path.dirname(moved[0])}/; the run continues from "
                         f"{self.shown} (epoch {self.state['epoch']})")


def _inside_epoch(run: RunContext) -> dict[str, Any]:
    """A resume at a step: the batch it goes on from (and the validations done, with val_every_n_steps)."""
    out: dict[str, Any] = {} if run.resume_at is None else {"batch": run.resume_at["batch"]}
    if run.val_every_n_steps is not None:
        done = (run.resume_at or {}).get("epoch_state") or {}
        out.update(validations=run.validations, validated_at=int(done.get("validated_at", run.global_step)))
    return out


def find_resumption(run_dir: str | Path, which: str | Path = "latest", *, own_log: str | None = None) -> Resumption:
    """The checkpoint to continue ``run_dir`` from: ``"latest"`` (the newest intact committed one) or a path
    the log committed. ``own_log``: a rank other than 0, which continues that log and changes no file."""
    run_dir = Path(run_dir)
    tail = read_log_tail(run_dir, repair=own_log is None)
    live = dict(tail.ledger.live)
    if not live:
        raise NothingCommitted(f"{run_dir}: the log committed no checkpoint that is still there; nothing to resume "
                               "from")
    if which != "latest":
        wanted = os.path.abspath(which)
        live = {s: c for s, c in live.items() if os.path.abspath(run_dir / s) == wanted}
        if not live:
            raise ResumeError(f"{which} is not a checkpoint the log of {run_dir} committed")
    intact, damaged = find_damaged(run_dir, live)
    problems: list[str] = []
    for done in sorted((live[s] for s in intact), key=lambda c: c.newness, reverse=True):
        path = run_dir / done.path
        try:
            state = files.load_checkpoint(path, expected_sha256=done.sha256, verified=True)  # find_damaged hashed it
        except files.CheckpointError as exc:  # the committed bytes themselves do not load
            problems.append(str(exc))
            continue
        if own_log is not None:
            return Resumption(run_dir, path, done.path, done.sha256, state, rank_log_tail(run_dir, own_log))
        completes = _interrupted_roles(done, tail.ledger.live)  # all of the log: roles newer commits moved
        damaged = _not_moved_roles(damaged, completes, done.sha256)
        res = Resumption(run_dir, path, done.path, done.sha256, state, tail, damaged=damaged, completes=completes)
        keep = intact | {p for d in damaged for p in d.paths} | set(completes)  # damaged files are moved aside
        res.removed, moved = _set_aside_uncommitted(run_dir, path.parent, keep)
        if missing := _missing_newer(done, live, keep):
            res.announce.append(("warning", missing))  # the resume event names it and the fallback too
            res.notes.update({k: missing[k] for k in ("missing", "missing_epoch", "falls_back_to_epoch")})
        if moved:
            res.announce.append(_moved_notice(moved))
            res.notes["uncommitted_moved_to"] = moved
        return res
    problems += [f"{', '.join(d.paths)}: the log committed sha256 {d.committed_sha256}, the file has "
                 f"{', '.join(dict.fromkeys(d.found_sha256))}" for d in damaged]
    problems += [f"{s}: missing" for s in live if s not in intact and not any(s in d.paths for d in damaged)]
    raise ResumeError(f"{run_dir}: no committed checkpoint could be loaded: " + "; ".join(problems))


@dataclass
class Restart:
    """A run whose log committed no checkpoint, started over in place from epoch 0."""

    run_dir: Path
    tail: LogTail
    removed: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)  # files the log never committed, set aside

    def restore(self, run: RunContext) -> None:
        """In ``train_begin``, where a resume restores: the log says the run starts over, and why."""
        if self.moved:
            event, payload = _moved_notice(self.moved)
            run.emit(event, level="warning", **payload)
        run.emit("restart", level="warning", from_epoch=0, removed=self.removed, torn_line_bytes=self.tail.torn_bytes,
                 message=f"{self.run_dir}: its log committed no checkpoint to continue from (the run was stopped "
                         "before its first checkpoint): it starts over from epoch 0, in the same run directory")


def resumption_or_restart(run_dir: str | Path, which: str | Path) -> Resumption | Restart:
    """What continues ``run_dir``: :func:`find_resumption`, or with ``"latest"`` and nothing committed a restart."""
    try:
        return find_resumption(run_dir, which)
    except NothingCommitted:
        if which != "latest":
            raise
        return prepare_restart(run_dir)


def prepare_restart(run_dir: str | Path, *, own_log: str | None = None) -> Restart:
    """Start ``run_dir`` over: its log repaired and continued, the leftovers in ``checkpoints/`` set aside."""
    run_dir = Path(run_dir)
    if own_log is not None:
        return Restart(run_dir, rank_log_tail(run_dir, own_log))
    tail = read_log_tail(run_dir)  # first: the log is repaired before any file is set aside
    return Restart(run_dir, tail, *_set_aside_uncommitted(run_dir, run_dir / "checkpoints", set()))


def rank_log_tail(run_dir: Path, name: str) -> LogTail:
    """A rank's own log, repaired; a rank killed before it wrote a line starts a fresh one."""
    if not (run_dir / name).is_file():
        return LogTail(0, None, CheckpointLedger(), 0)
    return read_log_tail(run_dir, name)


def _interrupted_roles(chosen: CommittedFile, live: Mapping[str, CommittedFile]) -> list[str]:
    """The roles the log meant ``chosen`` to get that no commit gave it (a kill in the commit window)."""
    folder = PurePosixPath(chosen.path).parent
    names = [str(folder / f"{role}.pt") for role in chosen.roles]
    since = chosen.seq if chosen.seq is not None else -1
    # A role committed after ``chosen`` (a newer epoch's, since damaged or gone) is no part of its commit.
    return [n for n in names if n not in live or (live[n].sha256 != chosen.sha256 and (live[n].seq or 0) < since)]


def _not_moved_roles(damaged: list[DamagedState], completes: list[str], sha: str) -> list[DamagedState]:
    """``damaged`` without the role files holding the bytes of the commit they complete (not damaged)."""
    out: list[DamagedState] = []
    for d in damaged:
        left = [(p, f) for p, f in zip(d.paths, d.found_sha256, strict=True) if not (p in completes and f == sha)]
        if left:
            out.append(DamagedState(d.epoch, d.committed_sha256, tuple(p for p, _ in left), tuple(f for _, f in left)))
    return out


def _missing_newer(chosen: CommittedFile, live: Mapping[str, CommittedFile], there: set[str]) -> dict[str, Any] | None:
    """A warning naming the committed files newer than ``chosen`` not ``there`` (gone): the run falls back."""
    epoch = chosen.epoch if chosen.epoch is not None else -1
    gone = sorted(s for s, c in live.items() if s not in there and c.epoch is not None and c.epoch > epoch)
    if not gone:
        return None
    newest = max(live[s].epoch or 0 for s in gone)
    return {"source": "resume", "missing": gone, "missing_epoch": newest, "falls_back_to": chosen.path,
            "falls_back_to_epoch": epoch, "message": f"committed checkpoint {', '.join(gone)} (epoch "
            f"{epoch_number(newest)}) is missing: the run falls back to {chosen.path} (epoch {epoch_number(epoch)})"}


def _moved_notice(moved: list[str]) -> tuple[str, dict[str, Any]]:
    return ("warning", {"source": "resume", "moved_to": moved,
                        "message": f"{len(moved)} checkpoint file(s) the log never committed moved to "
                                   f"{os.path.dirname(moved[0])}/ (kept, not loaded): {', '.join(moved)}"})


def _set_aside_uncommitted(run_dir: Path, folder: Path, keep: set[str]) -> tuple[list[str], list[str]]:
    """Set aside our files in ``folder`` but ``keep`` (the committed ones): a temp file is removed, any other
    moved to ``uncommitted/`` as evidence. Returns what left the folder and where the moved ones went."""
    kept = {os.path.abspath(run_dir / s) for s in keep}
    removed: list[str] = []
    stray: list[str] = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        ours = CHECKPOINT_NAME.match(path.name) or _TEMP.match(path.name)
        if not (path.is_file() or path.is_dir()) or not ours or os.path.abspath(path) in kept:
            continue
        removed.append(os.path.relpath(path, run_dir))
        if path.name.endswith(".tmp"):  # a sharded checkpoint's: a folder
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        else:
            stray.append(removed[-1])
    moved = list(quarantine(run_dir, DamagedState(None, "", tuple(stray), ()), UNCOMMITTED_DIR)) if stray else []
    return removed, moved
