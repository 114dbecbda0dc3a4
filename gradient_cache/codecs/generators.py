"""Seeded random generators per device, so a codec's draws never touch the global RNG."""

from __future__ import annotations

from typing import Protocol

import torch


class RandomSource(Protocol):
    """What the engine checkpoints and rewinds of a codec's randomness, per device.
    ``portable``: whether a state means the same on every kind of device (a counter), so
    one that does not fit is damage (refused) even where another kind of device saved it."""

    portable: bool

    def get_state(self, device: torch.device) -> torch.Tensor | None:
        """The state on ``device`` as a CPU tensor; None if nothing drew there yet."""
        ...

    def set_state(self, device: torch.device, state: torch.Tensor | None) -> None:
        """Put back what `get_state` returned; None: as new, from the seed."""
        ...

    def state_problem(self, device: torch.device, state: torch.Tensor) -> str | None:
        """What makes ``state`` (a CPU tensor) unfit for `set_state`; None if it fits."""
        ...


def device_generator(device: torch.device) -> torch.Generator:
    """A new generator for ``device``, or a CPU one where the device has none of its own
    (the emulated device): its draws are made on the CPU and copied over (`draw`)."""
    try:
        return torch.Generator(device=device)
    except (RuntimeError, NotImplementedError):
        return torch.Generator()


def draw(
    shape: tuple[int, ...],
    generator: torch.Generator,
    device: torch.device,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Uniform numbers in [0, 1) from ``generator`` on ``device`` (drawn where the
    generator lives, then copied: the same numbers as a CPU run's)."""
    if generator.device == device:
        return torch.rand(shape, generator=generator, device=device, out=out)
    values = torch.rand(shape, generator=generator, device=generator.device)
    return values.to(device) if out is None else out.copy_(values)


class DeviceGenerators:
    """One seeded generator per device, created on first use. A state is a generator's:
    another kind of device continues from it only where its generator is of the same kind
    (the emulated device's is a CPU one), which `state_problem` tells."""

    portable = False

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = device_generator(device).manual_seed(self.seed)
        return self._generators[device]

    def uniform_like(self, x: torch.Tensor) -> torch.Tensor:
        """Uniform noise in [0, 1) shaped like ``x``, on its device, in fp32."""
        return draw(tuple(x.shape), self(x.device), x.device)

    def uniform(self, count: int, device: torch.device) -> torch.Tensor:
        """``count`` uniform numbers in [0, 1) on ``device``, fp32 (as `dither.Dither`'s)."""
        return draw((count,), self(device), device)

    def get_state(self, device: torch.device) -> torch.Tensor | None:
        """``device``'s generator state (a CPU uint8 tensor); None if nothing drew there."""
        generator = self._generators.get(device)
        return None if generator is None else generator.get_state()

    def state_problem(self, device: torch.device, state: torch.Tensor) -> str | None:
        try:  # a scratch generator: this one stays as it is
            device_generator(device).set_state(state)
        except (RuntimeError, TypeError) as error:
            return f"not a {device.type} generator's state ({error})"
        return None

    def set_state(self, device: torch.device, state: torch.Tensor | None) -> None:
        """Put back what `get_state` returned; None: as new, from the seed."""
        self._generators.pop(device, None)
        if state is not None:
            self(device).set_state(state)
