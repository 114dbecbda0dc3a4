"""perf/bf16_transport.py's carry-bit transport (issue 51, item 1): the upper 16 bits of an
fp32 master plus one packed carry bit decode to exactly the bf16 that PyTorch's cast gives
(``master.to(torch.bfloat16)``, round to nearest even), compared as int16 bits; NaN stays
NaN (its payload may differ from the cast's)."""

from __future__ import annotations

import pytest
import torch

from perf.bf16_transport import (
    carry_bytes,
    carry_decode,
    carry_encode,
    carry_roundtrip,
    edge_case_bits,
    nan_bits,
    random_bits,
)


def fp32(*patterns: int) -> torch.Tensor:
    """fp32 values from unsigned 32-bit patterns."""
    signed = [p - (1 << 32) if p >= 1 << 31 else p for p in patterns]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def assert_cast_bits(master: torch.Tensor) -> None:
    """(B) gives the cast's bits on every non-NaN entry, and a NaN on every NaN entry."""
    cast, carried = master.to(torch.bfloat16), carry_roundtrip(master)
    assert carried.dtype == torch.bfloat16 and carried.shape == master.shape
    nan = master.isnan()
    assert torch.equal(carried.isnan(), nan)
    differ = (cast.view(torch.int16) != carried.view(torch.int16)) & ~nan
    assert not differ.any(), (
        f"{int(differ.sum())} differ, first fp32 bits "
        f"{master[differ][:4].view(torch.int32).tolist()}"
    )


@pytest.mark.parametrize("kind", list(edge_case_bits()))
def test_edge_cases_equal_the_cast_bit_for_bit(kind: str) -> None:
    assert_cast_bits(edge_case_bits()[kind].view(torch.float32))


def test_ties_round_to_even_both_ways() -> None:
    """A tie (lower half 0x8000) goes up from an odd upper half, stays on an even one; its
    neighbours go down (0x7FFF) and up (0x8001); the largest finite values round to inf."""
    master = fp32(
        0x3F808000,
        0x3F818000,
        0x3F807FFF,
        0x3F808001,
        0xBF818000,
        0x7F7F8000,
        0x7F7E8000,
        0xFF7FFFFF,
        0x00018000,
    )
    expected = [0x3F80, 0x3F82, 0x3F80, 0x3F81, 0xBF82 - 0x10000, 0x7F80, 0x7F7E, -128, 0x0002]
    assert carry_roundtrip(master).view(torch.int16).tolist() == expected
    assert master.to(torch.bfloat16).view(torch.int16).tolist() == expected


def test_specials_and_zeros_keep_their_sign() -> None:
    master = fp32(0, 0x80000000, 0x7F800000, 0xFF800000, 1, 0x80000001)
    bits = carry_roundtrip(master).view(torch.int16).tolist()
    assert bits == [0, -0x8000, 0x7F80, 0xFF80 - 0x10000, 0, -0x8000]


@pytest.mark.parametrize("seed", range(8))
def test_random_bits_and_weights_equal_the_cast(seed: int) -> None:
    """About 32,000 values per seed: under torch's grain size (32,768), so each operation
    runs on one thread and a busy machine's OpenMP spin-waits do not slow the test."""
    bits = random_bits(seed, 16_001)
    assert bits.numel() < 32_768
    assert_cast_bits(bits.view(torch.float32))


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 63, 65])
def test_lengths_that_are_not_a_multiple_of_eight(numel: int) -> None:
    master = random_bits(numel, 64)[:numel].view(torch.float32)
    assert_cast_bits(master)
    upper = torch.empty(numel, dtype=torch.int16)
    carry = torch.full((carry_bytes(numel),), 0xAB, dtype=torch.uint8)
    carry_encode(master, upper, carry)
    if numel % 8:  # the padding bits of the last byte are zero
        assert int(carry[-1]) >> (numel % 8) == 0


def test_carry_bits_are_packed_lowest_bit_first() -> None:
    """Element 8 j + i's carry is bit i of byte j: a single rounding-up entry at 10 sets
    bit 2 of byte 1."""
    master = torch.zeros(16)
    master[10] = fp32(0x3F80C000)
    upper = torch.empty(16, dtype=torch.int16)
    carry = torch.empty(2, dtype=torch.uint8)
    carry_encode(master, upper, carry)
    assert carry.tolist() == [0, 1 << 2]
    assert upper[10] == 0x3F80


def test_shapes_are_kept() -> None:
    master = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1))
    upper = torch.empty(3, 5, 7, dtype=torch.int16)
    carry = torch.empty(carry_bytes(105), dtype=torch.uint8)
    carry_encode(master, upper, carry)
    out = torch.empty(3, 5, 7, dtype=torch.bfloat16)
    carry_decode(upper, carry, out)
    assert torch.equal(out.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))


def test_nan_stays_nan() -> None:
    """Payloads only in the lower half would truncate to inf, upper half 0x7FFF or 0xFFFF
    plus a carry would wrap to a zero: each decodes to a NaN."""
    master = nan_bits().view(torch.float32)
    assert master.isnan().all()
    assert carry_roundtrip(master).isnan().all()
    assert master.to(torch.bfloat16).isnan().all()


def test_nan_among_numbers_leaves_the_numbers_exact() -> None:
    master = torch.cat([random_bits(7, 1000).view(torch.float32), nan_bits().view(torch.float32)])
    assert_cast_bits(master[torch.randperm(master.numel())])


def test_non_contiguous_master_is_refused() -> None:
    master = torch.randn(4, 4).t()
    with pytest.raises(ValueError, match="contiguous float32"):
        carry_encode(master, torch.empty(16, dtype=torch.int16), torch.empty(2, dtype=torch.uint8))
