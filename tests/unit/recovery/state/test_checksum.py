"""The heal's per-bucket checksum (``recovery/state/checksum.py``): exact, order-sensitive,
and computed without a copy of the data."""

from __future__ import annotations

import torch

from megatron_mecefo.recovery.state.checksum import (
    BLOCK_WORDS,
    SLICE_BYTES,
    TAIL_WEIGHT,
    as_bytes,
    bytes_checksum,
    state_checksum,
    tensor_checksum,
)


def _reference(data: torch.Tensor) -> list:
    """The same sums in plain Python integers, modulo 2**64 (the definition)."""
    raw = bytes(data.tolist())
    mod = 1 << 64
    whole = len(raw) - len(raw) % 8 if data.data_ptr() % 8 == 0 else 0
    words = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, whole, 8)]
    plain = sum(words) + sum(raw[whole:])
    weighted = (
        sum(
            sum(words[b : b + BLOCK_WORDS]) * (b // BLOCK_WORDS + 1)
            for b in range(0, len(words), BLOCK_WORDS)
        )
        + sum(raw[whole:]) * TAIL_WEIGHT
    )
    return [(v % mod) - mod if v % mod >= 1 << 63 else v % mod for v in (plain, weighted)]


def test_checksum_equals_its_definition_on_ragged_and_multi_block_data() -> None:
    g = torch.Generator().manual_seed(0)
    for n in (0, 7, 8, 8 * BLOCK_WORDS + 13, SLICE_BYTES + 4097):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert bytes_checksum(data).tolist() == _reference(data), n


def test_an_unaligned_view_is_summed_byte_by_byte_in_bounded_slices() -> None:
    data = torch.randint(0, 256, (2 * SLICE_BYTES + 9,), dtype=torch.uint8)[1:]
    assert data.data_ptr() % 8 != 0
    assert bytes_checksum(data).tolist() == _reference(data)


def test_a_changed_byte_and_swapped_blocks_change_the_checksum() -> None:
    x = torch.randn(3 * BLOCK_WORDS * 2, generator=torch.Generator().manual_seed(1))
    base = tensor_checksum(x)
    flipped = x.clone()
    as_bytes(flipped)[12345] ^= 1
    assert not torch.equal(tensor_checksum(flipped), base)
    swapped = x.clone()
    half = BLOCK_WORDS * 2  # one block of 8-byte words, in float32 elements
    swapped[:half], swapped[half : 2 * half] = x[half : 2 * half].clone(), x[:half].clone()
    assert swapped.sum() == x.sum()  # a plain sum would not see it
    assert not torch.equal(tensor_checksum(swapped), base)
    assert torch.equal(tensor_checksum(x.clone()), base)


def test_a_non_contiguous_tensor_sums_as_its_contiguous_copy() -> None:
    x = torch.randn(64, 48)
    assert torch.equal(tensor_checksum(x.t()), tensor_checksum(x.t().contiguous()))


def test_state_checksum_sees_the_optimizer_state_and_the_learning_rate() -> None:
    params = [torch.randn(100, 10), torch.randn(10)]
    opt = {"state": {0: {"exp_avg": torch.zeros(100, 10)}}, "param_groups": [{"lr": 1.0}]}
    base = state_checksum(params, opt, "lr=1")
    assert state_checksum([p.clone() for p in params], opt, "lr=1") == base
    assert state_checksum(params, opt, "lr=2") != base
    opt["state"][0]["exp_avg"][3, 3] = 1e-30
    assert state_checksum(params, opt, "lr=1") != base
