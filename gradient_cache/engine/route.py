"""A parameter's route: which codec encodes its gradient, whether it keeps a residual and
where, and what its payload and host slot take in bytes.

Planned once per parameter (`RoutePlan`); any step's route derives from that. The encode,
the restores, the pinned slots, the host check and `gradient-cache plan` all read it: one
derivation, so their bytes agree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from ..codecs import Codec, Codecs, ResidualCodec
from ..codecs.base import shapes_bytes
from .config import EngineConfig
from .layout import contiguous_strides, gradient_strides, memory_order
from .pool import SlotSpec
from .sharding import local, local_shape

Key = TypeVar("Key")
Param = torch.nn.Parameter


@dataclass(frozen=True)
class Route:
    """How one parameter's gradient travels at the current step."""

    shape: tuple[int, ...]  # this rank's shape (its shard's under FSDP2): what a restore gives
    stride: tuple[int, ...]  # the strides a restore gives: the parameter's (`layout`)
    numel: int  # this rank's entries (its shard under FSDP2)
    dtype: torch.dtype
    codec: Codec  # encodes it now: lossless during the warm-up
    steady: Codec  # encodes it once the warm-up is over
    residual_on_host: bool  # CUDA backend: its residual lives in its pinned slot
    spare_residual: bool  # a second residual for a pending step (keep_previous_residual)
    dense_room: bool = False  # warm-up steps are ahead: its slot must hold a dense payload

    def flatten(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad``'s entries in its parameter's memory order, as one flat tensor (a view
        where ``grad`` has the parameter's layout, as autograd gives it)."""
        return grad.permute(memory_order(self.stride)).reshape(-1)

    def shaped(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat gradient (`flatten`'s order) in the parameter's shape and strides, no copy."""
        return flat.as_strided(self.shape, self.stride)

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

    def warming_up(self, lossless: Codec) -> Route:
        """This route during warm-up steps: lossless, in a slot with room for it."""
        return dataclasses.replace(self, codec=lossless, dense_room=self.steady.lossy)


def plan_routes(
    shapes: Mapping[Key, tuple[tuple[int, ...], torch.dtype]],
    *,
    codecs: Codecs,
    config: EngineConfig,
    steps: int,
    strides: Mapping[Key, tuple[int, ...]] | None = None,
) -> dict[Key, Route]:
    """The route of each of ``shapes``' (shape, dtype) after ``steps`` steps, keyed as they
    are; ``strides``: the gradients' layouts where not contiguous."""
    residuals = config.residual_options
    routes = {}
    for key, (shape, dtype) in shapes.items():
        numel = math.prod(shape)
        steady = codecs.choose(numel, dtype, min_numel=config.min_compress_numel)
        stride = (strides or {}).get(key, contiguous_strides(tuple(shape)))
        routes[key] = Route(
            shape=tuple(shape),
            stride=tuple(stride),
            numel=numel,
            dtype=dtype,
            codec=steady,
            steady=steady,
            residual_on_host=residuals.residual_location == "host",
            spare_residual=residuals.keep_previous_residual,
        )
    if steps < config.warmup_steps:
        return {key: route.warming_up(codecs.lossless) for key, route in routes.items()}
    return routes


class RoutePlan(Generic[Key]):
    """Each parameter's route, planned once (`plan_routes`); `at` derives any step's."""

    def __init__(
        self,
        shapes: Mapping[Key, tuple[tuple[int, ...], torch.dtype]],
        *,
        codecs: Codecs,
        config: EngineConfig,
        selection: str,
        strides: Mapping[Key, tuple[int, ...]] | None = None,
    ) -> None:
        self.codecs = codecs
        self.selection = selection
        self._warmup_steps = config.warmup_steps
        self._steady = plan_routes(
            shapes, codecs=codecs, config=config, steps=config.warmup_steps, strides=strides
        )

    def at(self, steps: int) -> dict[Key, Route]:
        """The routes after ``steps`` steps: lossless while the warm-up lasts."""
        if steps >= self._warmup_steps:
            return dict(self._steady)
        return {key: route.warming_up(self.codecs.lossless) for key, route in self._steady.items()}


# A backend factory's way to the first step's routes, given what it resolves "auto" to.
RoutePlanner = Callable[[str], Mapping[Param, Route]]


def planner(params: Iterable[Param], config: EngineConfig, *, ratio: float) -> RoutePlanner:
    """A `RoutePlanner` for ``params`` outside a pipeline (tests, tools): plans per call."""
    params = list(params)
    return lambda selection: plan_params(params, config, ratio=ratio, selection=selection)


def plan_params(
    params: Iterable[Param], config: EngineConfig, *, ratio: float, selection: str, steps: int = 0
) -> dict[Param, Route]:
    """Each parameter's route after ``steps`` steps (`plan_of_params`')."""
    return plan_of_params(params, config, ratio=ratio, selection=selection).at(steps)


def plan_of_params(
    params: Iterable[Param], config: EngineConfig, *, ratio: float, selection: str
) -> RoutePlan[Param]:
    """The `RoutePlan` of ``params``, by their shapes on this rank (shards' under FSDP2)."""
    codecs = Codecs.for_options(config, ratio=ratio, selection=selection)
    shapes = {p: (tuple(local_shape(p)), p.dtype) for p in params}
    strides = {p: gradient_strides(local(p)) for p in params}
    return RoutePlan(shapes, codecs=codecs, config=config, selection=selection, strides=strides)
