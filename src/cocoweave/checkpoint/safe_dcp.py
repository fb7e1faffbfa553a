"""Reading torch.distributed.checkpoint (DCP) files without running code from them.

DCP unpickles its `.metadata` file and loads every non-tensor entry with `torch.load(weights_only=False)`:
a crafted checkpoint runs code on load. `SafeReader` unpickles the metadata allowing only the classes DCP
writes there (its metadata dataclasses, torch.Size, dtypes, layouts, paths), and `SafePlanner` loads
non-tensor entries with `torch.load(weights_only=True)` (numbers, strings, containers, tensors). Anything
else raises `UnsafeCheckpoint` naming what was refused; loading such a checkpoint is a decision for the
user (cocoweave.checkpoint.load(..., trusted=True)), like torch.load's `weights_only=False`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UnsafeCheckpoint(Exception):
    """A checkpoint file asks for something a safe load does not allow (code could run)."""


def first_failure(exc: BaseException) -> BaseException:
    """The exception behind DCP's CheckpointException (a BaseException wrapping each rank's failure)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = failures[min(failures)]
        if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
            return wrapped[0]
    return exc


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"its DCP metadata refers to `{module}.{name}`, which a safe load does not allow")


def load_metadata(data: bytes) -> Metadata:
    """DCP metadata from the bytes of a `.metadata` file, refusing anything but DCP's own classes."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged file
        raise UnsafeCheckpoint(f"its DCP metadata cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"its DCP metadata is a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata is unpickled with `load_metadata`'s allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor entries with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"its entry `{fqn}` holds an object a safe load does not allow "
                                   f"({str(exc).strip().splitlines()[0]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
