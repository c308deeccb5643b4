"""The hash chain of ``events.jsonl``: each line's ``prev`` is the digest (sha256, or HMAC-SHA256 with
``FSMTRAIN_LOG_KEY``) of the line before (the first's: of the run id and config), and its ``seal`` the
digest of the line without it. The log records a *key id*, which tells a wrong key from tampering."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping, Sequence
from operator import methodcaller
from pathlib import Path
from typing import Any

__all__ = ["KEY_ENV", "SCHEME_KEYED", "SCHEME_PLAIN", "Chain", "LogKeyError", "key_from_env", "last_line",
           "read_key_file"]

KEY_ENV = "FSMTRAIN_LOG_KEY"
SCHEME_PLAIN = "sha256"
SCHEME_KEYED = "hmac-sha256"
_GENESIS_LABEL = b"fsmtrain-chain-v1\n"
_KEY_ID_LABEL = b"fsmtrain-key-id-v1"
# A sealed line ends with ``,"seal":"<64 hex>"}`` and its newline; without them it reads ``}\n``.
_SEAL_OPEN = b',"seal":"'
_SEAL_CLOSE = b'"}\n'
_UNSEALED_END = b"}\n"
_SEAL_TAIL = len(_SEAL_OPEN) + 64 + len(_SEAL_CLOSE)
_HEXDIGEST = methodcaller("hexdigest")


class LogKeyError(ValueError):
    """A log key that cannot be used (empty, or its file unreadable); the message says which."""


class Chain:
    """Links lines with sha256 (no key) or HMAC-SHA256 (``key``)."""

    __slots__ = ("_base", "key", "key_id", "scheme")

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and not key:
            raise LogKeyError("the log key is empty")
        self.key = key
        self.scheme = SCHEME_PLAIN if key is None else SCHEME_KEYED
        self.key_id = None if key is None else hmac.digest(key, _KEY_ID_LABEL, "sha256").hex()[:16]
        # The state every digest starts from: a line's digest costs a copy of it.
        self._base: Any = hashlib.sha256() if key is None else hmac.new(key, digestmod="sha256")

    def digest(self, data: bytes) -> str:
        """The digest of one line's bytes (newline included)."""
        state = self._base.copy()
        state.update(data)
        hexed: str = state.hexdigest()
        return hexed

    def digests(self, lines: Sequence[bytes]) -> list[str]:
        """:meth:`digest` of each line, in one call (a long log's lines, a run of them at a time)."""
        if self.key is None:
            return list(map(_HEXDIGEST, map(hashlib.sha256, lines)))
        return [hmac.digest(self.key, line, "sha256").hex() for line in lines]

    def _sealed(self, prefix: bytes, tail: bytes | None) -> tuple[str, Any]:
        """The seal of a line whose bytes before its seal are ``prefix``, and its state past ``tail``."""
        state = self._base.copy()
        state.update(prefix)
        unsealed = state.copy()
        unsealed.update(_UNSEALED_END)
        seal: str = unsealed.hexdigest()
        state.update(_SEAL_OPEN + seal.encode("ascii") + _SEAL_CLOSE if tail is None else tail)
        return seal, state

    def seal(self, body: bytes) -> tuple[bytes, str, str]:
        """``body`` (a JSON object, no newline) with ``seal`` appended, the seal, and the line's digest."""
        prefix = body[:-1]  # without its closing brace
        seal, state = self._sealed(prefix, None)
        return prefix + _SEAL_OPEN + seal.encode("ascii") + _SEAL_CLOSE, seal, state.hexdigest()

    def check_seal(self, raw: bytes) -> tuple[bool | None, str]:
        """For a line read back: whether its seal matches (None: it has none), and the line's digest."""
        tail = raw[-_SEAL_TAIL:]
        if not (tail.startswith(_SEAL_OPEN) and tail.endswith(_SEAL_CLOSE)):
            return None, self.digest(raw)
        seal, state = self._sealed(raw[:-_SEAL_TAIL], tail)
        return seal.encode("ascii") == tail[len(_SEAL_OPEN):-len(_SEAL_CLOSE)], state.hexdigest()

    def genesis(self, run_id: str, config: Any) -> str:
        """What the first line chains to: the run id and the JSON-safe resolved config (or None)."""
        body = json.dumps({"run_id": run_id, "config": config}, sort_keys=True, separators=(",", ":"),
                          allow_nan=False)
        return self.digest(_GENESIS_LABEL + body.encode("utf-8"))

    def describe(self) -> dict[str, Any]:
        """What ``run_start`` records about the chain: the scheme and the key id, never the key."""
        return {"scheme": self.scheme} if self.key_id is None else {"scheme": self.scheme, "key_id": self.key_id}

    @staticmethod
    def key_id_of(described: Mapping[str, Any]) -> str | None:
        kid = described.get("key_id")
        return kid if isinstance(kid, str) else None


def key_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The key in ``FSMTRAIN_LOG_KEY`` (its UTF-8 bytes), or None when unset or empty."""
    value = (os.environ if environ is None else environ).get(KEY_ENV, "")
    return value.encode("utf-8") if value else None


def read_key_file(path: str | Path) -> bytes:
    """A key kept in a file, without trailing newlines (``echo KEY > file`` as ``FSMTRAIN_LOG_KEY=KEY``)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise LogKeyError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    key = data.rstrip(b"\r\n")
    if not key:
        raise LogKeyError(f"key file {path} is empty")
    return key


def last_line(path: Path) -> bytes | None:
    """The last line of ``path`` (with its newline, if any), or None for a missing or empty file."""
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            block = 4096
            while True:  # backwards from the end, a block twice as large each time
                start = max(end - block, 0)
                fh.seek(start)
                tail = fh.read()
                cut = tail.rfind(b"\n", 0, len(tail) - 1)  # a newline before the final byte
                if cut >= 0:
                    return tail[cut + 1:]
                if start == 0:
                    return tail or None
                block *= 2
    except FileNotFoundError:
        return None
