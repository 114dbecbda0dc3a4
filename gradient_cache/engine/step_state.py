"""The pending step's life: its states, the phases that move it, and what it carries.

`Pipeline` moves `StepState` phase by phase (`Pipeline._enter`); each phase may start only
from the states `PHASES_FROM` lists for it.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field

import torch

from .norms import StepNorms


class StepState(enum.Enum):
    """Where the pending step is in its life; `Pipeline` moves it, phase by phase."""

    IDLE = "idle"  # no step pending: nothing cached, waiting in a bucket or held back
    CAPTURING = "capturing"  # backward hands gradients over; buckets may be in flight
    CACHED = "cached"  # drained: host memory holds every gradient of the step
    STEPPING = "stepping"  # a restore delivered part of it (counted); the rest is cached
    INTERRUPTED = "interrupted"  # a fused step raised; its retry reuses the kept clip


IDLE, CAPTURING, CACHED, STEPPING, INTERRUPTED = StepState
# Each phase and the states it may start from (where it leads is the phase's to decide).
PHASES_FROM: dict[str, frozenset[StepState]] = {
    "capture": frozenset({IDLE, CAPTURING, CACHED, STEPPING}),
    "launch": frozenset({CAPTURING}),
    "drain": frozenset(StepState),
    "deliver": frozenset({CACHED, STEPPING}),
    "finish": frozenset({IDLE, CACHED, STEPPING}),
    "interrupt": frozenset({IDLE, CACHED, STEPPING}),
    "retry": frozenset({INTERRUPTED}),
    "discard": frozenset(StepState),
    "restart": frozenset({IDLE}),
    "resume": frozenset({IDLE}),
}
# Why a phase cannot start from a state, where a user's call order can get there.
ADVICE = {
    INTERRUPTED: "a fused step(optimizer) raised and was neither retried nor discarded: call "
    "step(optimizer) again to finish that step (or discard_gradients() to skip it, where it "
    "had stepped no bucket yet), first",
}

# A fused step's global gradient norm and clip factor (None, None without clipping).
Clip = tuple[torch.Tensor | None, torch.Tensor | None]


class StepStateError(RuntimeError):
    """A phase of a step started from a state it cannot start from."""


@dataclass
class HeldProgress:
    """A fused step's progress on the gradients held for it (`GradientAt.HELD_FOR_STEP`),
    kept for the retry when it raises: those already multiplied in place by the step's
    factor (unscale and clip: not twice), and those already stepped (not twice either)."""

    scaled: set[torch.nn.Parameter] = field(default_factory=set)
    stepped: set[torch.nn.Parameter] = field(default_factory=set)


@dataclass(eq=False)  # by identity: `_PENDING` holds them
class PendingStep:
    """The pending step: from its first gradient until all it cached is restored or dropped."""

    # The engine's generators as it found them (None: unknown, a checkpoint made on another
    # kind of device); `discard` rewinds them.
    random_state: dict[str, torch.Tensor] | None
    # With an enabled GradScaler: whether any gradient it encoded was not finite (a device
    # bool, written by the encodes); None without a scaler, or unknown (a resumed step).
    found_inf: torch.Tensor | None = None
    # Each encoded gradient's norm of the type the last clipped fused step used, written
    # by its last encode (the accumulated gradient's); None: the encodes compute none.
    norms: StepNorms | None = None
    counted: bool = False  # delivered at least once, so counted in `Pipeline.steps`
    clip: Clip | None = None  # INTERRUPTED: what the fused step's retry reuses
    held: HeldProgress | None = None  # INTERRUPTED: and how far it got with held gradients
    # A clip_grad_norm_ answered from the cache (`OptimizerStep.clip`): the factor every gradient
    # of the step still cached is multiplied by as it is restored, as plain PyTorch
    # multiplied it in place at the clip. None: no such clip.
    deferred_clip: torch.Tensor | None = None
    norm_read: bool = False  # a norm was read from the cache in this step
    # The backwards (autograd's graph task ids) whose gradients it took, and whether a step
    # took gradients of one of them while it still holds others (`Pipeline.deliver`): a
    # GAN's generator step leaves its discriminator's, which plain PyTorch's zero_grad()
    # may clear unseen, so a backward adding to them is refused (`Capture`).
    backwards: set[int] = field(default_factory=set)
    siblings_taken: bool = False
    # The parameters zero_grad() calls reached since its last backward (`zeroed_since`),
    # and the backwards they came after.
    zeroed: set[torch.Tensor] = field(default_factory=set)
    zeroed_after: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        _PENDING.add(self)

    def taken(self) -> None:
        """A step takes some of its gradients: every pending step (of every cache, this one
        too) that holds gradients of one of its backwards now holds their siblings."""
        for pending in list(_PENDING):
            if not pending.backwards.isdisjoint(self.backwards):
                pending.siblings_taken = True

    def zeroed_since(self, params: set[torch.Tensor]) -> set[torch.Tensor]:
        """Every parameter the zero_grad() calls since this step's last backward reached,
        ``params`` (this call's) included: two optimizers' zero_grad() over the two halves
        of a model skip a batch as one over the whole does. A backward in between starts
        over (its gradients are new)."""
        if self.zeroed_after != self.backwards:
            self.zeroed, self.zeroed_after = set(), frozenset(self.backwards)
        self.zeroed |= params
        return self.zeroed

    def restore_factor(self) -> torch.Tensor | None:
        """What a restore outside the fused step multiplies by: the deferred clip's factor,
        or a fused step's that raised (a close then puts back what plain's ``.grad`` holds
        after its unscale and clip: that step's buckets stepped so)."""
        return self.deferred_clip if self.clip is None else self.clip[1]

    def partly_stepped(self) -> bool:
        """Whether an interrupted fused step had stepped a bucket or held gradients."""
        return self.counted or bool(self.held and self.held.stepped)


# Every pending step alive (a pipeline drops its own when the step ends).
_PENDING: weakref.WeakSet[PendingStep] = weakref.WeakSet()
