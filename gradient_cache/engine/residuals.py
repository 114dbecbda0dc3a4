"""Error-feedback residuals: the one owner of each parameter's residual, current and pending.

A pending step's new residuals stay beside the current ones (``keep_previous_residual``),
so a discard leaves those as they were; with a GradScaler, those a completed step replaced
stay until the skip is known (`Pipeline.settle_scaled_step`). See docs/ARCHITECTURE.md,
"The life of a residual".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch

from .pool import HostPool

Param = torch.nn.Parameter


class ResidualStore(ABC):
    """Current residuals (as of the last completed step) and a pending step's new ones."""

    # The parameters a pending step wrote a residual of; those whose replaced one is kept.
    _pending: dict[Param, torch.Tensor] | set[Param]
    _replaced: dict[Param, torch.Tensor | None] | set[Param]

    def __init__(self, *, keep_previous: bool) -> None:
        self.keep_previous = keep_previous

    def any_pending(self) -> bool:
        """Whether a pending step wrote any residual: without error feedback, never."""
        return bool(self._pending)

    @abstractmethod
    def read(self, param: Param) -> torch.Tensor | None:
        """``param``'s residual for its next encode (pending, else current) on its device."""

    @abstractmethod
    def write(self, param: Param, new: torch.Tensor, *, non_blocking: bool) -> None:
        """Keep ``new`` (a device tensor) as ``param``'s pending residual; without
        ``keep_previous``, as its current one. Runs where the backend's copies run."""

    @abstractmethod
    def promote(self, params: Iterable[Param], *, keep_replaced: bool) -> None:
        """The pending residuals of ``params`` become their current ones (step delivered).
        ``keep_replaced``: keep the current ones they replace for `bring_back_replaced`."""

    @abstractmethod
    def bring_back_replaced(self) -> None:
        """The residuals promotions kept make current again (their step was skipped)."""

    def forget_replaced(self) -> None:
        """Drop the residuals promotions kept (their step stands)."""
        self._replaced.clear()

    def drop_pending(self) -> None:
        """Forget every pending residual (the step was discarded)."""
        self._pending.clear()

    @abstractmethod
    def current(self) -> dict[Param, torch.Tensor]:
        """The current residuals, stored form (read-only views)."""

    @abstractmethod
    def pending(self) -> dict[Param, torch.Tensor]:
        """A pending step's new residuals, stored form (read-only views)."""

    @abstractmethod
    def replaced(self) -> dict[Param, torch.Tensor]:
        """The residuals promotions kept for `bring_back_replaced` (with a GradScaler, until
        the next step knows its verdict), stored form (read-only views)."""

    @abstractmethod
    def load(self, current: dict[Param, torch.Tensor], pending: dict[Param, torch.Tensor]) -> None:
        """Take ``current`` and ``pending`` (CPU tensors, stored form), and no other residual;
        without ``keep_previous`` the pending ones as current. Nothing is in flight."""

    def held(self) -> list[torch.Tensor]:
        """Every residual held now: current, a pending step's new ones, and those kept."""
        return [*self.current().values(), *self.pending().values(), *self.replaced().values()]

    def nbytes(self) -> int:
        """Bytes now: every residual held (`held`)."""
        return sum(r.numel() * r.element_size() for r in self.held())


class DeviceResiduals(ResidualStore):
    """Residuals as tensors on the encode's device (host RAM on the CPU backend)."""

    def __init__(self, device: torch.device, *, keep_previous: bool) -> None:
        super().__init__(keep_previous=keep_previous)
        self.device = device
        self._current: dict[Param, torch.Tensor] = {}
        self._pending: dict[Param, torch.Tensor] = {}
        self._replaced: dict[Param, torch.Tensor | None] = {}  # None: it had none

    def read(self, param: Param) -> torch.Tensor | None:
        return self._pending.get(param, self._current.get(param))

    def write(self, param: Param, new: torch.Tensor, *, non_blocking: bool) -> None:
        (self._pending if self.keep_previous else self._current)[param] = new

    def promote(self, params: Iterable[Param], *, keep_replaced: bool) -> None:
        for param in params:
            if param in self._pending:
                if keep_replaced and param not in self._replaced:
                    self._replaced[param] = self._current.get(param)
                self._current[param] = self._pending.pop(param)

    def bring_back_replaced(self) -> None:
        for param, replaced in self._replaced.items():
            if replaced is None:
                self._current.pop(param, None)
            else:
                self._current[param] = replaced
        self.forget_replaced()

    def current(self) -> dict[Param, torch.Tensor]:
        return dict(self._current)

    def pending(self) -> dict[Param, torch.Tensor]:
        return dict(self._pending)

    def replaced(self) -> dict[Param, torch.Tensor]:
        return {param: kept for param, kept in self._replaced.items() if kept is not None}

    def load(self, current: dict[Param, torch.Tensor], pending: dict[Param, torch.Tensor]) -> None:
        # Copies, allocated on the current stream (the caller's tensors stay the caller's).
        self._current = {p: r.to(self.device, copy=True) for p, r in current.items()}
        self._pending = {p: r.to(self.device, copy=True) for p, r in pending.items()}
        self._replaced = {}
        if not self.keep_previous:  # a pending step's residual is current at once here
            self._current |= self._pending
            self._pending = {}


class HostSlotResiduals(ResidualStore):
    """Residuals in the pinned pool's slots: the current one, and a spare for a pending step.
    ``pool`` is read at each call (the backend re-lays it at the warm-up's end)."""

    def __init__(
        self,
        pool: Callable[[], HostPool[Param]],
        to_device: Callable[[torch.Tensor], torch.Tensor],
        *,
        keep_previous: bool,
    ) -> None:
        super().__init__(keep_previous=keep_previous)
        self._pool = pool
        self._to_device = to_device
        self._pending: set[Param] = set()  # params whose spare holds a pending residual
        self._replaced: set[Param] = set()  # params whose spare holds a replaced residual

    def _current(self, param: Param) -> torch.Tensor:
        residual = self._pool().slots[param].residual
        assert residual is not None  # called only for parameters whose slot holds a residual
        return residual

    def _target(self, param: Param) -> torch.Tensor:
        slot = self._pool().slots[param]
        return self._current(param) if slot.spare_residual is None else slot.spare_residual

    def read(self, param: Param) -> torch.Tensor | None:
        slot = self._pool().slots[param]
        stored = self._target(param) if param in self._pending else slot.residual
        return None if stored is None else self._to_device(stored)

    def write(self, param: Param, new: torch.Tensor, *, non_blocking: bool) -> None:
        target = self._target(param)
        # Into a pageable slab (its pinning failed) the copy blocks the host.
        target.copy_(new, non_blocking=non_blocking and self._pool().is_pinned(target))
        if self.keep_previous:
            self._pending.add(param)

    def promote(self, params: Iterable[Param], *, keep_replaced: bool) -> None:
        # After the drain: no copy writes either slot, and the old one is rewritten only by
        # a later step's copy, after the engine settled whether to bring it back.
        for param in params:
            if param in self._pending:
                self._pending.discard(param)
                self._swap(param)
                if keep_replaced:
                    self._replaced.add(param)

    def _swap(self, param: Param) -> None:
        slot = self._pool().slots[param]
        slot.residual, slot.spare_residual = slot.spare_residual, slot.residual

    def bring_back_replaced(self) -> None:
        for param in self._replaced:
            self._swap(param)
        self.forget_replaced()

    def current(self) -> dict[Param, torch.Tensor]:
        slots = self._pool().slots.items()
        return {p: s.residual for p, s in slots if s.residual is not None}

    def pending(self) -> dict[Param, torch.Tensor]:
        return {p: self._target(p) for p in self._pending}

    def replaced(self) -> dict[Param, torch.Tensor]:
        spares = {p: self._pool().slots[p].spare_residual for p in self._replaced}
        return {param: spare for param, spare in spares.items() if spare is not None}

    def load(self, current: dict[Param, torch.Tensor], pending: dict[Param, torch.Tensor]) -> None:
        self._replaced = set()
        self._pending = set()  # a copy that raises leaves only the loaded ones pending
        # Only the state's residuals: one it lacks starts at zero, as a new residual (not
        # what this manager held before the load).
        for residual in self.current().values():
            residual.zero_()
        for param, saved in current.items():
            self._current(param).copy_(saved)  # nothing in flight: plain host copies
        for param, saved in pending.items():
            if self.keep_previous:
                self._target(param).copy_(saved)
                self._pending.add(param)
            else:  # a pending step's residual is current at once here (there is no spare)
                self._current(param).copy_(saved)
