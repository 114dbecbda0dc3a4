"""Choosing and building the backend for a set of parameters, after the host budget check.

Tests give the pipeline another `BackendFactory` (stand-in streams) instead of patching this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .accelerator import TORCH_STREAMS, AcceleratorBackend, StreamApi, allocate_pinned
from .backend import Backend, CpuBackend
from .config import EngineConfig
from .devices import current_accelerator_type, is_accelerator
from .hostmem import check_host_budget
from .pool import HostPool, reserved_bytes
from .route import RoutePlanner
from .sharding import is_dtensor
from .units import MIB

Param = torch.nn.Parameter


class BackendFactory(Protocol):
    """Builds the backend of ``params``; ``plan`` gives their routes (planned once) for the
    top-k selection the backend resolves ``"auto"`` to."""

    def __call__(
        self, params: Sequence[Param], config: EngineConfig, *, plan: RoutePlanner
    ) -> Backend: ...


def parameter_device(params: Sequence[Param]) -> torch.device:
    """The one device all ``params`` live on, or a ValueError naming them all."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) != 1:
        raise ValueError(
            f"The cached parameters live on several devices {devices}; one manager serves "
            "one device. Create one manager per device, or list the other device's layers "
            "in exclude_layers."
        )
    device = torch.device(devices[0])
    if device.type == "meta":
        raise ValueError(
            "The model's parameters are on the meta device: they have no data, so backward "
            "cannot produce gradients to cache. Materialize the model first "
            "(model.to_empty(device=...) and initialize it, or load its state_dict with "
            "assign=True), then create the cache."
        )
    return device


def create_backend(params: Sequence[Param], config: EngineConfig, *, plan: RoutePlanner) -> Backend:
    """The backend for ``config.device`` (a model set up from the host) or else the
    parameters' device, after checking the host budget."""
    device = torch.device(config.device) if config.device is not None else parameter_device(params)
    if config.backend != "auto" and config.backend != device.type:
        raise ValueError(
            f"backend={config.backend!r} does not match the parameters' device {device}; "
            f"use backend='auto' or move the model to {config.backend}."
        )
    if is_accelerator(device):
        return build_accelerator_backend(params, config, device, plan=plan)
    if device.type != "cpu":
        raise ValueError(
            f"The parameters live on {device}, which is neither the CPU nor this process's "
            f"accelerator ({current_accelerator_type()}): the cache moves gradients through "
            "the current accelerator's streams and pinned memory (torch.accelerator; a "
            "PrivateUse1 device, once registered, is the accelerator ahead of CUDA). Move the "
            "model to the accelerator or the CPU."
        )
    # The CPU's payloads replace the gradients plain PyTorch would hold: only residuals add,
    # the current ones and (keep_previous_residual) a pending step's new ones.
    keep_previous = config.residual_options.keep_previous_residual
    copies = 2 if keep_previous else 1
    routes = plan(CpuBackend.default_selection)
    check_host_budget(
        copies * sum(route.residual_bytes for route in routes.values()),
        fraction=config.host_memory_fraction,
        what="error-feedback residuals",
    )
    return CpuBackend(device, keep_previous_residual=keep_previous)


def build_accelerator_backend(
    params: Sequence[Param],
    config: EngineConfig,
    device: torch.device,
    *,
    plan: RoutePlanner,
    streams: StreamApi = TORCH_STREAMS,
    allocate: Callable[[int], torch.Tensor] = allocate_pinned,
) -> AcceleratorBackend:
    """An `AcceleratorBackend` whose pinned pool has a slot for every parameter; tests pass
    stand-ins for torch's ``streams`` and pinned ``allocate``."""
    residuals = config.residual_options
    if config.selection == "threshold":  # top-k's, or the ladder's top-k rung's
        raise ValueError(
            f"selection='threshold' is not supported on {device.type}: counting the entries "
            "above the threshold needs a host sync inside backward. Use selection='auto' or "
            "'exact' (on gradient_cache.TopK, or gradient_cache.Ladder for codec=None)."
        )
    routes = plan(AcceleratorBackend.default_selection)
    layout = {param: route.slot for param, route in routes.items()}
    needed = reserved_bytes(layout)  # the power-of-two slabs: a little above the slots
    if config.host_pool_mb is not None and needed > config.host_pool_mb * MIB:
        raise ValueError(
            f"host_pool_mb={config.host_pool_mb} is below the {needed / MIB:.1f} MiB the "
            "pool needs (one slot per parameter, sized for its largest payload). Raise "
            "host_pool_mb, raise compression_ratio, or leave host_pool_mb=None."
        )
    check_host_budget(
        needed, fraction=config.host_memory_fraction, what="the host pool of payload slots"
    )
    pool = HostPool(layout, allocate_pinned=allocate if config.pin_memory else None)
    return AcceleratorBackend(
        device,
        pool,
        staging_depth=config.staging_depth,
        host_residuals=residuals.error_feedback and residuals.residual_location == "host",
        keep_previous_residual=residuals.keep_previous_residual,
        streams=streams,
        record_gradients=any(map(is_dtensor, params)),
    )
