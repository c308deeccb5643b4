"""``torch.save``'s file, byte for byte, with one Python call per tensor instead of a dozen.

``torch.save`` pickles through a ``persistent_id`` written in Python that is called for every
object of the state (every key, number and string: some 700 calls for a small model's checkpoint)
and reduces each tensor through five Python frames. On the checkpoint writer thread that is Python
work holding the GIL, which the training thread then waits for: on a small model it was most of
the writer's CPU time. :func:`write_torch_file` writes the same zip archive (the same records in
the same order, the same pickle opcodes, the same storage keys), so ``torch.load`` reads it as
it reads ``torch.save``'s file and the bytes, hence the sha256 the run's log commits, are equal:
``tests/test_torch_file.py`` checks that against ``torch.save`` on the states fsmtrain writes and on
the tensors it does not take the short way for.

The short way is for an exact ``torch.Tensor``, dense, on the CPU, without ``requires_grad``,
Python attributes, conj/neg bits or a dtype that ``torch.save`` stores untyped: what a staged
checkpoint holds. Any other tensor is reduced by torch itself (``Tensor.__reduce_ex__``) and its
storage is named here as ``torch.save`` names it.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import IO, Any, cast

import torch
from torch import serialization
from torch._utils import _rebuild_tensor_v2

__all__ = ["write_torch_file"]

_PROTOCOL = serialization.DEFAULT_PROTOCOL
_UNTYPED_DTYPES = torch.storage._new_dtypes()  # torch.save keeps these as untyped storages (v3)
_DTYPE_CLASH = "Cannot save multiple tensors or storages that view the same data as different types"  # torch's words


# torch's helpers, untyped in its stubs
_tensor_metadata: Callable[[torch.Tensor], dict[str, bool]] = torch._utils.get_tensor_metadata
_normalize_storage_type: Callable[[type], Any] = serialization.normalize_storage_type
_storage_type_names: Callable[[], dict[torch.dtype, str]] = cast(Any, torch.storage)._dtype_to_storage_type_map


def _to_cpu(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    return cast(torch.UntypedStorage, cast(Any, storage).cpu())


class _Storage:
    """Pickles as ``persistent_id`` of a storage the short way found (see :class:`_Pickler`)."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _Pickler(pickle.Pickler):
    """``torch.serialization._save``'s pickler with its storage rules, but cheap for what is not a tensor."""

    def __init__(self, out: IO[bytes]) -> None:
        super().__init__(out, protocol=_PROTOCOL)
        self.storages: dict[str, torch.UntypedStorage] = {}  # key -> storage, in the order first met
        self._keys: dict[int, str] = {}  # storage._cdata -> key
        self._dtypes: dict[int, torch.dtype] = {}  # data_ptr -> dtype, torch.save's same-bytes check
        self._storage_types: dict[torch.dtype, Any] = {}
        self._kinds: dict[type, str] = {}  # type -> "typed" / "untyped" storage, or "" for any other

    def _key(self, storage: torch.UntypedStorage, dtype: torch.dtype) -> str:
        if storage.device.type != "meta" and (ptr := storage.data_ptr()) != 0:
            seen = self._dtypes.setdefault(ptr, dtype)
            if seen != dtype:
                raise RuntimeError(_DTYPE_CLASH)
        key = self._keys.get(storage._cdata)
        if key is None:
            key = self._keys[storage._cdata] = str(len(self._keys))
        self.storages[key] = storage
        return key

    def _storage_type(self, dtype: torch.dtype) -> Any:
        kind = self._storage_types.get(dtype)
        if kind is None:  # what TypedStorage._pickle_storage_type names, as a torch attribute
            kind = self._storage_types[dtype] = getattr(torch, _storage_type_names()[dtype])
        return kind

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is not torch.Tensor
            or obj.layout is not torch.strided
            or obj.device.type != "cpu"
            or obj.requires_grad
            or obj.is_quantized
            or obj.dtype in _UNTYPED_DTYPES
            or obj.__dict__
            or _tensor_metadata(obj)
        ):
            return NotImplemented
        dtype = obj.dtype
        storage = obj.untyped_storage()
        # The pid tuple as torch.save builds it; its strings are the same objects each time a
        # storage recurs, so the pickle memo (hence the bytes) matches too.
        pid = ("storage", self._storage_type(dtype), self._key(storage, dtype), "cpu",
               storage.nbytes() // obj.element_size())
        return _rebuild_tensor_v2, (_Storage(pid), obj.storage_offset(), tuple(obj.size()), obj.stride(), False,
                                    OrderedDict())

    def persistent_id(self, obj: Any) -> Any:
        # Called for every object pickled: one type test and, for what is not ours, one dict lookup.
        kind = type(obj)
        if kind is _Storage:
            return obj.pid
        storage_kind = self._kinds.get(kind)
        if storage_kind is None:
            storage_kind = self._kinds[kind] = (
                "typed" if issubclass(kind, torch.storage.TypedStorage) else "untyped" if torch.is_storage(obj) else ""
            )
        if storage_kind == "typed":  # a tensor torch reduced itself
            return ("storage", self._storage_type(obj.dtype), self._key(obj._untyped_storage, obj.dtype),
                    self._location(obj, obj._untyped_storage), obj._size())
        if storage_kind == "untyped":
            return ("storage", _normalize_storage_type(kind), self._key(obj, torch.uint8),
                    self._location(obj, obj), obj.nbytes())
        return None

    @staticmethod
    def _location(obj: Any, storage: Any) -> str:
        fake = getattr(obj, "_fake_device", None)
        return str(fake) if fake is not None else serialization.location_tag(storage)


def write_torch_file(obj: Any, out: IO[bytes]) -> None:
    """Write ``obj`` to ``out`` exactly as ``torch.save(obj, out)`` does (its default arguments)."""
    data = io.BytesIO()
    pickler = _Pickler(data)
    pickler.dump(obj)
    alignment = serialization._get_storage_alignment()
    writer = torch._C.PyTorchFileWriter(out, serialization.get_crc32_options(), alignment)
    records: list[tuple[str, bytes]] = [
        ("data.pkl", data.getvalue()), (".format_version", b"1"), (".storage_alignment", str(alignment).encode()),
        ("byteorder", sys.byteorder.encode()),
    ]
    failed = True
    try:
        for name, value in records:
            writer.write_record(name, value, len(value))
        for key, storage in pickler.storages.items():
            if storage.device.type != "cpu":
                storage = _to_cpu(storage)
            writer.write_record(f"data/{key}", cast(Any, storage), storage.nbytes())
        failed = False
    finally:
        # Ended even after a failed write (a full disk), as torch.save's writer is on its way out:
        # left open, the writer's destructor would end it and abort the process on the error.
        # Then the write's own error is the one raised, not the end's.
        try:
            writer.write_end_of_file()
        except Exception:
            if not failed:
                raise
    out.flush()
