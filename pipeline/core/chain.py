"""The hash chain of ``events.jsonl``: each line's ``prev`` is the digest (sha256, or HMAC-SHA256 with
``FSMTRAIN_LOG_KEY``) of the line before (the first's: of the run id and config), and its ``seal`` the
digest of the line without it. The log records a *key id*, which tells a wrong key from tampering."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["KEY_ENV", "SCHEME_KEYED", "SCHEME_PLAIN", "Chain", "LogKeyError", "key_from_env", "last_line",
           "read_key_file"]

KEY_ENV = "FSMTRAIN_LOG_KEY"
SCHEME_PLAIN = "sha256"
SCHEME_KEYED = "hmac-sha256"
_GENESIS_LABEL = b"fsmtrain-chain-v1\n"
_KEY_ID_LABEL = b"fsmtrain-key-id-v1"
_BLOCK = 64  # sha256's block size
# A sealed line ends with ``,"seal":"<64 hex>"}`` and its newline; without them it reads ``}\n``.
_SEAL_OPEN = b',"seal":"'
_SEAL_CLOSE = b'"}\n'
_UNSEALED_END = b"}\n"
_HEX = 64
_SEAL_TAIL = len(_SEAL_OPEN) + _HEX + len(_SEAL_CLOSE)
_SEAL_AT, _SEAL_END = len(_SEAL_OPEN), len(_SEAL_OPEN) + _HEX  # the seal's digits within that tail


class LogKeyError(ValueError):
    """A log key that cannot be used (empty, or its file unreadable); the message says which."""


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Chain:
    """Links lines with sha256 (no key) or HMAC-SHA256 (``key``)."""

    __slots__ = ("_inner", "_outer", "digest", "key", "key_id", "scheme")

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and not key:
            raise LogKeyError("the log key is empty")
        self.key = key
        self.scheme = SCHEME_PLAIN if key is None else SCHEME_KEYED
        self.key_id = None if key is None else hmac.digest(key, _KEY_ID_LABEL, "sha256").hex()[:16]
        self._inner: Any = hashlib.sha256()  # the state every digest starts from
        self._outer: Any = None
        # The digest of one line's bytes (newline included): a plain function, called per line.
        self.digest: Callable[[bytes], str] = _sha256_hex
        if key is not None:
            # HMAC (RFC 2104) with its two padded-key states hashed once; a line costs two copies.
            block = (hashlib.sha256(key).digest() if len(key) > _BLOCK else key).ljust(_BLOCK, b"\0")
            self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
            self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))
            self.digest = self._hmac_hex

    def _hmac_hex(self, data: bytes) -> str:
        inner = self._inner.copy()
        inner.update(data)
        return self._close(inner)

    def _close(self, state: Any) -> str:
        """The hex digest of a hash state begun as a copy of ``self._inner``."""
        if self._outer is None:
            plain: str = state.hexdigest()
            return plain
        outer = self._outer.copy()
        outer.update(state.digest())
        hexed: str = outer.hexdigest()
        return hexed

    def seal(self, body: bytes) -> tuple[bytes, str, str]:
        """``body`` (a JSON object, no newline) with ``seal`` appended, the seal, and the line's digest."""
        prefix = body[:-1]  # without its closing brace
        state = self._inner.copy()
        state.update(prefix)
        unsealed = state.copy()
        unsealed.update(_UNSEALED_END)
        seal = self._close(unsealed)
        tail = _SEAL_OPEN + seal.encode("ascii") + _SEAL_CLOSE
        state.update(tail)
        return prefix + tail, seal, self._close(state)

    def check_seal(self, raw: bytes) -> tuple[bool | None, str]:
        """For a line read back: whether its seal matches (None: it has none), and the line's digest."""
        tail = raw[-_SEAL_TAIL:]
        if not (tail.startswith(_SEAL_OPEN) and tail.endswith(_SEAL_CLOSE)):
            return None, self.digest(raw)
        state = self._inner.copy()
        state.update(raw[:-_SEAL_TAIL])
        unsealed = state.copy()
        unsealed.update(_UNSEALED_END)
        state.update(tail)
        carried = tail[_SEAL_AT:_SEAL_END]
        outer = self._outer
        if outer is None:
            return unsealed.hexdigest().encode("ascii") == carried, state.hexdigest()
        seal, line = outer.copy(), outer.copy()
        seal.update(unsealed.digest())
        line.update(state.digest())
        return seal.hexdigest().encode("ascii") == carried, line.hexdigest()

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
