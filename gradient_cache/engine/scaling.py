"""The fused step under an enabled GradScaler: unscaled as restored, skipped on inf or NaN.

The restore multiplies by 1/scale (a power of two: plain's bits), the encodes flag
non-finite gradients as backward goes (`PendingStep.found_inf`), a flagged step steps
nothing. No public API lets another step report to ``update()``, so `report_step` writes
the private fields ``unscale_`` and ``step`` write (``_per_optimizer_states``), the same
since torch 1.6: tests/test_scaler_skip.py fails if torch changes them. `SkipWatch` learns
later whether the scaler skipped a completed step (`Pipeline.settle_scaled_step`).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from . import sharding
from .store import BucketPayloads
from .users_line import outside_the_package


def loss_scale(scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
    """The GradScaler's scale as a device tensor (no host sync), or None if unscaled."""
    if scaler is None or not scaler.is_enabled():
        return None
    # GradScaler has no public sync-free getter; get_scale() would sync the host.
    return scaler._get_scale_async()


def check_ready(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, *, sharded: bool
) -> None:
    """Refuse an enabled ``scaler`` the fused step cannot step ``optimizer`` with."""
    if sharded:
        # Each rank sees only its shards' inf: ranks would disagree on the skip.
        raise RuntimeError(
            "step(optimizer) does not take a GradScaler under FSDP2 (its verdict would be "
            "this rank's alone): restore with apply_gradients() and step with a "
            "ShardedGradScaler's scaler.step(optimizer)."
        )
    if scaler._scale is None:
        raise RuntimeError(
            "step(optimizer) with a GradScaler that scaled no loss yet (its scale is made by "
            "the first scaler.scale(loss)): backpropagate scaler.scale(loss), not the loss. "
            "A scaler loaded from a checkpoint makes it at its first scale() too: resumed "
            "between the backward and the step, call scaler.scale(torch.zeros((), "
            "device=...)) once on the device first (plain PyTorch's scaler.step needs the "
            "same)."
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fp16 = [p for p in params if p.dtype == torch.float16]
    if fp16:
        raise ValueError(
            f"step(optimizer) with a GradScaler over {len(fp16)} fp16 parameters: as plain "
            "PyTorch's scaler.unscale_() ('Attempting to unscale FP16 gradients.'), the "
            "cache does not unscale fp16 gradients, whose small values the scale is there to "
            "keep. Keep the parameters in fp32 and compute in fp16 under torch.autocast, or "
            "(weights on the host) pass compute_dtype=torch.float16."
        )
    stage = scaler._per_optimizer_states[id(optimizer)]["stage"]
    if stage is not OptState.READY:
        raise RuntimeError(
            "step(optimizer) unscales the gradients as it restores them and records the "
            f"step for scaler.update(), but the GradScaler has this optimizer {stage.name} "
            "already: call neither scaler.unscale_(optimizer) nor scaler.step(optimizer) "
            "in a step the fused step steps; after it, call scaler.update()."
        )


def warn_unless_powers_of_two(scaler: torch.amp.GradScaler) -> None:
    """Warn unless the scale and its factors are powers of two: only then does the fused
    step's one multiply (clip factor over scale) round as ``unscale_()`` then the clip."""
    if not scaler.is_enabled():
        return
    factors = {
        "scale": scaler.get_scale(),
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
    }
    odd = {name: value for name, value in factors.items() if math.frexp(value)[0] != 0.5}
    if odd:
        shown = ", ".join(f"{name}={value!r}" for name, value in odd.items())
        warnings.warn(
            f"The GradScaler given to the cache has {shown}, not a power of two: the fused "
            "step unscales and clips each gradient with one multiply (by the clip factor "
            "over the scale), which equals plain PyTorch's unscale_() then clip only for a "
            "power-of-two scale, so a clipped step may differ from plain's in the last bits. "
            "GradScaler's defaults (init_scale=2.0**16, growth_factor=2.0, "
            "backoff_factor=0.5) keep the scale a power of two.",
            UserWarning,
            stacklevel=outside_the_package(),
        )


def inv_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """1/scale on the scaler's device, computed as ``unscale_`` computes it (in fp64)."""
    return scaler._get_scale_async().double().reciprocal().float()  # type: ignore[union-attr]


def found_inf(
    encoded_flag: torch.Tensor | None,
    parts: list[BucketPayloads],
    held: dict[torch.nn.Parameter, torch.Tensor],
    device: torch.device,
) -> bool:
    """Whether any gradient of the step is not finite: the encodes' flag (a resumed step:
    the payloads') or the held gradients'. One host read, as ``scaler.step()`` makes."""
    if encoded_flag is not None:
        flags = [encoded_flag]
    else:  # a resumed step: its encodes' flag was not saved
        flags = [~torch.isfinite(p.kept_values()).all() for part in parts for _, p in part]
    flags += [~torch.isfinite(sharding.local(grad)).all() for grad in held.values()]
    if not flags:
        return False
    # Gathered on one device: one read, not one per flag.
    return bool(torch.stack([flag.to(device) for flag in flags]).any())


def report_step(scaler: torch.amp.GradScaler, optimizer_id: int, *, found_inf: bool) -> None:
    """Tell ``scaler`` what ``scaler.step(optimizer)`` would have, for its ``update()``."""
    state = scaler._per_optimizer_states[optimizer_id]
    scale = scaler._get_scale_async()
    assert scale is not None  # an enabled scaler that scaled a loss has one
    state["found_inf_per_device"] = {
        scale.device: torch.full((), float(found_inf), dtype=torch.float32, device=scale.device)
    }
    state["stage"] = OptState.STEPPED


@dataclass
class ScaledStep:
    """A completed step a GradScaler may have skipped, and what it changed in the engine."""

    scale_version: int  # the scale tensor's in-place version when the step was delivered
    random_state: dict[str, torch.Tensor]  # the generators' states before its backward
    steps: int  # the step count before it
    stepped: bool = False  # an optimizer holding a cached parameter stepped since


class SkipWatch:
    """Whether the GradScaler skipped the last completed step, learnt on the host: yes if
    ``update()`` ran since (it bumps the scale's version) and no optimizer over a cached
    parameter stepped (``scaler.step`` skips ``optimizer.step()`` on inf). No update yet
    (micro-batches restored one by one): not skipped. One optimizer stepping: taken."""

    def __init__(
        self, scaler: torch.amp.GradScaler, cached: Collection[torch.nn.Parameter]
    ) -> None:
        self.scaler = scaler
        self._cached = cached
        # The last completed step until it is settled; None: nothing to settle.
        self.unsettled: ScaledStep | None = None
        this = weakref.ref(self)

        def on_optimizer_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
            watch = this()  # every optimizer's hook: it holds the watch weakly
            if watch is not None:
                watch._note_step(optimizer)

        # It reads no optimizer state: the fused step need not wait on the host for it.
        on_optimizer_step.reads_no_state = True  # type: ignore[attr-defined]
        self.handle: RemovableHandle = register_optimizer_step_post_hook(on_optimizer_step)

    def delivered(self, random_state: dict[str, torch.Tensor] | None, steps: int) -> None:
        """A step was delivered (counted): remember what to undo if it was skipped."""
        scale = loss_scale(self.scaler)
        if scale is not None:
            self.unsettled = ScaledStep(scale._version, random_state or {}, steps)

    def settle(self) -> ScaledStep | None:
        """The last completed step if the scaler skipped it (to undo), else None; settled."""
        scaled, self.unsettled = self.unsettled, None
        if scaled is None or scaled.stepped:
            return None
        return scaled if self._updated(scaled) else None

    def decided(self) -> bool:
        """Whether the last completed step is known taken or skipped: an optimizer stepped
        a cached parameter, or the scaler's ``update()`` ran."""
        scaled = self.unsettled
        return scaled is not None and (scaled.stepped or self._updated(scaled))

    def _updated(self, scaled: ScaledStep) -> bool:
        """Whether ``update()`` ran since ``scaled`` was delivered."""
        scale = loss_scale(self.scaler)
        return scale is not None and scale._version != scaled.scale_version

    def _note_step(self, optimizer: torch.optim.Optimizer) -> None:
        scaled = self.unsettled
        if scaled is None or scaled.stepped:
            return
        params = (p for group in optimizer.param_groups for p in group["params"])
        scaled.stepped = any(p in self._cached for p in params)
