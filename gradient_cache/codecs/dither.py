"""Uniform noise for stochastic rounding, without a random number per entry.

Drawing a fresh uniform number per entry costs as much as the rest of a low-bit encode
on a CPU (``torch.rand`` runs at about a quarter of a copy's speed there). Instead each
device holds one table of ``2 * WINDOW`` uniform numbers made from a fixed seed, and its
complement (``1 - table``); every chunk reads a window of one of them, chosen at random,
at a pseudo-random offset, both computed on the host (no device synchronisation). Each
entry's noise is then a table entry picked uniformly at random, and its mean over draws is
exactly 1/2 at every position: a table's mean misses 1/2 by about 3e-4, and rounding with
that table alone is biased by that much of a level, the same way at every step; the
rotation of the block codecs gathered that bias onto each block's first entry (times
sqrt(128)), which Adam turned into a steady drift. The tables are scratch: dropped after
each backward and made again, the same, at the next.
"""

from __future__ import annotations

import torch

from .generators import device_generator, draw

TABLE_SEED = 0xD17E
_MASK64 = (1 << 64) - 1
# The longest window (a codec's chunk, `block_kernels.BLOCK_CHUNK`); the table is twice it,
# and its complement as long again.
WINDOW = 1 << 18


def window_start(seed: int, draw: int) -> int:
    """Where draw ``draw`` (counted from 1) of the dither seeded ``seed`` starts in its
    device's noise table (`Dither.table`): SplitMix64 of the two, whose top bit picks the
    table's half (the table or its complement) and whose low bits the offset in it."""
    x = (seed * 0x9E3779B97F4A7C15 + draw * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 63) * 2 * WINDOW + x % WINDOW


def noise_table(device: torch.device) -> torch.Tensor:
    """``2 * WINDOW`` uniform numbers from the fixed seed, then their complements."""
    maker = device_generator(device).manual_seed(TABLE_SEED)
    table = torch.empty(4 * WINDOW, device=device)  # filled in place: no temporaries
    draw((2 * WINDOW,), maker, device, out=table[: 2 * WINDOW])
    # 1 - u: negating is exact, so adding 1 rounds as the subtraction does.
    table[2 * WINDOW :].copy_(table[: 2 * WINDOW]).neg_().add_(1)
    return table


class NoiseTables:
    """Each device's noise table (`noise_table`), made at its first use there. The tables
    are the same numbers for every dither (a fixed seed), so a pipeline's codecs share one
    holder (`Codecs`): 4 MiB a device, not 4 MiB for each codec the ladder uses."""

    def __init__(self) -> None:
        self._tables: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = noise_table(device)
        return table

    def all(self) -> list[torch.Tensor]:
        return list(self._tables.values())

    def clear(self) -> None:
        self._tables.clear()


class Dither:
    """Noise windows of at most `WINDOW` entries. The offsets come from a counter-based
    hash of (seed, draw), computed in Python: no tensor operation, so no device
    synchronisation in a backward hook; the draw counter is the only state, the same on
    every device."""

    portable = True

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._draws = 0
        self.tables_held = NoiseTables()  # a pipeline's codecs share theirs (`Codecs`)

    def uniform(self, count: int, device: torch.device) -> torch.Tensor:
        """``count`` (at most `WINDOW`) uniform numbers on ``device``, fp32 (read-only:
        a view of the table)."""
        start = window_start(self.seed, self.take(1))
        return self.table(device)[start : start + count]

    def take(self, draws: int) -> int:
        """Count ``draws`` draws (a fused kernel's windows); the number of the first."""
        self._draws += draws
        return self._draws - draws + 1

    def table(self, device: torch.device) -> torch.Tensor:
        """The noise table on ``device`` (`noise_table`), made at its first use there."""
        return self.tables_held.on(device)

    def tables(self) -> list[torch.Tensor]:
        return self.tables_held.all()

    def release(self) -> None:
        self.tables_held.clear()

    # The engine checkpoints and rewinds generators per device (`DeviceGenerators`); the
    # offsets do not depend on the device, so the device is ignored.
    def get_state(self, device: torch.device) -> torch.Tensor | None:
        """The draw counter; None before the first draw (as `DeviceGenerators` says of an
        unused generator), so the ladder's unused codecs hold no state."""
        return None if self._draws == 0 else torch.tensor([self._draws], dtype=torch.int64)

    def state_problem(self, device: torch.device, state: torch.Tensor) -> str | None:
        if state.dtype != torch.int64 or tuple(state.shape) != (1,) or int(state[0]) < 0:
            return (
                f"a {state.dtype} tensor of shape {tuple(state.shape)}; expected a dither's "
                "draw counter, an int64 tensor of shape (1,) >= 0"
            )
        return None

    def set_state(self, device: torch.device, state: torch.Tensor | None) -> None:
        # A CPU tensor (`get_state`'s): read on the host, no device operation, as this may
        # run in a backward hook (a skipped step's rewind).
        self._draws = 0 if state is None else int(state.tolist()[0])


class DrawsFrom:
    """The windows draws ``first``, ``first + 1``, ... of the dither seeded ``seed`` give
    from its ``table``: a fused operation's noise (`Dither.take`), replayed by an eager
    path."""

    def __init__(self, seed: int, first: int, table: torch.Tensor) -> None:
        self.seed, self.draw, self.table = seed, first, table

    def uniform(self, count: int, device: torch.device) -> torch.Tensor:
        start = window_start(self.seed, self.draw)
        self.draw += 1
        return self.table[start : start + count]


def as_int64(seed: int) -> int:
    """``seed`` modulo 2^64 as a signed 64-bit integer (an operator's ``int``): the hash
    reads only those bits."""
    low = seed % 2**64
    return low - 2**64 if low >= 2**63 else low
