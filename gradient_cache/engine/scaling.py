"""The fused step under an enabled GradScaler: unscaled as restored, skipped on inf or NaN.

Plain AMP is ``scaler.unscale_(optimizer)``, clipping, ``scaler.step(optimizer)`` (which
skips ``optimizer.step()`` if a gradient was not finite) and ``scaler.update()``. The fused
step does the same in one call: the restore multiplies by 1/scale (a power of two, so the
unscaled gradients have plain's bits), the encodes flag non-finite gradients on the device
as backward goes (`PendingStep.found_inf`), and a flagged step steps nothing.

``update()`` reads what ``step()`` recorded for each optimizer; no public API lets another
step record it, so `record` writes the two fields ``unscale_`` and ``step`` write
(``_per_optimizer_states[id(optimizer)]``: ``"stage"``, ``"found_inf_per_device"``), the
same private state since torch 1.6; tests/test_scaler_skip.py fails if torch changes it.
"""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from . import sharding
from .pipeline import Pipeline
from .store import BucketPayloads


def enabled_scaler(
    pipeline: Pipeline, optimizer: torch.optim.Optimizer
) -> torch.amp.GradScaler | None:
    """The pipeline's GradScaler if it is enabled (a disabled scaler is no scaler), checked
    ready to step ``optimizer``."""
    scaler = pipeline.grad_scaler
    if scaler is None or not scaler.is_enabled():
        return None
    if any(record.sharded for record in pipeline.records.values()):
        # Each rank sees only its shards' inf: ranks would disagree on the skip.
        raise RuntimeError(
            "step(optimizer) does not take a GradScaler under FSDP2 (its verdict would be "
            "this rank's alone): restore with apply_gradients() and step with a "
            "ShardedGradScaler's scaler.step(optimizer)."
        )
    stage = scaler._per_optimizer_states[id(optimizer)]["stage"]
    if stage is not OptState.READY:
        raise RuntimeError(
            "step(optimizer) unscales the gradients as it restores them and records the "
            f"step for scaler.update(), but the GradScaler has this optimizer {stage.name} "
            "already: call neither scaler.unscale_(optimizer) nor scaler.step(optimizer) "
            "in a step the fused step steps; after it, call scaler.update()."
        )
    return scaler


def inv_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """1/scale on the scaler's device, computed as ``unscale_`` computes it (in fp64)."""
    return scaler._get_scale_async().double().reciprocal().float()  # type: ignore[union-attr]


def found_inf(
    pipeline: Pipeline, parts: list[BucketPayloads], held: dict[torch.nn.Parameter, torch.Tensor]
) -> bool:
    """Whether any gradient of the step is not finite: the encodes' flag (or, for a step
    resumed from a checkpoint, the payloads') and the device gradients'. One host read,
    outside backward, as ``scaler.step()`` makes."""
    pending = pipeline.pending
    flags = []
    if pending is not None and pending.found_inf is not None:
        flags.append(pending.found_inf)
    elif parts:  # a resumed step: its encodes' flag was not saved
        flags += [~torch.isfinite(p.kept_values()).all() for part in parts for _, p in part]
    flags += [~torch.isfinite(sharding.local(grad)).all() for grad in held.values()]
    if not flags:
        return False
    device = pipeline.backend.device  # gathered there: one read, not one per flag
    return bool(torch.stack([flag.to(device) for flag in flags]).any())


def record(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, *, found_inf: bool
) -> None:
    """Tell ``scaler`` what ``scaler.step(optimizer)`` would have: ``update()`` then backs
    off after a skip and grows the scale as usual otherwise."""
    state = scaler._per_optimizer_states[id(optimizer)]
    scale = scaler._get_scale_async()
    assert scale is not None  # an enabled scaler that scaled a loss has one
    state["found_inf_per_device"] = {
        scale.device: torch.full((), float(found_inf), dtype=torch.float32, device=scale.device)
    }
    state["stage"] = OptState.STEPPED
