"""Per-shard checksums: CRC-32 (zlib) over the shard's bytes.

zlib's CRC-32 needs no extra dependency; ``benchmarks/snapshot_overhead.py`` measures its
throughput against the copy it guards. A shard whose checksum does not match is treated as
lost (never loaded).
"""

from __future__ import annotations

import zlib

import torch


def crc32(data: torch.Tensor, chunk_bytes: int = 64 << 20) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes (viewed as uint8)."""
    flat = data.reshape(-1).view(torch.uint8).numpy()
    value = 0
    for start in range(0, flat.size, chunk_bytes):
        value = zlib.crc32(memoryview(flat[start : start + chunk_bytes]), value)
    return value & 0xFFFFFFFF
