"""A fixed random orthogonal rotation of blocks of `ROTATION_BLOCK` entries.

Block quantization sets each block's step from its largest magnitude, so one outlier
coarsens every other entry of its block. Rotating a block by a randomised Hadamard matrix
(fixed pseudo-random signs, then the Walsh-Hadamard transform, scaled to be orthonormal)
spreads an outlier's mass evenly over the block first; the inverse rotation after decoding
puts it back. The rotation is orthonormal, so rounding noise keeps its size through it and
an unbiased rounding stays unbiased.

`rotate_blocks` and `unrotate_blocks` apply it as a fast Walsh-Hadamard transform: log2(128) = 7
butterfly stages of fp32 adds and subtracts, no matrix multiply. A matmul would run in
TF32 under ``torch.set_float32_matmul_precision("high")`` (common on Hopper: orthonormal
to about 1e-4 only) and sum in an order each device's library picks; the butterflies are
exact fp32 elementwise arithmetic in a fixed order, so a payload decodes to the same bits
on every device and under every precision setting. Their constants are built on the
device from integer arithmetic (no host-to-device copy, so no synchronisation in a
backward hook) and kept for the process: under 1 KiB per device.
"""

from __future__ import annotations

import torch

ROTATION_BLOCK = 128
# The signs are part of the payload format: a payload decodes with the rotation it was
# encoded with, so they come from a fixed hash of the index, not from a generator.
_SIGN_HASH = 0x9E3779B1
# Per device: the signs scaled by 1 / sqrt(ROTATION_BLOCK), and the butterfly's (+1, -1).
_constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _parity(bits: torch.Tensor) -> torch.Tensor:
    """Parity of the low 32 bits of each int64 entry."""
    for shift in (16, 8, 4, 2, 1):
        bits = bits ^ (bits >> shift)
    return bits & 1


def _signs(device: torch.device) -> torch.Tensor:
    index = torch.arange(ROTATION_BLOCK, dtype=torch.int64, device=device)
    return 1 - 2 * _parity((index * _SIGN_HASH) & 0xFFFFFFFF)


def _constants_on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    constants = _constants.get(device)
    if constants is None:
        scaled_signs = _signs(device).float() / ROTATION_BLOCK**0.5
        plus_minus = (1 - 2 * torch.arange(2, device=device)).float().unsqueeze(1)
        constants = _constants[device] = (scaled_signs, plus_minus)
    return constants


def _walsh_hadamard(blocks: torch.Tensor, plus_minus: torch.Tensor) -> torch.Tensor:
    """``blocks @ H`` for Sylvester's unnormalised Hadamard ``H`` of order ROTATION_BLOCK,
    in butterflies: the halves ``a, b`` of each run of ``2 h`` entries become
    ``a + b, a - b`` (one addcmul: ``b * (+-1)`` is exact, so each output rounds once)."""
    rows = blocks.shape[0]
    half = 1
    while half < ROTATION_BLOCK:
        pairs = blocks.view(rows, ROTATION_BLOCK // (2 * half), 2, half)
        blocks = torch.addcmul(pairs[:, :, :1], pairs[:, :, 1:], plus_minus)
        blocks = blocks.view(rows, ROTATION_BLOCK)
        half *= 2
    return blocks


def rotate_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks @ rotation(device)`` for fp32 ``blocks`` of shape ``[n, ROTATION_BLOCK]``,
    in fp32 whatever the matmul precision (a new tensor)."""
    scaled_signs, plus_minus = _constants_on(blocks.device)
    return _walsh_hadamard(blocks * scaled_signs, plus_minus)


def unrotate_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks @ rotation(device).T``: `rotate_blocks`'s inverse, in fp32 (a new tensor)."""
    scaled_signs, plus_minus = _constants_on(blocks.device)
    return _walsh_hadamard(blocks, plus_minus).mul_(scaled_signs)


def scaled_signs(device: torch.device) -> torch.Tensor:
    """The rotation's signs divided by sqrt(ROTATION_BLOCK) (fp32, kept for the process):
    a fused kernel's constants."""
    return _constants_on(device)[0]


def rotation(device: torch.device) -> torch.Tensor:
    """The fp32 ``[ROTATION_BLOCK, ROTATION_BLOCK]`` orthonormal matrix ``R`` that `rotate_blocks`
    applies: a row block ``x`` rotates to ``x @ R`` and back with ``y @ R.T``. Built on
    each call (the codecs never multiply by it; it states the format)."""
    index = torch.arange(ROTATION_BLOCK, dtype=torch.int64, device=device)
    # Sylvester's Hadamard matrix: H[i, j] = (-1) ** popcount(i & j).
    hadamard = 1 - 2 * _parity(index.unsqueeze(1) & index.unsqueeze(0))
    return (_signs(device).unsqueeze(1) * hadamard).float() / ROTATION_BLOCK**0.5


def built_constants() -> list[torch.Tensor]:
    """The constants built so far, two per device (`figures.cache_tensors` lists them)."""
    return [tensor for constants in _constants.values() for tensor in constants]
