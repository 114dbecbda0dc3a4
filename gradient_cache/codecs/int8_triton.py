"""The int8 codec's Triton kernels: one launch encodes a tensor, one decodes it.

The eager path (`int8_kernels`) costs about 19 dispatched operations per 2^18 entries to
encode and 8 to decode: at a few microseconds of host time each, a large model's hooks
would spend most of backward launching them, on the thread that launches backward's own
kernels. These kernels do the same arithmetic in one pass, with no temporaries: the same
bytes as the eager path (tests/test_triton_kernels.py checks it through Triton's
interpreter on the CPU). Importing this module needs Triton: `int8_kernels` imports it at
the first encode or decode of a CUDA tensor, where Triton is installed.

The kernel bodies are plain functions, jitted here (`ENCODE`, `DECODE`), so a test can
run the very same bodies interpreted (``triton.runtime.interpreter.InterpretedFunction``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .dither import WINDOW

# The compile options of every codec kernel, for PyTorch's arithmetic: each multiply and
# add rounded on its own (no fused multiply-add), and subnormals kept (Triton's default
# links libdevice's flush-to-zero functions: its floor of a negative subnormal gives 0).
OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}

# Blocks of 64 entries per program: 2048 entries, a divisor of a chunk, so a program's
# entries all read one noise window.
ROWS = 32


def window_start(seed, draw, WINDOW: tl.constexpr):
    """`dither.window_start` in uint64: where draw ``draw`` of the dither seeded ``seed``
    (modulo 2^64, as a signed int64) starts in its noise table."""
    h = seed.to(tl.uint64) * 0x9E3779B97F4A7C15 + draw.to(tl.uint64) * 0xBF58476D1CE4E5B9
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB
    h = h ^ (h >> 31)
    return ((h >> 63) * (2 * WINDOW) + (h & (WINDOW - 1))).to(tl.int64)


def encode_blocks(
    x_ptr,
    codes_ptr,
    scales_ptr,
    table_ptr,
    numel,
    blocks,
    seed,
    first_draw,
    scale_step,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """`int8_kernels.int8_blocks_encode` of ``ROWS`` blocks: codes and scales.

    ``seed`` is the dither's seed modulo 2^64 (as a signed int64) and ``first_draw`` the
    number of the draw that serves the tensor's first ``CHUNK`` entries, each later chunk
    the next: the window offsets are `dither.window_start`'s hash, computed here in uint64.
    """
    # A program's blocks lie in one chunk, and a chunk's draws in one noise window.
    tl.static_assert(CHUNK % (ROWS * BLOCK) == 0 and CHUNK <= WINDOW)
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    index = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(x_ptr + index, mask=index < numel, other=0.0).to(tl.float32)
    # NaN propagates into the scale as amax propagates it (a max instruction drops NaN).
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    scale = tl.where(has_nan, float("nan"), tl.max(tl.abs(x), axis=1)) * scale_step
    tl.store(scales_ptr + rows, scale, mask=rows < blocks)
    safe = tl.where(scale > 0, scale, 1.0)
    chunk = pid * ROWS * BLOCK // CHUNK
    start = WINDOW_START(seed, first_draw + chunk, WINDOW)
    noise = tl.load(table_ptr + start + (index - chunk * CHUNK))
    # The correctly rounded divide addcdiv makes (a plain `/` is approximate on a GPU).
    level = tl.floor(noise + tl.div_rn(x, safe[:, None]))
    tl.store(codes_ptr + index, level.to(tl.int8), mask=rows[:, None] < blocks)


def decode_blocks(codes_ptr, scales_ptr, out_ptr, numel, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """`int8_kernels.int8_blocks_decode` of ``ROWS`` blocks: each code times its scale."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    index = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = index < numel
    codes = tl.load(codes_ptr + index, mask=inside, other=0).to(tl.float32)
    scales = tl.load(scales_ptr + rows, mask=rows * BLOCK < numel, other=0.0)
    tl.store(out_ptr + index, codes * scales[:, None], mask=inside)


WINDOW_START: Any = triton.jit(window_start)
ENCODE: Any = triton.jit(encode_blocks, do_not_specialize=["seed", "first_draw"])
DECODE: Any = triton.jit(decode_blocks)


def encode(
    x: torch.Tensor,
    table: torch.Tensor,
    seed: int,
    first_draw: int,
    packed: torch.Tensor,
    *,
    block: int,
    scale_step: float,
    chunk: int,
    kernel: Any = ENCODE,
) -> None:
    """Launch ``kernel`` (`ENCODE`, or an interpreted body) over flat contiguous ``x``
    (any float dtype) into ``packed`` (`int8_kernels.int8_blocks_bytes` bytes), with
    ``block`` entries per scale and a noise window per ``chunk`` entries."""
    numel = x.numel()
    blocks = -(-numel // block)
    codes = packed[: blocks * block].view(torch.int8)
    scales = packed[blocks * block :].view(torch.float32)
    grid = (-(-blocks // ROWS),)
    kernel[grid](
        x,
        codes,
        scales,
        table,
        numel,
        blocks,
        seed,
        first_draw,
        scale_step,
        ROWS=ROWS,
        BLOCK=block,
        CHUNK=chunk,
        WINDOW=WINDOW,
        **OPTIONS,
    )


def decode(packed: torch.Tensor, out: torch.Tensor, *, block: int, kernel: Any = DECODE) -> None:
    """Launch ``kernel`` (`DECODE`, or an interpreted body): ``packed`` into flat
    contiguous fp32 ``out``, with ``block`` entries per scale."""
    numel = out.numel()
    blocks = -(-numel // block)
    codes = packed[: blocks * block].view(torch.int8)
    scales = packed[blocks * block :].view(torch.float32)
    grid = (-(-blocks // ROWS),)
    kernel[grid](codes, scales, out, numel, ROWS=ROWS, BLOCK=block, **OPTIONS)
