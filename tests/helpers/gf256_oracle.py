"""A small, independent GF(2^8) Reed-Solomon code: the test oracle for the erasure module.

Systematic Cauchy code over GF(2^8) (polynomial 0x11d), byte by byte through log/exp tables:
slow, short and written from the definition, so it shares nothing with ISA-L or the XOR path.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np

EXP = np.zeros(512, dtype=np.int32)
LOG = np.zeros(256, dtype=np.int32)
_x = 1
for _i in range(255):
    EXP[_i] = _x
    LOG[_x] = _i
    _x <<= 1
    if _x & 0x100:
        _x ^= 0x11D
EXP[255:510] = EXP[:255]


def mul(a: np.ndarray, c: int) -> np.ndarray:
    """``a * c`` elementwise (uint8 array times a field constant)."""
    if c == 0:
        return np.zeros_like(a)
    out = EXP[(LOG[a.astype(np.int32)] + LOG[c]) % 255].astype(np.uint8)
    out[a == 0] = 0
    return out


def inv(c: int) -> int:
    return int(EXP[(255 - LOG[c]) % 255])


def matrix(k: int, m: int) -> List[List[int]]:
    """The (k + m) x k generator: identity on top, Cauchy 1 / (x_i + y_j) below."""
    rows = [[int(i == j) for j in range(k)] for i in range(k)]
    for i in range(m):
        rows.append([inv((k + i) ^ j) for j in range(k)])
    return rows


def encode(data: List[np.ndarray], m: int) -> List[np.ndarray]:
    k = len(data)
    out = []
    for row in matrix(k, m)[k:]:
        acc = np.zeros_like(data[0])
        for c, block in zip(row, data, strict=True):
            acc ^= mul(block, c)
        out.append(acc)
    return out


def decode(blocks: Dict[int, np.ndarray], k: int, m: int) -> List[np.ndarray]:
    """The k data blocks from any k blocks (index >= k: parity), by Gauss-Jordan over GF(2^8)."""
    idx = sorted(blocks)[:k]
    gen = matrix(k, m)
    a = [list(gen[i]) for i in idx]
    b = [blocks[i].copy() for i in idx]
    for col in range(k):
        piv = next(r for r in range(col, k) if a[r][col])
        a[col], a[piv], b[col], b[piv] = a[piv], a[col], b[piv], b[col]
        f = inv(a[col][col])
        a[col] = [int(mul(np.array([v], np.uint8), f)[0]) for v in a[col]]
        b[col] = mul(b[col], f)
        for r in range(k):
            if r != col and a[r][col]:
                g = a[r][col]
                a[r] = [
                    x ^ int(mul(np.array([y], np.uint8), g)[0])
                    for x, y in zip(a[r], a[col], strict=True)
                ]
                b[r] = b[r] ^ mul(b[col], g)
    return b


class OracleCodec:
    """The oracle behind the erasure module's codec interface."""

    name = "gf256-oracle"

    def __init__(self, k: int, m: int) -> None:
        self.k, self.m = k, m

    def encode(self, data):
        return encode([np.asarray(d) for d in data], self.m)

    def decode(self, blocks):
        return decode({i: np.asarray(b) for i, b in blocks.items()}, self.k, self.m)
