"""Runs the int8 Triton kernels through Triton's interpreter and prints, per case, whether
they give the eager path's bytes (tests/test_int8_triton.py starts it).

A script, not a test: the interpreter takes over only where ``TRITON_INTERPRET=1`` was set
before Triton was imported, and a test process may have imported it already.
"""

from __future__ import annotations

import json
import math
import os

import torch

from gradient_cache.codecs import int8_kernels, int8_triton
from gradient_cache.codecs.dither import Dither

CHUNK = int8_kernels.CODEC_CHUNK
# (entries, dither seed, draws before, dtype, non-finite entries at)
CASES = [
    (1, 0, 0, torch.float32, ()),
    (65, 3, 2, torch.float32, ()),
    (6151, 2**64 - 5, 7, torch.float32, ()),  # a seed stored as a negative int64
    (6151, 11, 0, torch.bfloat16, ()),
    (CHUNK + 100, 7, 1, torch.float32, ()),  # two noise windows
    (4096, 5, 0, torch.float32, ((3, math.nan), (200, math.inf), (1000, -math.inf))),
]


def check(numel: int, seed: int, before: int, dtype: torch.dtype, bad: tuple) -> dict:
    torch.manual_seed(numel)
    x = (torch.randn(numel) * torch.logspace(-30, 3, numel)).to(dtype)
    x[numel // 2 :: 97] = 0.0  # some all-zero blocks' worth of zeros
    for index, value in bad:
        x[index] = value
    eager, fused = Dither(seed), Dither(seed)
    eager.take(before), fused.take(before)
    expected = torch.empty(int8_kernels.int8_blocks_bytes(numel), dtype=torch.uint8)
    int8_kernels.encode_eagerly(x.float(), eager, expected)
    packed = torch.full_like(expected, 0xA5)  # a byte no path may leave
    first = fused.take(-(-numel // CHUNK))
    signed = seed % 2**64 - (seed % 2**64 >= 2**63) * 2**64
    int8_triton.encode(
        x,
        fused.table(x.device),
        signed,
        first,
        packed,
        block=int8_kernels.INT8_BLOCK,
        scale_step=int8_kernels.SCALE_STEP,
    )
    decoded = torch.full((numel,), 123.0)
    int8_triton.decode(packed, decoded, block=int8_kernels.INT8_BLOCK)
    reference = int8_kernels.decode_eagerly(expected, numel, torch.empty(numel))
    blocks = -(-numel // int8_kernels.INT8_BLOCK)
    finite = torch.isfinite(packed[blocks * int8_kernels.INT8_BLOCK :].view(torch.float32))
    codes_match = torch.equal(
        packed[: blocks * 64].view(blocks, 64)[finite],
        expected[: blocks * 64].view(blocks, 64)[finite],
    )
    return {
        "case": f"{numel} entries, {dtype}, seed {seed}, {len(bad)} non-finite",
        "scales": torch.equal(
            packed[blocks * 64 :].view(torch.float32).nan_to_num(1.5),
            expected[blocks * 64 :].view(torch.float32).nan_to_num(1.5),
        ),
        "codes": codes_match,
        "non-finite blocks": int((~finite).sum()),
        "decoded": torch.equal(decoded.nan_to_num(1.5), reference.nan_to_num(1.5)),
        "draws": [eager._draws, fused._draws],
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for case in CASES:
        print(json.dumps(check(*case)))
