"""The block codecs' Triton kernels (q1-q4, sign): one launch encodes a tensor, one decodes.

Each program takes ``ROWS`` blocks of `rotation.ROTATION_BLOCK` entries and does what
`block_kernels.encode` and `decode` do a chunk at a time: the rotation's seven butterfly
stages, the scale, the rounding, the bit packing, in registers, with no temporaries.
Packed layout and noise draws are the eager path's, chunk by chunk (a chunk: a noise
window and a packing run). Importing this module needs Triton: `block_kernels`
imports it at the first encode or decode of a CUDA tensor. Every launch passes
`int8_triton.OPTIONS`: PyTorch's rounding, subnormals kept.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .dither import WINDOW
from .int8_triton import OPTIONS, WINDOW_START
from .rotation import ROTATION_BLOCK

# Blocks per program: 2048 entries, a divisor of a chunk.
ROWS = 16


def butterfly(x, ROWS: tl.constexpr, HALF: tl.constexpr):
    """One Walsh-Hadamard stage over ``[ROWS, 128]``: the halves ``a, b`` of each run of
    ``2 * HALF`` entries become ``a + b, a - b`` (`rotation._walsh_hadamard`'s order)."""
    pairs = tl.permute(tl.reshape(x, [ROWS, 64 // HALF, 2, HALF]), [0, 1, 3, 2])
    a, b = tl.split(pairs)
    joined = tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2])
    return tl.reshape(joined, [ROWS, 128])


def walsh_hadamard(x, ROWS: tl.constexpr):
    """Sylvester's unnormalised Hadamard transform of each row of ``[ROWS, 128]``."""
    x = BUTTERFLY(x, ROWS, 1)
    x = BUTTERFLY(x, ROWS, 2)
    x = BUTTERFLY(x, ROWS, 4)
    x = BUTTERFLY(x, ROWS, 8)
    x = BUTTERFLY(x, ROWS, 16)
    x = BUTTERFLY(x, ROWS, 32)
    return BUTTERFLY(x, ROWS, 64)


def halve(total, ROWS: tl.constexpr, HALF: tl.constexpr):
    """``[ROWS, 2 * HALF]`` to ``[ROWS, HALF]``: the first half plus the second."""
    first, second = tl.split(tl.permute(tl.reshape(total, [ROWS, 2, HALF]), [0, 2, 1]))
    return first + second


def mean_magnitude(x, ROWS: tl.constexpr):
    """Each row's mean |entry| over ``[ROWS, 128]``, in `block_kernels.mean_magnitude`'s
    order."""
    total = HALVE(tl.abs(x), ROWS, 64)
    total = HALVE(total, ROWS, 32)
    total = HALVE(total, ROWS, 16)
    total = HALVE(total, ROWS, 8)
    total = HALVE(total, ROWS, 4)
    total = HALVE(total, ROWS, 2)
    # Times 1/128, exact as the eager divide by 128 is (a `/` would be approximate).
    return tl.reshape(HALVE(total, ROWS, 1), [ROWS]) * (1.0 / 128)


def pack_run(codes, ROWS: tl.constexpr, BITS: tl.constexpr):
    """``[ROWS, 128]`` codes of ``BITS`` bits (a divisor of 8) as ``[ROWS, 128 * BITS / 8]``
    bytes, ``8 / BITS`` codes a byte, the first in the low bits (`bitpack.pack`)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    grouped = tl.reshape(codes.to(tl.int32), [ROWS, 128 // PER_BYTE, PER_BYTE])
    shifts = tl.arange(0, PER_BYTE) * BITS
    return tl.sum(grouped << shifts[None, None, :], axis=2).to(tl.uint8)


def unpack_run(packed, ROWS: tl.constexpr, BITS: tl.constexpr):
    """`pack_run`'s inverse: ``[ROWS, 128 * BITS / 8]`` bytes to ``[ROWS, 128]`` codes."""
    PER_BYTE: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER_BYTE) * BITS
    codes = (packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [ROWS, 128])


def encode_blocks(
    x_ptr,
    codes_ptr,
    scales_ptr,
    signs_ptr,
    table_ptr,
    numel,
    padded,
    seed,
    first_draw,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    LOW: tl.constexpr,
    ROTATE: tl.constexpr,
    SIGN: tl.constexpr,
    CHUNK: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """`block_kernels.encode` of ``ROWS`` blocks. ``LOW``: the bits of the first packing
    run (``BITS`` where it divides 8; 2 for 3-bit codes, whose third bit follows in a
    1-bit run after the chunk's first run, as `bitpack.pack` lays them). Each ``CHUNK``
    entries are a packing run and read one noise window (`int8_triton.window_start`)."""
    # A program's blocks lie in one chunk, and a chunk's draws in one noise window.
    tl.static_assert(CHUNK % (ROWS * 128) == 0 and CHUNK <= WINDOW)
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, 128)
    index = rows[:, None] * 128 + cols[None, :]
    x = tl.load(x_ptr + index, mask=index < numel, other=0.0).to(tl.float32)
    if ROTATE:
        x = WALSH_HADAMARD(x * tl.load(signs_ptr + cols)[None, :], ROWS)
    blocks = padded // 128
    TOP: tl.constexpr = (1 << BITS) - 1
    if SIGN:
        scale = MEAN_MAGNITUDE(x, ROWS)
        codes = (x >= 0).to(tl.int32)
    else:
        has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
        scale = tl.where(has_nan, float("nan"), tl.max(tl.abs(x), axis=1))
        safe = tl.where(scale > 0, scale, 1.0)
        level = (tl.div_rn(x, safe[:, None]) + 1.0) * (TOP / 2)
        chunk = pid * ROWS * 128 // CHUNK
        start = WINDOW_START(seed, first_draw + chunk, WINDOW)
        level = tl.floor(level + tl.load(table_ptr + start + (index - chunk * CHUNK)))
        # NaN casts to an arbitrary byte: the mask keeps it a code (the scale says NaN).
        codes = tl.minimum(tl.maximum(level, 0.0), TOP).to(tl.int32) & TOP
    tl.store(scales_ptr + rows, scale, mask=rows < blocks)
    # The packing run (a chunk) holding these blocks: its bytes start at `base`.
    run_start = pid * ROWS * 128 // CHUNK * CHUNK
    first = rows * 128 - run_start  # each block's first entry within its run
    base = run_start * BITS // 8
    inside = rows[:, None] < blocks
    low = PACK_RUN(codes & ((1 << LOW) - 1), ROWS, LOW)
    low_offsets = base + (first * LOW // 8)[:, None] + tl.arange(0, 128 * LOW // 8)[None, :]
    tl.store(codes_ptr + low_offsets, low, mask=inside)
    if LOW < BITS:  # the high bit, in a 1-bit run after the run's low bits
        run_bytes = tl.minimum(padded - run_start, CHUNK) * LOW // 8
        high = PACK_RUN(codes >> LOW, ROWS, 1)
        high_offsets = base + run_bytes + (first // 8)[:, None] + tl.arange(0, 16)[None, :]
        tl.store(codes_ptr + high_offsets, high, mask=inside)


def decode_blocks(
    codes_ptr,
    scales_ptr,
    signs_ptr,
    out_ptr,
    numel,
    padded,
    step,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    LOW: tl.constexpr,
    ROTATE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """`block_kernels.decode` of ``ROWS`` blocks into flat fp32 ``out``."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, 128)
    blocks = padded // 128
    inside = rows[:, None] < blocks
    run_start = pid * ROWS * 128 // CHUNK * CHUNK
    first = rows * 128 - run_start
    base = run_start * BITS // 8
    low_offsets = base + (first * LOW // 8)[:, None] + tl.arange(0, 128 * LOW // 8)[None, :]
    codes = UNPACK_RUN(tl.load(codes_ptr + low_offsets, mask=inside, other=0), ROWS, LOW)
    if LOW < BITS:
        run_bytes = tl.minimum(padded - run_start, CHUNK) * LOW // 8
        high_offsets = base + run_bytes + (first // 8)[:, None] + tl.arange(0, 16)[None, :]
        high = tl.load(codes_ptr + high_offsets, mask=inside, other=0)
        codes = codes | (UNPACK_RUN(high, ROWS, 1) << LOW)
    scales = tl.load(scales_ptr + rows, mask=rows < blocks, other=0.0)
    x = (codes.to(tl.float32) * step - 1.0) * scales[:, None]
    if ROTATE:
        x = WALSH_HADAMARD(x, ROWS) * tl.load(signs_ptr + cols)[None, :]
    index = rows[:, None] * 128 + cols[None, :]
    tl.store(out_ptr + index, x, mask=index < numel)


BUTTERFLY: Any = triton.jit(butterfly)
HALVE: Any = triton.jit(halve)
MEAN_MAGNITUDE: Any = triton.jit(mean_magnitude)
WALSH_HADAMARD: Any = triton.jit(walsh_hadamard)
PACK_RUN: Any = triton.jit(pack_run)
UNPACK_RUN: Any = triton.jit(unpack_run)
ENCODE: Any = triton.jit(encode_blocks, do_not_specialize=["seed", "first_draw"])
DECODE: Any = triton.jit(decode_blocks)


def low_bits(bits: int) -> int:
    """The bits of a code's first packing run: all of them where ``bits`` divides 8."""
    return 2 if bits == 3 else bits


def encode(
    x: torch.Tensor,
    packed: torch.Tensor,
    *,
    signs: torch.Tensor,
    table: torch.Tensor,
    seed: int,
    first_draw: int,
    bits: int,
    rotate: bool,
    sign: bool,
    chunk: int,
    kernel: Any = ENCODE,
) -> None:
    """Launch ``kernel`` over flat contiguous ``x`` into ``packed``
    (`block_kernels.encoded_bytes`); ``signs``: `rotation.scaled_signs`, ``table`` the
    dither's (unread for sign rounding); ``chunk``: entries per packing run and noise
    window (`block_kernels.BLOCK_CHUNK`)."""
    numel = x.numel()
    padded = -(-numel // ROTATION_BLOCK) * ROTATION_BLOCK
    split = padded * bits // 8
    scales = packed[split:].view(torch.float32)
    grid = (-(-padded // ROTATION_BLOCK // ROWS),)
    kernel[grid](
        x,
        packed,
        scales,
        signs,
        table,
        numel,
        padded,
        seed,
        first_draw,
        ROWS=ROWS,
        BITS=bits,
        LOW=low_bits(bits),
        ROTATE=rotate,
        SIGN=sign,
        CHUNK=chunk,
        WINDOW=WINDOW,
        **OPTIONS,
    )


def decode(
    packed: torch.Tensor,
    out: torch.Tensor,
    *,
    signs: torch.Tensor,
    bits: int,
    rotate: bool,
    chunk: int,
    kernel: Any = DECODE,
) -> None:
    """Launch ``kernel``: ``packed`` into flat contiguous fp32 ``out`` (``chunk``: entries
    per packing run)."""
    numel = out.numel()
    padded = -(-numel // ROTATION_BLOCK) * ROTATION_BLOCK
    scales = packed[padded * bits // 8 :].view(torch.float32)
    grid = (-(-padded // ROTATION_BLOCK // ROWS),)
    kernel[grid](
        packed,
        scales,
        signs,
        out,
        numel,
        padded,
        2 / ((1 << bits) - 1),
        ROWS=ROWS,
        BITS=bits,
        LOW=low_bits(bits),
        ROTATE=rotate,
        CHUNK=chunk,
        **OPTIONS,
    )
