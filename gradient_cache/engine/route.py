"""A parameter's route: which codec encodes its gradient, whether it keeps a residual and
where, and what its payload and host slot take in bytes.

Decided once per parameter from its size, dtype and the options (`plan`), and again only
when the answer can change: when the warm-up ends, or a checkpoint sets the step counter.
The pipeline encodes by it, the CUDA backend sizes its pinned slots by it, the host budget
check counts it, and `gradient-cache plan` prints it: one derivation, so their bytes agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..codecs import Codec, Codecs, ResidualCodec
from ..codecs.base import shapes_bytes
from .config import EngineConfig
from .pool import SlotSpec
from .sharding import local_numel

Key = TypeVar("Key")

# `Codecs` (the engine's codec instances and the choice among them) is the codec registry's
# (gradient_cache/codecs/registry.py); it is named here for the engine's readers.
__all__ = [
    "Codecs",
    "Route",
    "plan_params",
    "plan_routes",
    "route",
]


@dataclass(frozen=True)
class Route:
    """How one parameter's gradient travels at the current step."""

    numel: int  # this rank's entries (its shard under FSDP2)
    dtype: torch.dtype
    codec: Codec  # encodes it now: lossless during the warm-up
    steady: Codec  # encodes it once the warm-up is over
    residual_on_host: bool  # CUDA backend: its residual lives in its pinned slot
    spare_residual: bool  # a second residual for a pending step (keep_previous_residual)
    dense_room: bool  # warm-up steps are ahead: its slot must hold a dense payload

    @property
    def compressed(self) -> bool:
        """Whether this step's payload differs from the gradient."""
        return self.codec.lossy

    @property
    def residual(self) -> ResidualCodec | None:
        """Its error-feedback residual's stored form, None where it keeps none."""
        return self.steady.residual

    @property
    def payload_bytes(self) -> int:
        """Its largest payload now (exact selection; threshold selection keeps +-10%)."""
        return shapes_bytes(self.codec.payload_shapes(self.numel, self.dtype))

    @property
    def residual_bytes(self) -> int:
        """One stored residual's bytes (the spare, where kept, takes as much again)."""
        return 0 if self.residual is None else self.residual.stored_bytes(self.numel)

    @property
    def slot(self) -> SlotSpec:
        """Its host slot on the CUDA backend: room for each payload tensor, its residuals."""
        regions = [
            shapes_bytes([shape]) for shape in self.steady.payload_shapes(self.numel, self.dtype)
        ]
        if self.dense_room:
            regions[0] = max(regions[0], self.numel * self.dtype.itemsize)
        residual = None
        if self.residual_on_host and self.residual is not None:
            residual = self.residual.stored_shape(self.numel)
        return SlotSpec(tuple(regions), residual, spare_residual=self.spare_residual)


def route(
    numel: int,
    dtype: torch.dtype,
    *,
    codecs: Codecs,
    config: EngineConfig,
    steps: int,
) -> Route:
    """The route of a gradient of ``numel`` entries of ``dtype`` after ``steps`` steps."""
    steady = codecs.choose(numel, dtype, min_numel=config.min_compress_numel)
    warming_up = steps < config.warmup_steps
    residuals = config.residual_options
    return Route(
        numel=numel,
        dtype=dtype,
        codec=codecs.lossless if warming_up else steady,
        steady=steady,
        residual_on_host=residuals.residual_location == "host",
        spare_residual=residuals.keep_previous_residual,
        dense_room=warming_up and steady.lossy,
    )


def plan_routes(
    sizes: Mapping[Key, tuple[int, torch.dtype]],
    *,
    codecs: Codecs,
    config: EngineConfig,
    steps: int,
) -> dict[Key, Route]:
    """`route` for each of ``sizes``' (numel, dtype), keyed as they are."""
    return {
        key: route(numel, dtype, codecs=codecs, config=config, steps=steps)
        for key, (numel, dtype) in sizes.items()
    }


def plan_params(
    params: Iterable[torch.nn.Parameter],
    config: EngineConfig,
    *,
    ratio: float,
    selection: str,
    steps: int = 0,
) -> dict[torch.nn.Parameter, Route]:
    """Each parameter's route, by its size on this rank (its shard under FSDP2)."""
    codecs = Codecs.for_options(config, ratio=ratio, selection=selection)
    sizes = {p: (local_numel(p), p.dtype) for p in params}
    return plan_routes(sizes, codecs=codecs, config=config, steps=steps)
