"""One training step, shared by the demo and every perf script, and its measurement by phase.

    loss = train_step(model, optimizer, cache, micro_batches(x, y, 2), fused=True)

`train_step` runs forward and backward on each micro-batch (the cache's drain after each
backward), then the optimizer. ``cache`` None is plain PyTorch; the variations (the fused
step, clipping, an optimizer stepped in backward) are keyword options. A ``phase`` scope
sees the step's phases by name, in order: per micro-batch "forward" and "backward" (the
cache's drain runs inside backward, as "drain"), then "optimizer" (the cache's restore
inside it, as "restore", when the step is not fused). `PhaseWatch` is such a scope: it
measures each outer phase with a `DeviceMemoryMeter` and keeps what it saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..manager import GradientCacheHookManager
    from .accounting import DeviceMemoryMeter, MemoryReading, PhasePeak

#: The outer phases of a step; "drain" and "restore" run inside backward and optimizer.
PHASES = ("forward", "backward", "optimizer")

Batch = tuple[torch.Tensor, torch.Tensor]
PhaseScope = Callable[[str], contextlib.AbstractContextManager[None]]


def no_phase(_name: str) -> contextlib.AbstractContextManager[None]:
    """The phase scope that measures nothing."""
    return contextlib.nullcontext()


def micro_batches(x: torch.Tensor, y: torch.Tensor, count: int) -> list[Batch]:
    """``(x, y)`` cut into ``count`` micro-batches along the batch dimension (views)."""
    return list(zip(x.chunk(count), y.chunk(count), strict=True))


def train_step(
    model: torch.nn.Module,
    optimizer: Any,
    cache: GradientCacheHookManager | None,
    batches: Sequence[Batch],
    *,
    fused: bool = False,
    max_grad_norm: float | None = None,
    keep_logits: bool = False,
    phase: PhaseScope = no_phase,
) -> torch.Tensor:
    """One step on ``batches``, its micro-batches; their mean loss (detached).

    Each micro-batch: forward (``model(x, y)`` returns logits and loss), backward of the
    loss divided by the number of micro-batches (the gradients are the mean), and with a
    cache its ``compress_and_free_gradients()``. Then the optimizer: with a cache and
    ``fused``, ``cache.step(optimizer, max_grad_norm=...)``, which restores one bucket at a
    time; otherwise ``cache.apply_gradients()`` (with a cache), clipping to
    ``max_grad_norm`` (if set) and ``optimizer.step()``. Last, ``zero_grad(set_to_none=True)``.

    ``optimizer`` None: each parameter was stepped in its post-accumulate-grad hook during
    backward, so the optimizer phase has nothing to do. ``keep_logits``: hold each
    micro-batch's logits until the next forward returns (and the last ones through the
    optimizer), as a loop that writes ``logits, loss = model(x, y)`` does; by default they
    go as soon as the loss is computed.
    """
    losses = []
    for x, y in batches:
        with phase("forward"):
            logits, loss = model(x, y)
            if not keep_logits:
                del logits
        with phase("backward"):
            (loss / len(batches)).backward()
            if cache is not None:
                with phase("drain"):
                    cache.compress_and_free_gradients()
        losses.append(loss.detach())
    with phase("optimizer"):
        if optimizer is not None:
            if cache is not None and fused:
                cache.step(optimizer, max_grad_norm=max_grad_norm)
            else:
                if cache is not None:
                    with phase("restore"):
                        cache.apply_gradients()
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return torch.stack(losses).mean()


@dataclass(frozen=True, kw_only=True)
class PhaseFigures:
    """One outer phase of one step, as the meter saw it."""

    name: str
    micro_batch: int  # from 1; the optimizer's is the last micro-batch's number
    peak: PhasePeak
    end: MemoryReading  # what the phase left behind


@dataclass(frozen=True, kw_only=True)
class PhaseMemory:
    """Device bytes of one phase over a step's micro-batches: the largest peak, what the
    last micro-batch left at its end, and (the CPU tracker's) each category's bytes at the
    peak; beside an allocator's peak, the tracker's largest (``accounted_bytes``)."""

    peak_bytes: int
    end_bytes: int
    peak_by_category: dict[str, int] = field(default_factory=dict)
    accounted_bytes: int | None = None


class PhaseWatch:
    """A ``phase`` scope for `train_step` that measures each outer phase (`PHASES`) with
    ``meter``, which must be entered, and keeps a `PhaseFigures` of each in ``phases``. The
    inner phases are measured as part of theirs (a meter's phases do not nest)."""

    def __init__(self, meter: DeviceMemoryMeter) -> None:
        self.meter = meter
        self.phases: list[PhaseFigures] = []
        #: The outer phase entered last (where an out-of-memory error is reported).
        self.current: str | None = None
        self._micro_batch = 0

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name == "forward":
            self._micro_batch += 1
        if name not in PHASES:
            yield
            return
        self.current = name
        with self.meter.phase(name):
            yield
        peak, end = self.meter.peaks[name], self.meter.reading()
        self.phases.append(
            PhaseFigures(name=name, micro_batch=self._micro_batch, peak=peak, end=end)
        )

    def memory(self, name: str) -> PhaseMemory:
        """Phase ``name`` over the micro-batches: the first of the largest peaks, the last end."""
        seen = [phase for phase in self.phases if phase.name == name]
        top = max(seen, key=lambda phase: phase.peak.peak.device_bytes)
        accounted = [p.peak.peak.accounted_bytes for p in seen]
        return PhaseMemory(
            peak_bytes=top.peak.peak.device_bytes,
            end_bytes=seen[-1].end.device_bytes,
            peak_by_category=dict(top.peak.peak.by_category),
            accounted_bytes=max(a for a in accounted if a is not None)
            if None not in accounted
            else None,
        )
