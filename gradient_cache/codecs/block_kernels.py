"""Block quantization to 1-8 bits: the kernels of `lowbit.BlockQuantized`.

A flat gradient is cut into blocks of `ROTATION_BLOCK` entries (the last one padded with
zeros), each optionally rotated (`rotation`), and each entry becomes a ``bits``-bit code
for one of ``L = 2**bits`` levels spread evenly over ``[-s, s]``, ``s`` the block's fp32
scale: level ``j`` is ``s * (2 j / (L - 1) - 1)``. Two roundings:

* ``"stochastic"``: ``s`` is the block's largest magnitude and each entry rounds to one of
  its two neighbouring levels with the probabilities that make the result unbiased
  (noise from `dither.Dither`);
* ``"sign"`` (1 bit only): the code is the sign and ``s`` the block's mean magnitude
  (`mean_magnitude`), the scaled sign that signSGD-style methods send: biased, with less
  variance.

Packed layout (one uint8 tensor): the codes of every padded entry, `bitpack.pack`ed, then
one fp32 scale per block. Non-finite entries make their block's scale non-finite, so the
whole block decodes to NaN or inf and a GradScaler still sees it.
The eager path works a `BLOCK_CHUNK` at a time: fp32 temporaries stay a few MiB however
large the tensor. On CUDA, where Triton is installed (`int8_kernels.FUSED_DEVICE_TYPES`),
each encode and decode of 1-4 bit codes is one operation (``gradient_cache::block_encode``
/ ``block_decode``, one Triton kernel each: `block_triton`), with the same layout and noise.
"""

from __future__ import annotations

import torch

from . import int8_kernels
from .bitpack import pack, packed_bytes, unpack
from .dither import WINDOW, Dither, DrawsFrom, as_int64
from .int8_kernels import UniformNoise, chunks
from .rotation import ROTATION_BLOCK, rotate_blocks, scaled_signs, unrotate_blocks

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


def mean_magnitude(blocks: torch.Tensor) -> torch.Tensor:
    """Each row's mean |entry|, summed by halving (the first half plus the second, seven
    times): an order the fused kernel takes too, and every device, where ``mean()`` sums
    in an order each device's reduction picks."""
    total = blocks.abs()
    width = ROTATION_BLOCK
    while width > 1:
        width //= 2
        total = total[:, :width] + total[:, width : 2 * width]
    return total[:, 0] / ROTATION_BLOCK


# Code widths the fused kernels pack (the codecs' q1-q4 and sign).
FUSED_BITS = (1, 2, 3, 4)


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
    fused = flat.device.type in int8_kernels.FUSED_DEVICE_TYPES and flat.is_contiguous()
    if fused and bits in FUSED_BITS:
        sign = rounding == "sign"
        first = dither.take(noise_windows(numel, rounding))
        if numel:
            table, seed = dither.table(flat.device), as_int64(dither.seed)
            signs = scaled_signs(flat.device)
            torch.ops.gradient_cache.block_encode(
                flat, table, signs, seed, first, bits, rotate, sign, packed
            )
        return packed
    encode_eagerly(flat, packed, bits=bits, rotate=rotate, rounding=rounding, noise=dither)
    return packed


def noise_windows(numel: int, rounding: str) -> int:
    """The dither draws (noise windows) an encode of ``numel`` entries takes: one a chunk
    for stochastic rounding, as the eager path draws them; none for sign rounding."""
    return 0 if rounding == "sign" else -(-numel // BLOCK_CHUNK)


def encode_eagerly(
    flat: torch.Tensor,
    packed: torch.Tensor,
    *,
    bits: int,
    rotate: bool,
    rounding: str,
    noise: UniformNoise,
) -> None:
    """`encode` into ``packed`` in PyTorch operations, a `BLOCK_CHUNK` at a time."""
    numel = flat.numel()
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
            scales = mean_magnitude(part)
            codes = (part >= 0).to(torch.uint8)
        else:
            scales = part.abs().amax(dim=1)
            safe = torch.where(scales > 0, scales, torch.ones_like(scales))
            # (x / s + 1) * top / 2 lies in [0, top]; adding U[0, 1) noise and flooring
            # rounds up with probability equal to the fraction: unbiased.
            level = part.div(safe.unsqueeze(1)).add_(1).mul_(top / 2)  # part may be the input
            level.add_(noise.uniform(level.numel(), flat.device).view_as(level)).floor_()
            # NaN (in a non-finite block) casts to an arbitrary byte: the mask keeps it a
            # valid code; the block's non-finite scale carries the news.
            codes = level.clamp_(0, top).to(torch.uint8).bitwise_and_(top)
        first = start // ROTATION_BLOCK
        scales_out[first : first + blocks].copy_(scales)
        byte = packed_bytes(start, bits)
        encoded = pack(codes.view(-1), bits)
        codes_out[byte : byte + encoded.numel()].copy_(encoded)


def decode(
    packed: torch.Tensor,
    numel: int,
    *,
    bits: int,
    rotate: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 gradient `encode` packed: into ``out`` (flat fp32, ``numel`` entries, on
    ``packed``'s device) if given, else a new tensor."""
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    fused = packed.device.type in int8_kernels.FUSED_DEVICE_TYPES and packed.is_contiguous()
    fits = out.dtype == torch.float32 and out.numel() == numel and out.is_contiguous()
    if fused and fits and bits in FUSED_BITS and packed.numel() == encoded_bytes(numel, bits):
        if numel:
            signs = scaled_signs(packed.device)
            torch.ops.gradient_cache.block_decode(packed, signs, bits, rotate, out)
        return out
    return decode_eagerly(packed, numel, out, bits=bits, rotate=rotate)


def decode_eagerly(
    packed: torch.Tensor, numel: int, out: torch.Tensor, *, bits: int, rotate: bool
) -> torch.Tensor:
    """`decode` of ``numel`` entries into ``out`` in PyTorch operations, a `BLOCK_CHUNK`
    at a time."""
    codes_in, scales_in = _layout(packed, numel, bits)
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


@torch.library.custom_op("gradient_cache::block_encode", mutates_args=("packed",))
def _fused_encode(
    flat: torch.Tensor,
    table: torch.Tensor,
    signs: torch.Tensor,
    seed: int,
    first_draw: int,
    bits: int,
    rotate: bool,
    sign: bool,
    packed: torch.Tensor,
) -> None:
    """`encode` of flat contiguous ``flat`` into ``packed`` as one operation, rounding with
    the windows of draws ``first_draw`` on of the dither seeded ``seed`` (``table``: its
    noise table) or by sign; ``signs``: `rotation.scaled_signs`. One Triton kernel on
    CUDA, the eager path elsewhere."""
    rounding = "sign" if sign else "stochastic"

    def eager() -> None:
        noise = DrawsFrom(seed, first_draw, table)
        encode_eagerly(flat, packed, bits=bits, rotate=rotate, rounding=rounding, noise=noise)

    if flat.device.type == "cuda":

        def launch() -> None:
            from . import block_triton  # Triton loads at the first CUDA launch, not at import

            block_triton.encode(
                flat,
                packed,
                signs=signs,
                table=table,
                seed=seed,
                first_draw=first_draw,
                bits=bits,
                rotate=rotate,
                sign=sign,
                chunk=BLOCK_CHUNK,
            )

        kernel = ("block_encode", flat.dtype, bits, rotate, sign)
        int8_kernels.run_fused(kernel, launch, eager)
    else:
        eager()


@torch.library.custom_op("gradient_cache::block_decode", mutates_args=("out",))
def _fused_decode(
    packed: torch.Tensor, signs: torch.Tensor, bits: int, rotate: bool, out: torch.Tensor
) -> None:
    """`decode` into flat contiguous fp32 ``out`` as one operation: one Triton kernel on
    CUDA, the eager path elsewhere."""

    def eager() -> None:
        decode_eagerly(packed, out.numel(), out, bits=bits, rotate=rotate)

    if packed.device.type == "cuda":

        def launch() -> None:
            from . import block_triton

            block_triton.decode(
                packed, out, signs=signs, bits=bits, rotate=rotate, chunk=BLOCK_CHUNK
            )

        int8_kernels.run_fused(("block_decode", bits, rotate), launch, eager)
    else:
        eager()
