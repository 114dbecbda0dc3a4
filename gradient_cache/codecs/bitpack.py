"""Packing codes of 1 to 8 bits into bytes, and back."""

from __future__ import annotations

import torch


def packed_bytes(count: int, bits: int) -> int:
    """Bytes `pack` makes of ``count`` codes of ``bits`` bits (``count`` a multiple of 8)."""
    return count * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``codes`` (each below ``2**bits``; length a multiple of 8) packed densely.

    Widths that divide 8 put ``8 // bits`` codes in each byte; 3 bits are the 2-bit
    packing of the low bits followed by the 1-bit packing of the high bit.
    """
    if 8 % bits:
        low = bits - 1 if bits in (3, 5) else 4
        return torch.cat([pack(codes & ((1 << low) - 1), low), pack(codes >> low, bits - low)])
    per_byte = 8 // bits
    grouped = codes.view(-1, per_byte)
    out = grouped[:, 0].clone()
    for slot in range(1, per_byte):
        out.bitwise_or_(grouped[:, slot] << (slot * bits))
    return out


def unpack(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The ``count`` uint8 codes `pack` packed."""
    if 8 % bits:
        low = bits - 1 if bits in (3, 5) else 4
        split = packed_bytes(count, low)
        return unpack(packed[:split], count, low) | (
            unpack(packed[split:], count, bits - low) << low
        )
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & mask).view(-1)[:count]
