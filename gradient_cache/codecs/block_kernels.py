"""Block quantization to 1-8 bits: the kernels of `lowbit.BlockQuantized`.

A flat gradient is cut into blocks of `ROTATION_BLOCK` entries (the last one padded with
zeros), each optionally rotated (`rotation`), and each entry becomes a ``bits``-bit code
for one of ``L = 2**bits`` levels spread evenly over ``[-s, s]``, ``s`` the block's fp32
scale: level ``j`` is ``s * (2 j / (L - 1) - 1)``. Two roundings:

* ``"stochastic"``: ``s`` is the block's largest magnitude and each entry rounds to one of
  its two neighbouring levels with the probabilities that make the result unbiased
  (noise from `dither.Dither`);
* ``"sign"`` (1 bit only): the code is the sign and ``s`` the block's mean magnitude,
  the scaled sign that signSGD-style methods send: biased, with less variance.

Packed layout (one uint8 tensor): the codes of every padded entry, `bitpack.pack`ed, then
one fp32 scale per block. Non-finite entries make their block's scale non-finite, so the
whole block decodes to NaN or inf and a GradScaler still sees it.
Works a `BLOCK_CHUNK` at a time: fp32 temporaries stay a few MiB however large the tensor.
"""

from __future__ import annotations

import torch

from .bitpack import pack, packed_bytes, unpack
from .dither import WINDOW, Dither
from .int8_kernels import chunks
from .rotation import ROTATION_BLOCK, rotate_blocks, unrotate_blocks

ROUNDINGS = ("stochastic", "sign")


# Entries encoded at a time (a multiple of ROTATION_BLOCK and of 8, so chunks start on
# block boundaries and whole bytes of codes): each fp32 temporary is 1 MiB, and the
# dither tables (a table and its complement) twice that each: a backward's device scratch
# stays a few MiB.
BLOCK_CHUNK = WINDOW


def padded_numel(numel: int) -> int:
    return -(-numel // ROTATION_BLOCK) * ROTATION_BLOCK


def encoded_bytes(numel: int, bits: int) -> int:
    """Bytes of `encode`'s output for ``numel`` entries."""
    padded = padded_numel(numel)
    return packed_bytes(padded, bits) + 4 * (padded // ROTATION_BLOCK)


def _layout(packed: torch.Tensor, numel: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes bytes, fp32 scales) views of a packed payload."""
    padded = padded_numel(numel)
    split = packed_bytes(padded, bits)
    return packed[:split], packed[split:].view(torch.float32)


def encode(
    flat: torch.Tensor,
    *,
    bits: int,
    rotate: bool,
    rounding: str,
    dither: Dither,
) -> torch.Tensor:
    """``flat`` (any float dtype) as packed codes and scales; see the module docstring."""
    numel = flat.numel()
    packed = torch.empty(encoded_bytes(numel, bits), dtype=torch.uint8, device=flat.device)
    codes_out, scales_out = _layout(packed, numel, bits)
    top = (1 << bits) - 1
    for start, stop in chunks(numel, BLOCK_CHUNK):
        blocks = -(-(stop - start) // ROTATION_BLOCK)
        part = flat[start:stop].float()
        if part.numel() % ROTATION_BLOCK:  # the last chunk: zeros fill its last block
            part = torch.nn.functional.pad(part, (0, blocks * ROTATION_BLOCK - part.numel()))
        part = part.view(blocks, ROTATION_BLOCK)
        if rotate:
            part = rotate_blocks(part)
        if rounding == "sign":
            scales = part.abs().mean(dim=1)
            codes = (part >= 0).to(torch.uint8)
        else:
            scales = part.abs().amax(dim=1)
            safe = torch.where(scales > 0, scales, torch.ones_like(scales))
            # (x / s + 1) * top / 2 lies in [0, top]; adding U[0, 1) noise and flooring
            # rounds up with probability equal to the fraction: unbiased.
            level = part.div(safe.unsqueeze(1)).add_(1).mul_(top / 2)  # part may be the input
            level.add_(dither.uniform(level.numel(), flat.device).view_as(level)).floor_()
            # NaN (in a non-finite block) casts to an arbitrary byte: the mask keeps it a
            # valid code; the block's non-finite scale carries the news.
            codes = level.clamp_(0, top).to(torch.uint8).bitwise_and_(top)
        first = start // ROTATION_BLOCK
        scales_out[first : first + blocks].copy_(scales)
        byte = packed_bytes(start, bits)
        encoded = pack(codes.view(-1), bits)
        codes_out[byte : byte + encoded.numel()].copy_(encoded)
    return packed


def decode(packed: torch.Tensor, numel: int, *, bits: int, rotate: bool) -> torch.Tensor:
    """The fp32 gradient `encode` packed (a new flat tensor of ``numel`` entries)."""
    codes_in, scales_in = _layout(packed, numel, bits)
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    step = 2 / ((1 << bits) - 1)
    for start, stop in chunks(numel, BLOCK_CHUNK):
        blocks = -(-(stop - start) // ROTATION_BLOCK)
        count = blocks * ROTATION_BLOCK
        byte = packed_bytes(start, bits)
        codes = unpack(codes_in[byte : byte + packed_bytes(count, bits)], count, bits)
        first = start // ROTATION_BLOCK
        scales = scales_in[first : first + blocks].unsqueeze(1)
        part = codes.view(blocks, ROTATION_BLOCK).float().mul_(step).sub_(1).mul_(scales)
        if rotate:
            part = unrotate_blocks(part)
        out[start:stop] = part.view(-1)[: stop - start]
    return out
