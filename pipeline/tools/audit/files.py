"""The checkpoint files a log names: each file's sha256 and stored chain head against the log. A file
that differs is named by what it holds (a :class:`Verdict`)."""

from __future__ import annotations

import pickletools
import zipfile
import zlib
from pathlib import Path

from fsmtrain.core.context import epoch_number
from fsmtrain.core.ledger import CHECKPOINT_NAME, folder_files, sha256_of
from fsmtrain.tools.audit.chain import ChainCheck
from fsmtrain.tools.audit.checkpoints import CheckpointLines, CheckpointWrite, Damaged
from fsmtrain.tools.audit.segment import Segment
from fsmtrain.tools.audit.verdict import Explanation, Finding, Severity, Verdict

__all__ = ["verify_checkpoints"]

_MEMO_OPS = frozenset({"BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"})
_TEXT_OPS = frozenset({"BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8"})


def verify_checkpoints(log: Path, ckpts: CheckpointLines, chain: ChainCheck, segments: list[Segment], lines: int,
                       ex: Explanation, *, allow_missing: bool = False) -> list[Finding]:
    """Findings for the checkpoint files the log commits. A committed file that is gone is a violation
    (else deleting its files would pass a forgery); a warning with ``allow_missing``, or when files were
    written at a point the log does not hold (what came after may have removed it)."""
    out: list[Finding] = []
    missing: list[tuple[str, int]] = []
    base = log.parent
    # A checkpoint pinning a line of a process killed before its result is a write it never logged.
    killed = [(s.first_line, s.last_line) for s in segments if s.result_line is None]
    if segments and segments[-1].result_line is None:
        killed.append((segments[-1].first_line, lines))
    for rel, w in ckpts.writes.items():
        if rel in ckpts.removed:
            ex.checkpoints_removed += 1
            continue
        if rel in ckpts.damaged:
            out += _quarantined(base, rel, ckpts.damaged[rel])
            continue
        file = base / rel
        if not file.exists():  # a file, or a sharded checkpoint's folder
            ex.checkpoints_missing += 1
            missing.append((rel, w.line))
            continue
        actual = sha256_of(file)
        found, head = stored_head(file)
        if actual == w.sha256:
            ex.checkpoints_verified += 1
            if w.chain_head is not None and found:
                if head != w.chain_head:
                    out.append(Finding("checkpoint", f"checkpoint {rel} stores chain head {_short(head)}, but its "
                                       f"checkpoint event records {_short(w.chain_head)}", w.line))
                else:
                    ex.checkpoints_pinned += 1
            continue
        changed = (f"sha256 {actual[:12]}... but the log recorded {w.sha256[:12]}... at line {w.line}"
                   + _shards_changed(file, w))
        out.append(_differs(log, rel, w, ckpts.first_commit.get(actual), file, head, chain, killed, changed))
    later = any(f.verdict in (Verdict.LOG_REWRITTEN, Verdict.UNCOMMITTED_WRITE) for f in out)
    return out + _missing(missing, allow_missing, later) + _newest_missing(base, ckpts) + _strays(base, ckpts)


def _shards_changed(folder: Path, w: CheckpointWrite) -> str:
    """Which files of a sharded checkpoint's folder differ from those its commit names."""
    if w.shards is None or not folder.is_dir():
        return ""
    found = folder_files(folder)
    odd = sorted(n for n in {*w.shards, *found} if found.get(n) != w.shards.get(n))
    return f" (in the folder: {', '.join(n + ('' if n in found else ' missing') for n in odd)})"


def _missing(missing: list[tuple[str, int]], allowed: bool, later: bool) -> list[Finding]:
    """A finding per committed file that is gone: (path, the line that committed it)."""
    if allowed or later:
        why = ("" if allowed else ": checkpoint files were written at a point the log does not hold (named), and "
               "what came after it may have removed this one")
        return [Finding("checkpoint", f"checkpoint {rel} is not present; its sha256 was not verified{why}", line,
                        Severity.WARNING) for rel, line in missing]
    return [Finding("checkpoint", f"checkpoint {rel} is not present, and the run did not remove it: committed state "
                    "is missing (pass --allow-missing if it was moved or deleted on purpose)", line)
            for rel, line in missing]


def _newest_missing(base: Path, ckpts: CheckpointLines) -> list[Finding]:
    """Every name of the newest state the log commits is gone: a resume falls back to an older one."""
    live = {rel: w for rel in ckpts.live() if (w := ckpts.writes[rel]).epoch is not None}
    if not live:
        return []
    newest = max(w.epoch or 0 for w in live.values())
    names = sorted(rel for rel, w in live.items() if w.epoch == newest)
    if any((base / rel).exists() for rel in names):
        return []
    return [Finding("checkpoint", f"the newest committed state (epoch {epoch_number(newest)}: {', '.join(names)}) "
                    "is missing, every name of it: a resume falls back to an older state",
                    max(live[rel].line for rel in names), Severity.WARNING)]


def _strays(base: Path, ckpts: CheckpointLines) -> list[Finding]:
    """Checkpoint files beside the committed ones that the log does not commit (never, or no
    longer): a write a kill cut short, or a planted file. A resume moves them to ``uncommitted/``."""
    writes, removed = ckpts.writes, ckpts.removed
    folders = {(base / rel).parent for rel in writes}
    out: list[Finding] = []
    for folder in sorted(f for f in folders if f.is_dir()):
        for path in sorted(folder.iterdir()):
            rel = str(path.relative_to(base)) if path.is_relative_to(base) else str(path)
            if path.is_file() and CHECKPOINT_NAME.match(path.name) and (rel not in writes or rel in removed):
                out.append(Finding("checkpoint", f"{rel} is in the checkpoint folder, but the log does not commit "
                                   "it: a write a kill cut short, or a file put there; a resume moves it to "
                                   "uncommitted/", None, Severity.WARNING))
    return out


def _differs(log: Path, rel: str, w: CheckpointWrite, committed: tuple[int, str, int | None] | None, file: Path,
             head: str | None, chain: ChainCheck, killed: list[tuple[int, int]], changed: str) -> Finding:
    """What a file whose sha256 is not the one the log last recorded for it holds (``committed``:
    the first commit of the bytes it holds, if any; ``head``: the chain head it stores)."""
    if committed is not None:
        line, path, epoch = committed
        shown = "?" if epoch is None else epoch_number(epoch)
        what = f"the one line {line} committed" + (f" for {path}" if path != rel else "") + f" (epoch {shown})"
        if line < w.line:
            return Finding("checkpoint", f"checkpoint {rel} is an older write: {what}, not the one line {w.line} "
                           f"records ({changed})", w.line, verdict=Verdict.OLDER_WRITE)
        return Finding("checkpoint", f"checkpoint {rel} holds another write: {what}, not the one line {w.line} "
                       f"records ({changed})", w.line, verdict=Verdict.OTHER_WRITE)
    no_write = f"its sha256 matches no write the log committed ({changed})"
    broken = _zip_damage(file)
    if broken is not None or head is None:
        why = broken or "it stores no chain head"
        return Finding("checkpoint", f"checkpoint {rel} is damaged: {no_write}; {why}", w.line,
                       verdict=Verdict.DAMAGED)
    at = chain.locate(log, head)
    if at is None:
        return Finding("checkpoint", f"checkpoint {rel} pins chain head {_short(head)}, which is no line of this "
                       f"log: the log was cut back or rewritten after that checkpoint was committed ({changed})",
                       w.line, verdict=Verdict.LOG_REWRITTEN)
    if at < w.line:
        # It pins a line before the write the log records, yet it is none of the writes the log
        # committed: the recorded write with its bytes changed where the zip keeps no CRC.
        return Finding("checkpoint", f"checkpoint {rel} is damaged: {no_write}; it pins line {at}, as the write "
                       f"line {w.line} records does, and its zip entries hold their CRCs", w.line,
                       verdict=Verdict.DAMAGED)
    if any(first <= at <= last for first, last in killed):
        return Finding("checkpoint", f"checkpoint {rel} was written after line {at} by a process that ended "
                       f"before its result: an uncommitted write interrupted by the process's end ({changed})", at,
                       Severity.WARNING, Verdict.UNCOMMITTED_WRITE)
    return Finding("checkpoint", f"checkpoint {rel} was written after line {at} (the chain head it pins), but the "
                   f"log goes on without recording it: lines after line {at} were removed or rewritten ({changed})",
                   at + 1, verdict=Verdict.LOG_REWRITTEN)


def _zip_damage(file: Path) -> str | None:
    """Why ``file`` is not a whole checkpoint by its own evidence (a torch file is a zip whose
    entries carry CRC-32s), or None when every entry holds its CRC."""
    if file.is_dir():  # a sharded checkpoint's folder: DCP's shard files are not zips (its files are named)
        return "a file of the folder changed or is missing"
    try:
        with zipfile.ZipFile(file) as zf:
            bad = zf.testzip()
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError, zlib.error) as exc:
        return f"it is not a readable zip ({exc})"
    return None if bad is None else f"its zip entry {bad} fails its CRC: bytes changed on disk"


def _quarantined(base: Path, rel: str, d: Damaged) -> list[Finding]:
    """A file a resume moved to ``damaged/``: the evidence is kept as the log says it found it."""
    if d.moved_to is None:
        return []
    kept = base / d.moved_to
    if not kept.is_file():
        return [Finding("checkpoint", f"damaged checkpoint {rel} was moved to {d.moved_to} (line {d.line}), which "
                        "is not there", d.line, Severity.WARNING)]
    if d.found_sha256 is not None and sha256_of(kept) != d.found_sha256:
        return [Finding("checkpoint", f"{d.moved_to} (damaged {rel}, line {d.line}) changed after it was moved "
                        "aside", d.line, Severity.WARNING)]
    return []


def _short(head: str | None) -> str:
    return "none" if head is None else f"{head[:12]}..."


def stored_head(path: Path) -> tuple[bool, str | None]:
    """(found, head): the ``chain_head`` a checkpoint stores, read without torch by walking the opcodes
    of the zip's ``data.pkl`` (never unpickled). The state dict's keys are pushed as text right before
    their values, and "chain_head" comes before any nested state: its first occurrence is the key."""
    try:
        with zipfile.ZipFile(path / "rank_0.pt" if path.is_dir() else path) as zf:
            name = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
            if name is None:
                return False, None
            after_key = False
            for op, arg, _ in pickletools.genops(zf.read(name)):
                if after_key and op.name not in _MEMO_OPS:
                    return True, arg if op.name in _TEXT_OPS and isinstance(arg, str) else None
                after_key = after_key or (op.name in _TEXT_OPS and arg == "chain_head")
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        pass
    return False, None

