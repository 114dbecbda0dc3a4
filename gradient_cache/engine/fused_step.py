"""The fused step's buckets: restore and step one bucket at a time, safe to retry.

A bucket's payloads leave the cache only after its ``optimizer.step()`` returned, so a
step whose ``optimizer.step()`` raised before changing anything (an OOM the user catches)
is finished by calling it again, with plain PyTorch's result: stepped buckets are not
stepped twice, the first clip is reused. An interrupt after a bucket's step returned, before
its payloads left (a signal between our calls), has them leave on the way out (`run`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from . import sharding
from .pipeline import Pipeline
from .records import GradientAt
from .step_state import Clip, HeldProgress

Param = torch.nn.Parameter


class Traveller(Protocol):
    """What travels to the device with each bucket and back after its step."""

    def bring(self, params: Sequence[Param]) -> Any:
        """Start copying ``params``' part; returns its arrival (nothing moved if it raises)."""

    def install(self, arrival: Any) -> None:
        """The arrival ready for the step (work queued from now on sees it)."""

    def send_back(self, arrival: Any) -> None:
        """After the bucket's step: its part to the host."""

    def abandon(self, arrivals: Iterable[Any]) -> None:
        """A step raised: each arrival's part as it was before its journey."""

    def step_ended(self, steps: int) -> None:
        """Step ``steps`` completed."""


@dataclass
class Journeys:
    """One fused step's travellers and each bucket's arrivals. The weights first: their
    copies back start before a new state's host copies are allocated, which may raise."""

    travellers: list[Traveller]
    # Each bucket's parameters and its travellers' arrivals, oldest first.
    arrivals: deque[tuple[Sequence[Param], list[Any]]] = field(default_factory=deque)

    def bring(self, params: Sequence[Param]) -> None:
        brought: list[Any] = []
        try:
            for traveller in self.travellers:
                brought.append(traveller.bring(params))
        except BaseException:  # those already on their way go back as they were
            for traveller, arrival in zip(self.travellers, brought, strict=False):
                traveller.abandon([arrival])
            raise
        self.arrivals.append((params, brought))

    def install(self) -> None:
        """The oldest bucket's arrivals, for its step."""
        for traveller, arrival in zip(self.travellers, self.arrivals[0][1], strict=True):
            traveller.install(arrival)

    def send_back(self) -> None:
        """The oldest bucket's, after its step."""
        for traveller, arrival in zip(self.travellers, self.arrivals.popleft()[1], strict=True):
            traveller.send_back(arrival)

    def abandon(self, stepped: Container[Param]) -> None:
        """A step raised: each arrival's part as before its journey, but the oldest bucket's
        sent back where its parameters are ``stepped`` (interrupted after its step)."""
        try:
            if self.arrivals and self.arrivals[0][0][0] in stepped:
                self.send_back()
        finally:
            for i, traveller in enumerate(self.travellers):
                traveller.abandon(arrivals[i] for _, arrivals in self.arrivals)
            self.arrivals.clear()

    def step_ended(self, steps: int) -> None:
        for traveller in self.travellers:
            traveller.step_ended(steps)


@dataclass
class BucketSteps:
    """What the step decided before its buckets step: the cached ``buckets``, restored
    times ``clip``'s factor; the device gradients ``held``, stepped last, times
    ``held_factor``; ``clip`` and ``progress``, kept for a retry if a step raises."""

    buckets: list[list[Param]]
    held: dict[Param, torch.Tensor]
    delivered: list[Param]
    held_factor: torch.Tensor | None
    clip: Clip
    progress: HeldProgress
    step_once: Callable[[], object]
    journeys: Journeys  # the weights and optimizer state with the buckets (offloaded)
    hidden: bool  # the held gradients stay out of .grad afterwards (`settle_held`)
    # The cached parameters whose bucket's optimizer step returned, marked right after it
    # (`_step_with`): an interrupt before their bucket left the store and went home (a
    # signal between library calls) must not have the retry step them again.
    stepped: set[Param] = field(default_factory=set)


def run(pipeline: Pipeline, steps: BucketSteps) -> dict[Param, torch.Tensor]:
    """Step every bucket, then the held gradients; returns those left (`settle_held`). A
    step that raises leaves the clip and the progress to the pipeline, for the retry."""
    before = _hold(pipeline, steps.held)  # out of .grad: the buckets step without them
    try:
        _step_cached(pipeline, steps)
        if steps.held:
            _step_held(pipeline, steps)
    except BaseException:
        # Cached gradients are never in .grad: none left there by a `_step_with` whose
        # clearing loop a signal cut short (the retry would take it for a device gradient).
        for bucket in steps.buckets:
            for param in bucket:
                param.grad = None
        # Finished as uninterrupted: delivered and spent (`Pipeline.skip`), sent home.
        pipeline.skip([p for p in steps.stepped if p in pipeline.store])
        steps.journeys.abandon(steps.stepped | steps.progress.stepped)
        for param, grad in steps.held.items():
            param.grad = grad  # as the retry finds them: `progress` says what was done to them
        for param, at in before.items():  # where they were before the step
            pipeline.records[param].gradient = at
        pipeline.interrupt(steps.clip, steps.progress)
        raise
    steps.journeys.step_ended(pipeline.steps)
    return settle_held(pipeline, steps.held, hidden=steps.hidden)


def _step_cached(pipeline: Pipeline, steps: BucketSteps) -> None:
    """Each bucket of cached gradients restored and stepped, its travellers brought along."""
    # Each bucket's travellers go back once its payloads left the store: if that raises
    # (allocating new host copies), the retry does not step the bucket again.
    restoring = pipeline.restoring(
        steps.buckets,
        clip_factor=steps.clip[1],
        alongside=steps.journeys.bring,
        spent=steps.journeys.send_back,
        depth=pipeline.backend.restore_ahead,  # a bucket ahead (CUDA): it steps, then goes
    )
    with contextlib.closing(restoring) as buckets:
        for i, grads in enumerate(buckets):
            steps.journeys.install()
            _step_with(steps.step_once, grads, steps.stepped)
            if i == 0:
                # Counted (its residuals current) once an optimizer step went through, idempotent
                # (a retry's): a step that failed before can still be discarded without a trace.
                pipeline.deliver([p for p in steps.delivered if p in pipeline.store])


def _step_held(pipeline: Pipeline, steps: BucketSteps) -> None:
    """The held gradients scaled in place, then stepped a bucket's worth at a time: each
    chunk's state (offloaded) is on the device only for its own step, as a bucket's is."""
    held, progress, journeys = steps.held, steps.progress, steps.journeys
    scale_in_place(held, steps.held_factor, progress)
    chunks = _chunks(
        [p for p in held if p not in progress.stepped], pipeline.assembler.capacity_bytes
    )
    for chunk in chunks:
        journeys.bring(chunk)
        journeys.install()
        # A held gradient restored beside its weight at rest on the host (a clip over some
        # of the parameters restores theirs) goes to where the weight was brought.
        grads = [(param, held[param].to(param.device)) for param in chunk]
        _step_with(steps.step_once, grads, progress.stepped)
        journeys.send_back()


def scale_in_place(
    held: dict[Param, torch.Tensor], factor: torch.Tensor | None, progress: HeldProgress
) -> None:
    """The gradients ``held`` times ``factor`` (unscale and clip) in place, as ``unscale_`` and
    ``clip_grads_with_norm_`` do (no second copy); marked in ``progress``: a retry scales once."""
    if factor is None:
        return
    for param, grad in held.items():
        if param not in progress.scaled:
            local = sharding.local(grad)
            local.mul_(factor.to(local.device))
            progress.scaled.add(param)


def settle_held(
    pipeline: Pipeline, held: dict[Param, torch.Tensor], *, hidden: bool
) -> dict[Param, torch.Tensor]:
    """The held gradients after their step (or a skipped one), out of the pending step.
    Those a budget keeps are freed, as cached ones (a loop without zero_grad must not add
    them into the next); the others go back in ``param.grad``, or, ``hidden`` (an
    integration's own step runs next), stay out until `show_held`. Returns the others."""
    left = {}
    for param, grad in held.items():
        record = pipeline.records.get(param)
        kept = record is not None and record.keep_on_device
        if record is not None:  # hidden: held for the step until `show_held`
            record.gradient = GradientAt.HELD_FOR_STEP if hidden and not kept else GradientAt.NONE
        param.grad = None if kept or hidden else grad
        if not kept:
            left[param] = grad
    return left


def _hold(pipeline: Pipeline, held: dict[Param, torch.Tensor]) -> dict[Param, GradientAt]:
    """The held gradients out of ``param.grad`` while the buckets step (stepped last:
    `GradientAt.HELD_FOR_STEP`); where each cached parameter's was before."""
    before = {}
    for param in held:
        param.grad = None
        record = pipeline.records.get(param)
        if record is not None:
            before[param] = record.gradient
            record.gradient = GradientAt.HELD_FOR_STEP
    return before


def _chunks(params: list[Param], size_bytes: int) -> list[list[Param]]:
    """``params`` in order, in runs of about ``size_bytes`` of gradient (a larger one alone)."""
    chunks: list[list[Param]] = []
    filled = size_bytes
    for param in params:
        nbytes = param.numel() * param.element_size()
        if filled + nbytes > size_bytes and filled:
            chunks.append([])
            filled = 0
        chunks[-1].append(param)
        filled += nbytes
    return chunks


def _step_with(
    step_once: Callable[[], object], grads: list[tuple[Param, torch.Tensor]], stepped: set[Param]
) -> None:
    """A step with exactly ``grads`` set, their parameters then added to ``stepped``;
    ``param.grad`` is None afterwards."""
    params = [param for param, _ in grads]
    try:  # an interrupt while they are set leaves none behind (the retry would step it)
        for param, grad in grads:
            param.grad = sharding.as_grad_of(param, grad)
        step_once()
        stepped.update(params)  # as the call returns (an interrupt in its own tail is not seen)
    finally:
        for param, _ in grads:
            param.grad = None
