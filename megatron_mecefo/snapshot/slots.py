"""Preallocated host slots per rank (2 or more), and the protocol that keeps the last good one
safe.

A slot is a flat uint8 buffer plus a header (JSON: iteration, tensor layout, metadata,
checksum). Writing snapshot N into a slot first deletes that slot's header, then copies the
bytes, then computes the checksum and writes the header atomically (``os.replace``). A process
killed at any point leaves at most the slot being written without a header, so the other
slots, holding the previous snapshots, stay valid. Which slot a snapshot goes to is the
manager's rule (:class:`~.manager.SnapshotManager`): never the one holding the newest snapshot
every rank committed.

Backing: with a holder directory the buffers are files in shared memory
(``/dev/shm/<job>/rank<R>/slot<i>.bin``, mapped with ``torch.from_file(shared=True)``), so
they outlive the process; otherwise they are ordinary tensors, pinned when CUDA is available
(the device-to-host copy then runs asynchronously on a side stream).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_mecefo.snapshot.checksum import crc32

ALIGN = 64  # bytes: every tensor starts on a cache line


@dataclass(frozen=True)
class Entry:
    """Where one named tensor sits in a slot's flat buffer."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def plan_layout(tensors: Dict[str, torch.Tensor]) -> Tuple[List[Entry], int]:
    """Entries in name order, each aligned; and the total size in bytes."""
    entries, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        entries.append(
            Entry(name, tuple(t.shape), str(t.dtype).replace("torch.", ""), offset, nbytes)
        )
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, offset


def slot_indices(directory: str) -> List[int]:
    """The indices of the slot files (``slot<i>.bin``) in a rank's directory, sorted."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in names:
        if name.startswith("slot") and name.endswith(".bin") and name[4:-4].isdigit():
            out.append(int(name[4:-4]))
    return sorted(out)


def _pin(buffer: torch.Tensor) -> torch.Tensor:
    if not torch.cuda.is_available():
        return buffer
    if buffer.is_shared():  # shared-memory mapping: register it in place (stays shared)
        torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
        return buffer
    return buffer.pin_memory()


class Slot:
    """One host buffer and its header file (or in-memory header)."""

    def __init__(self, index: int, directory: Optional[str]) -> None:
        self.index = index
        self.directory = directory
        self.buffer: Optional[torch.Tensor] = None
        self._header: Optional[Dict[str, Any]] = None  # in-memory slots only
        self.parity: Any = None
        """This member's share of the snapshot's parity (``parity.SlotParity``), once the
        group has exchanged it; dropped with the snapshot. Kept in the trainer's memory: a
        trainer restarted on its node gets its own slot back from the holder, and a lost
        member's slot is rebuilt by the survivors, who hold their parity."""

    @property
    def data_path(self) -> Optional[str]:
        return (
            None
            if self.directory is None
            else os.path.join(self.directory, f"slot{self.index}.bin")
        )

    @property
    def header_path(self) -> Optional[str]:
        return (
            None
            if self.directory is None
            else os.path.join(self.directory, f"slot{self.index}.json")
        )

    def ensure(self, nbytes: int) -> torch.Tensor:
        """The buffer, (re)allocated once when a snapshot needs more bytes than it has."""
        if self.buffer is not None and self.buffer.numel() >= nbytes:
            return self.buffer
        size = max(nbytes, 1)
        if self.directory is None:
            self.buffer = _pin(torch.empty(size, dtype=torch.uint8))
        else:
            with open(self.data_path, "ab") as f:
                if f.tell() < size:
                    f.truncate(size)
            self.buffer = _pin(
                torch.from_file(self.data_path, shared=True, size=size, dtype=torch.uint8)
            )
        return self.buffer

    def invalidate(self) -> None:
        """Drop the header first: from here until :meth:`seal`, the slot holds no snapshot."""
        self._header = None
        self.parity = None
        if self.header_path is not None and os.path.exists(self.header_path):
            os.remove(self.header_path)

    def seal(self, header: Dict[str, Any]) -> None:
        """Publish the header (atomically on disk): the slot now holds a snapshot."""
        if self.header_path is None:
            self._header = header
            return
        tmp = self.header_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(header, f)
        os.replace(tmp, self.header_path)

    def header(self) -> Optional[Dict[str, Any]]:
        if self.header_path is None:
            return self._header
        try:
            with open(self.header_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def attach(self) -> bool:
        """Map an existing slot file (after a restart); False when there is none."""
        if self.data_path is None or not os.path.exists(self.data_path):
            return self.buffer is not None
        size = os.path.getsize(self.data_path)
        if size == 0:
            return False
        self.buffer = torch.from_file(self.data_path, shared=True, size=size, dtype=torch.uint8)
        return True

    def verify(self) -> Optional[Dict[str, Any]]:
        """The header if the slot holds a snapshot whose checksum matches its bytes."""
        header = self.header()
        if header is None or not self.attach():
            return None
        if self.buffer.numel() < header["nbytes"]:
            return None
        if crc32(self.buffer[: header["nbytes"]]) != header["crc32"]:
            return None
        return header

    def read(self, header: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        """The named tensors of the snapshot (views into the buffer: clone to keep them)."""
        out = {}
        for e in header["entries"]:
            name, shape, dtype, offset, nbytes = e
            raw = self.buffer[offset : offset + nbytes]
            out[name] = raw.view(getattr(torch, dtype)).reshape(shape)
        return out


def copy_into(
    buffer: torch.Tensor, tensors: Dict[str, torch.Tensor], entries: List[Entry], non_blocking: bool
) -> None:
    """Copy every tensor to its place in ``buffer`` (bytes, so any dtype copies exactly)."""
    for e in entries:
        src = tensors[e.name]
        if not src.is_contiguous():
            src = src.contiguous()
        dst = buffer[e.offset : e.offset + e.nbytes]
        if e.nbytes:
            dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=non_blocking)
