"""First the package where Triton is absent (its first JSON line), then the codecs'
Triton kernels through Triton's interpreter: a JSON line per case saying whether they give
the eager path's bytes, decodes and dither draws (tests/test_triton_kernels.py starts it).

A script, not a test: the interpreter takes over only where ``TRITON_INTERPRET=1`` was set
before Triton was imported, and a test process may have imported it already. Most cases
run with 4096-entry chunks (each chunk a noise window, and for the block codes a packing
run), so that several chunks stay cheap to interpret; one int8 case runs the real size.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

sys.modules["triton"] = None  # type: ignore[assignment]  # absent while the package loads
from gradient_cache.codecs import block_kernels, int8_kernels  # noqa: E402
from gradient_cache.codecs.dither import Dither, as_int64  # noqa: E402
from gradient_cache.codecs.registry import make_codec  # noqa: E402
from gradient_cache.codecs.rotation import scaled_signs  # noqa: E402


def without_triton() -> dict:
    """What the package does where Triton is absent: no fused device type, and the CUDA
    path's eager code (the compiled CPU kernels off) encodes within int8's bound."""
    int8_kernels.CPU_KERNELS, kernels = None, int8_kernels.CPU_KERNELS
    x = torch.randn(1000)
    payload, _ = make_codec("int8").encode(x, None, loss_scale=None)
    int8_kernels.CPU_KERNELS = kernels
    return {
        "case": "without triton",
        "fused device types": sorted(int8_kernels.FUSED_DEVICE_TYPES),
        "error": float((payload.kept_values() - x).abs().max() / x.abs().max()),
    }


RESULT_WITHOUT_TRITON = without_triton()
del sys.modules["triton"]
from gradient_cache.codecs import block_triton, int8_triton  # noqa: E402

SMALL_CHUNK = 4096
CPU = torch.device("cpu")


def gradient(numel: int, dtype: torch.dtype, bad: tuple = ()) -> torch.Tensor:
    """Magnitudes over 33 decades, some zeros, ``bad``: (index, non-finite value) pairs."""
    torch.manual_seed(numel)
    x = (torch.randn(numel) * torch.logspace(-30, 3, numel)).to(dtype)
    x[numel // 2 :: 97] = 0.0
    for index, value in bad:
        x[index] = value
    return x


def compare(packed: torch.Tensor, expected: torch.Tensor, split: int) -> dict:
    """Scales alike (NaN as NaN) and codes alike outside non-finite blocks, whose codes are
    whatever NaN casts to (the scale carries the news)."""
    scales, expected_scales = (
        packed[split:].view(torch.float32),
        expected[split:].view(torch.float32),
    )
    finite = torch.isfinite(scales)
    codes = packed[:split].view(finite.numel(), -1)
    return {
        "scales": torch.equal(scales.nan_to_num(1.5), expected_scales.nan_to_num(1.5)),
        "codes": torch.equal(codes[finite], expected[:split].view_as(codes)[finite]),
        "non-finite blocks": int((~finite).sum()),
    }


def int8_case(numel: int, seed: int, before: int, dtype: torch.dtype, bad: tuple = ()) -> dict:
    x = gradient(numel, dtype, bad)
    eager, fused = Dither(seed), Dither(seed)
    eager.take(before), fused.take(before)
    expected = torch.empty(int8_kernels.int8_blocks_bytes(numel), dtype=torch.uint8)
    int8_kernels.encode_eagerly(x.float(), eager, expected)
    packed = torch.full_like(expected, 0xA5)  # a byte no path may leave
    first = fused.take(int8_kernels.noise_windows(numel))  # as the fused operation takes
    int8_triton.encode(
        x,
        fused.table(CPU),
        as_int64(seed),
        first,
        packed,
        block=int8_kernels.INT8_BLOCK,
        scale_step=int8_kernels.SCALE_STEP,
        chunk=int8_kernels.CODEC_CHUNK,
    )
    decoded = torch.full((numel,), 123.0)
    int8_triton.decode(packed, decoded, block=int8_kernels.INT8_BLOCK)
    reference = int8_kernels.decode_eagerly(expected, numel, torch.empty(numel))
    split = -(-numel // int8_kernels.INT8_BLOCK) * int8_kernels.INT8_BLOCK
    return {
        "case": f"int8, {numel} entries, chunk {int8_kernels.CODEC_CHUNK}, {dtype}, seed {seed}",
        **compare(packed, expected, split),
        "decoded": torch.equal(decoded.nan_to_num(1.5), reference.nan_to_num(1.5)),
        "draws": [eager._draws, fused._draws],
    }


def block_case(
    numel: int, bits: int, rotate: bool, rounding: str, dtype: torch.dtype, bad: tuple = ()
) -> dict:
    x = gradient(numel, dtype, bad)
    eager, fused = Dither(9), Dither(9)
    expected = torch.empty(block_kernels.encoded_bytes(numel, bits), dtype=torch.uint8)
    options = dict(bits=bits, rotate=rotate)
    block_kernels.encode_eagerly(x, expected, rounding=rounding, noise=eager, **options)
    packed = torch.full_like(expected, 0xA5)
    sign = rounding == "sign"
    first = fused.take(block_kernels.noise_windows(numel, rounding))
    chunk = block_kernels.BLOCK_CHUNK
    signs = scaled_signs(CPU)
    block_triton.encode(
        x,
        packed,
        signs=signs,
        table=fused.table(CPU),
        seed=as_int64(9),
        first_draw=first,
        sign=sign,
        chunk=chunk,
        **options,
    )
    decoded = torch.full((numel,), 123.0)
    block_triton.decode(packed, decoded, signs=signs, chunk=chunk, **options)
    reference = block_kernels.decode_eagerly(expected, numel, torch.empty(numel), **options)
    split = block_kernels.padded_numel(numel) * bits // 8
    return {
        "case": f"q{bits} {rounding} rotate={rotate}, {numel} entries, chunk {chunk}, {dtype}",
        **compare(packed, expected, split),
        "decoded": torch.equal(decoded.nan_to_num(1.5), reference.nan_to_num(1.5)),
        "draws": [eager._draws, fused._draws],
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(json.dumps(RESULT_WITHOUT_TRITON))
    bad = ((3, math.nan), (200, math.inf), (1000, -math.inf))  # three blocks of each kind
    cases = [int8_case(int8_kernels.CODEC_CHUNK + 100, 7, 1, torch.float32)]
    int8_kernels.CODEC_CHUNK = block_kernels.BLOCK_CHUNK = SMALL_CHUNK
    cases += [
        int8_case(1, 0, 0, torch.float32),
        int8_case(65, 3, 2, torch.float32),
        int8_case(3 * SMALL_CHUNK + 7, 2**64 - 5, 7, torch.float32),  # a negative int64 seed
        int8_case(2 * SMALL_CHUNK + 100, 11, 0, torch.bfloat16),
        int8_case(4096, 5, 0, torch.float32, bad),
        block_case(1, 4, True, "stochastic", torch.float32),
        block_case(2 * SMALL_CHUNK + 300, 4, True, "stochastic", torch.float32, bad),
        block_case(2 * SMALL_CHUNK + 300, 3, True, "stochastic", torch.bfloat16),
        block_case(2 * SMALL_CHUNK + 300, 2, False, "stochastic", torch.float32),
        block_case(2 * SMALL_CHUNK + 300, 1, True, "sign", torch.float32),
        block_case(2 * SMALL_CHUNK + 300, 1, False, "stochastic", torch.float32),
    ]
    for case in cases:
        print(json.dumps(case))
