"""A fixed random orthogonal rotation of blocks of `ROTATION_BLOCK` entries.

Block quantization sets each block's step from its largest magnitude, so one outlier
coarsens every other entry of its block. Rotating a block by a randomised Hadamard matrix
(fixed pseudo-random signs, then the Walsh-Hadamard transform, scaled to be orthonormal)
spreads an outlier's mass evenly over the block first; the inverse rotation after decoding
puts it back. The rotation is orthonormal, so rounding noise keeps its size through it and
an unbiased rounding stays unbiased.

It is one matrix multiply per block in each direction (2 x 128 multiply-adds an entry):
on a GPU far below the memory traffic of the codec's other passes. The matrix is built
on the device from integer arithmetic (no host-to-device copy, so no synchronisation in a
backward hook; the same bits on every device, so a payload decodes anywhere) and kept for
the process: 64 KiB per device.
"""

from __future__ import annotations

import torch

ROTATION_BLOCK = 128
# The signs are part of the payload format: a payload decodes with the rotation it was
# encoded with, so they come from a fixed hash of the index, not from a generator.
_SIGN_HASH = 0x9E3779B1
_matrices: dict[torch.device, torch.Tensor] = {}


def _parity(bits: torch.Tensor) -> torch.Tensor:
    """Parity of the low 32 bits of each int64 entry."""
    for shift in (16, 8, 4, 2, 1):
        bits = bits ^ (bits >> shift)
    return bits & 1


def _build(device: torch.device) -> torch.Tensor:
    index = torch.arange(ROTATION_BLOCK, dtype=torch.int64, device=device)
    # Sylvester's Hadamard matrix: H[i, j] = (-1) ** popcount(i & j).
    hadamard = 1 - 2 * _parity(index.unsqueeze(1) & index.unsqueeze(0))
    signs = 1 - 2 * _parity((index * _SIGN_HASH) & 0xFFFFFFFF)
    return (signs.unsqueeze(1) * hadamard).float() / ROTATION_BLOCK**0.5


def rotation(device: torch.device) -> torch.Tensor:
    """The fp32 ``[ROTATION_BLOCK, ROTATION_BLOCK]`` orthonormal matrix ``R``: a row block
    ``x`` rotates to ``x @ R`` and back with ``y @ R.T``."""
    matrix = _matrices.get(device)
    if matrix is None:
        matrix = _matrices[device] = _build(device)
    return matrix


def held() -> list[torch.Tensor]:
    """The matrices built so far, one per device (the engine's held tensors list them)."""
    return list(_matrices.values())
