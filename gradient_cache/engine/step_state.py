"""The pending step's life: its states, the phases that move it, and what it carries."""

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
    """A fused step's progress on its held gradients, kept for the retry if it raises:
    those already scaled in place and those already stepped (neither twice)."""

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
    # A clip_grad_norm_ answered from the cache (`OptimizerStep.clip`): the factor each
    # gradient still cached is multiplied by as restored, as plain clipped it in place.
    deferred_clip: torch.Tensor | None = None
    norm_read: bool = False  # a norm was read from the cache in this step
    # The backwards (autograd graph task ids) it took gradients from, and whether a step
    # took some of one's while it holds others (a GAN's generator step leaves the critic's,
    # which plain's zero_grad() may clear unseen): a backward adding to them is refused.
    backwards: set[int] = field(default_factory=set)
    siblings_taken: bool = False
    # The parameters zero_grad() calls reached since its last backward (`zeroed_since`),
    # and the backwards they came after.
    zeroed: set[torch.Tensor] = field(default_factory=set)
    zeroed_after: frozenset[int] = frozenset()
    # Its parameters whose optimizer another cache's fused step stepped, passing over the
    # gradients held here (one optimizer over two models, a cache each): not to be dropped.
    passed_over: set[torch.Tensor] = field(default_factory=set)

    def __post_init__(self) -> None:
        _PENDING.add(self)

    def taken(self) -> None:
        """A step takes some of its gradients: every pending step (of every cache, this one
        too) that holds gradients of one of its backwards now holds their siblings."""
        for pending in list(_PENDING):
            if not pending.backwards.isdisjoint(self.backwards):
                pending.siblings_taken = True

    def zeroed_since(self, params: set[torch.Tensor]) -> set[torch.Tensor]:
        """Every parameter zero_grad() reached since the last backward, ``params`` included:
        two optimizers' zero_grad() over a model's halves act as one over the whole."""
        if self.zeroed_after != self.backwards:
            self.zeroed, self.zeroed_after = set(), frozenset(self.backwards)
        self.zeroed |= params
        return self.zeroed

    def restore_factor(self) -> torch.Tensor | None:
        """What a restore outside the fused step multiplies by: the deferred clip's factor,
        or that of a fused step that raised (its stepped buckets had it applied)."""
        return self.deferred_clip if self.clip is None else self.clip[1]

    def partly_stepped(self) -> bool:
        """Whether an interrupted fused step had stepped a bucket or held gradients."""
        return self.counted or bool(self.held and self.held.stepped)


# Every pending step alive (a pipeline drops its own when the step ends).
_PENDING: weakref.WeakSet[PendingStep] = weakref.WeakSet()
