"""Uniform noise for stochastic rounding, without a random number per entry.

Drawing a fresh uniform number per entry costs as much as the rest of a low-bit encode
on a CPU (``torch.rand`` runs at about a quarter of a copy's speed there). Instead each
device holds one table of ``2 * WINDOW`` uniform numbers made from a fixed seed,
and every chunk reads a window of it that starts at a random offset drawn on the host
(no device synchronisation). Each entry's noise is then a table entry picked uniformly
at random: uniform on [0, 1) up to the table's sampling error (about 1e-3), so rounding
stays unbiased to that level, and it changes from chunk to chunk and step to step.
The table is scratch: dropped after each backward and made again, the same, at the next.
"""

from __future__ import annotations

import torch

TABLE_SEED = 0xD17E
# The longest window (a block codec's chunk, `blockquant.BLOCK_CHUNK`); the table is twice it.
WINDOW = 1 << 18


class Dither:
    """Noise windows for chunks of at most `WINDOW` entries; offsets from a seeded
    host generator, whose state is the only state (`get_state` / `set_state`)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._offsets = torch.Generator().manual_seed(seed)
        self._tables: dict[torch.device, torch.Tensor] = {}

    def window(self, count: int, device: torch.device) -> torch.Tensor:
        """``count`` (at most `WINDOW`) uniform numbers on ``device``, fp32."""
        table = self._tables.get(device)
        if table is None:
            maker = torch.Generator(device=device).manual_seed(TABLE_SEED)
            table = torch.rand(2 * WINDOW, generator=maker, device=device)
            self._tables[device] = table
        start = int(torch.randint(WINDOW, (1,), generator=self._offsets))
        return table[start : start + count]

    def tables(self) -> list[torch.Tensor]:
        return list(self._tables.values())

    def release(self) -> None:
        self._tables.clear()

    # The engine checkpoints and rewinds generators per device (`DeviceGenerators`); the
    # offsets are drawn on the host whatever the device, so the device is ignored.
    def get_state(self, device: torch.device) -> torch.Tensor:
        return self._offsets.get_state()

    def set_state(self, device: torch.device, state: torch.Tensor | None) -> None:
        if state is None:
            self._offsets.manual_seed(self.seed)
        else:
            self._offsets.set_state(state)
