"""Int8 block quantization: an int8 code per entry and an fp32 scale per block of 64.

The kernels shared by int8 values (`values.Int8Quantizer`) and the int8 residual
(`residual.ResidualCodec`). Rounding is stochastic, so decoding is unbiased.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .generators import DeviceGenerators

# Entries per scale: 64 keeps the scales at 1/16 of the int8 bytes.
INT8_BLOCK = 64
# Entries the codecs work on at a time (a multiple of INT8_BLOCK): their fp32 temporaries
# stay within a few MiB of device memory however large the tensor.
CODEC_CHUNK = 1 << 20


def int8_blocks_bytes(numel: int) -> int:
    """Bytes of `int8_blocks_encode`'s output: a code per entry in whole blocks, a scale each."""
    blocks = -(-numel // INT8_BLOCK)
    return blocks * INT8_BLOCK + 4 * blocks


def chunks(numel: int, size: int = CODEC_CHUNK) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive ``size``-entry slices covering ``numel`` entries."""
    for start in range(0, numel, size):
        yield start, min(start + size, numel)


def int8_blocks_encode(x: torch.Tensor, generators: DeviceGenerators) -> torch.Tensor:
    """Flat fp32 ``x`` as int8 codes per block of `INT8_BLOCK`, times the block's scale.

    The scale is the block's largest magnitude / 127; uniform noise from ``generators``
    rounds each code stochastically, so decoding is unbiased and off by less than the
    scale. Codes and fp32 scales are packed into one uint8 tensor. Works through ``x`` a
    chunk at a time, so its fp32 temporaries stay a few MiB however large ``x`` is.
    """
    numel = x.numel()
    blocks = -(-numel // INT8_BLOCK)
    packed = torch.empty(int8_blocks_bytes(numel), dtype=torch.uint8, device=x.device)
    codes = packed[: blocks * INT8_BLOCK].view(torch.int8)
    scales = packed[blocks * INT8_BLOCK :].view(torch.float32)
    for start, stop in chunks(numel):
        part_blocks = -(-(stop - start) // INT8_BLOCK)
        padded = torch.nn.functional.pad(
            x[start:stop], (0, part_blocks * INT8_BLOCK - stop + start)
        )
        padded = padded.view(part_blocks, INT8_BLOCK)  # a copy: free to scale in place
        part_scales = padded.abs().amax(dim=1).div_(127)
        safe = torch.where(part_scales > 0, part_scales, torch.ones_like(part_scales))
        # |x / s| <= 127 and noise < 1, so floor stays within [-127, 127].
        padded.div_(safe.unsqueeze(1)).add_(generators.uniform_like(padded)).floor_()
        codes[start : start + padded.numel()].copy_(padded.view(-1))
        scales[start // INT8_BLOCK : start // INT8_BLOCK + part_blocks].copy_(part_scales)
    return packed


def int8_blocks_decode(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values `int8_blocks_encode` packed (a new tensor), a chunk at a time."""
    blocks = -(-numel // INT8_BLOCK)
    codes = packed[: blocks * INT8_BLOCK].view(torch.int8)
    scales = packed[blocks * INT8_BLOCK :].view(torch.float32)
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    for start, stop in chunks(numel):
        part_blocks = -(-(stop - start) // INT8_BLOCK)
        part = codes[start : start + part_blocks * INT8_BLOCK].view(part_blocks, INT8_BLOCK)
        part_scales = scales[start // INT8_BLOCK : start // INT8_BLOCK + part_blocks]
        out[start:stop] = (part.float() * part_scales.unsqueeze(1)).view(-1)[: stop - start]
    return out
