"""Read the history rows of an offline W&B run from its own ``.wandb`` record file."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def wandb_history(run_root: Path) -> list[dict[str, Any]]:
    """The history rows of the one offline run under ``run_root/wandb``, read from its ``.wandb``
    file: W&B's record log (a 7-byte ``:W&B`` header, then 32 KiB blocks of chunks with a 7-byte
    header: crc32, length, type FULL/FIRST/MIDDLE/LAST), each record a protobuf ``Record``."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = list(run_root.glob("wandb/offline-run-*/*.wandb"))
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind not in (1, 4):
            continue
        record = pb.Record()  # type: ignore[attr-defined]  # star-imported from the protobuf version's module
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
