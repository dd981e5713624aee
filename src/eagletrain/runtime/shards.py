"""Atomic safetensors shards holding many samples, with the per-sample index in the header.

A shard is written to a temporary name, fsynced, renamed, and its directory fsynced; only
then are its samples marked done in the ledger. The shard's name is recorded in the ledger as
'writing' before the file is created, so a crash in between leaves a file the next run of
the stage deletes by name (no directory listing), never a "done" row without data.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_KEY = "eagletrain.index"
SCALE_SUFFIX = "_scale"  # a float8-stored tensor's per-row scales: "<name>_scale"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def shard_path(directory: Path, name: str) -> Path:
    """A shard's path; a name from the ledger may never point outside its directory."""
    if not _SAFE_NAME.match(name) or ".." in name:
        raise ValueError(f"invalid shard name {name!r}")
    return directory / name


@dataclass(frozen=True)
class IndexEntry:
    key: str
    offset: int
    tokens: int
    checksum: str


SAMPLE_TENSORS = ("aux", "last", "input_ids", "loss_mask")


def scale_names(scaled: Iterable[str]) -> tuple[str, ...]:
    """The companion tensors holding the float8 scales of the named tensors."""
    return tuple(f"{name}{SCALE_SUFFIX}" for name in scaled)


def sample_tensor_names(scaled: Iterable[str]) -> tuple[str, ...]:
    """The tensors whose rows make up an extracted sample, in checksum order: the four,
    then the float8 scales of those stored in float8 ("aux_scale", "last_scale")."""
    return (*SAMPLE_TENSORS, *scale_names(scaled))


def sample_checksum(tensors: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        # hash the tensor's memory in place (no copy); hashlib releases the GIL for it
        digest.update(memoryview(t.contiguous().view(torch.uint8).numpy()))
    return digest.hexdigest()[:32]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_to_file(tensors: dict[str, torch.Tensor], header: dict[str, str], path: Path) -> None:
    save_file(tensors, path, metadata=header)  # serialised straight to the file


# how a shard's bytes reach its file; faults.install() swaps in a full-disk simulation
save_to_file = _save_to_file


def write_shard(
    path: Path, tensors: dict[str, torch.Tensor], index: list[IndexEntry], meta: dict[str, object]
) -> int:
    """Write atomically; returns the file size in bytes."""
    header = {k: str(v) for k, v in meta.items()}
    header[INDEX_KEY] = json.dumps([e.__dict__ for e in index])
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        save_to_file(tensors, header, tmp)
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
    except Exception as err:
        tmp.unlink(missing_ok=True)  # free what the partial file took
        if isinstance(err, OSError):
            raise
        # safetensors' writer reports a full disk as its own error type, not OSError
        if shutil.disk_usage(path.parent).free < needed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from err
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path.stat().st_size


def read_index(path: Path) -> list[IndexEntry]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return [IndexEntry(**e) for e in json.loads(meta[INDEX_KEY])]


class ShardReader:
    """Row slices of named tensors, reading only the rows asked for."""

    def __init__(self, path: Path):
        self.path = path
        self._file = safe_open(str(path), framework="pt")

    def rows(self, name: str, offset: int, length: int) -> torch.Tensor:
        return self._file.get_slice(name)[offset : offset + length]

    def metadata(self) -> dict[str, str]:
        return self._file.metadata() or {}

    def keys(self) -> list[str]:
        return list(self._file.keys())


def remove_unfinished(directory: Path, names: list[str]) -> None:
    """Delete shards that were being written when a worker died (and their temp files)."""
    for name in names:
        path = shard_path(directory, name)
        for tmp in directory.glob(f".{name}.tmp-*"):
            tmp.unlink()
        path.unlink(missing_ok=True)
