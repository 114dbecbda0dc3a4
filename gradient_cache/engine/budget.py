"""``memory_budget``: offload only what must leave the device, decided from a measurement.

Everything is offloaded through the second step after the warm-up, then what fits the
budget stays on the device, fewest device bytes freed per link byte first. Why, and why the
bound is conservative: docs/ARCHITECTURE.md, "The memory budget".
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .devices import is_accelerator
from .units import MIB

if TYPE_CHECKING:  # for the annotations only: the pipeline imports config, config imports this
    from .pipeline import Pipeline
    from .weights import Weights

REST = "(the rest)"  # the weights' unit that is not a block (embeddings, head, tied weights)

logger = logging.getLogger("gradient_cache")

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMOUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")


class MemoryBudgetError(RuntimeError):
    """Even with everything offloaded, the measured step does not fit the budget."""


@dataclass(frozen=True)
class MemoryBudget:
    """A device-memory budget: a share of the device's memory, or bytes."""

    text: str  # as the user gave it, for messages
    fraction: float | None = None
    nbytes: int | None = None

    @classmethod
    def parse(cls, value: Any) -> MemoryBudget:
        """``"80%"`` or ``0.8`` (a share in (0, 1]), or ``"20GiB"``, ``"512 MiB"``, ``"16GB"``.
        A number written as a string (``"0.8"``) is a share too: ``"80"`` is refused as 80
        is, never taken as 80 bytes."""
        advice = (
            "expected a share of the device's memory such as '80%' or 0.8, or an amount "
            "such as '20GiB' or '512MiB'"
        )
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise TypeError(f"memory_budget must be a string or a number, got {value!r}; {advice}.")
        given = value if isinstance(value, str) else f"{value:g}"
        text = given.strip().lower()
        try:
            share: float | None = float(value)  # float() ignores a string's spaces and case
        except ValueError:  # a percentage or an amount, below
            share = None
        if share is not None:
            if not 0 < share <= 1:  # NaN and the infinities too
                fix = f": '{share:g}%' or '{share:g}GiB'" if 1 < share < math.inf else ""
                raise ValueError(
                    f"Invalid memory_budget: {value!r}; {advice} (a number is a share, so "
                    f"at most 1: write bytes with a unit, or a percentage{fix})."
                )
            return cls(text=given, fraction=share)
        with contextlib.suppress(ValueError):  # not a number before the '%'
            if text.endswith("%") and 0 < float(text[:-1]) <= 100:
                return cls(text=given, fraction=float(text[:-1]) / 100)
        match = _AMOUNT.match(text)
        if match is not None and match.group(2) in _UNITS:
            nbytes = int(float(match.group(1)) * _UNITS[match.group(2)])
            if nbytes > 0:
                return cls(text=given, nbytes=nbytes)
        raise ValueError(f"Invalid memory_budget: {value!r}; {advice}.")

    def bytes_of(self, total: int | None) -> int:
        """The budget in bytes on a device of ``total`` usable bytes (an amount is cut to
        them); ``total`` None (the planner without a device size) only for an amount."""
        if self.nbytes is not None:
            return self.nbytes if total is None else min(self.nbytes, total)
        return int((total or 0) * (self.fraction or 0))


class DeviceMemory(Protocol):
    """What a budget reads of the device: `AcceleratorMemory`, or a ``device_memory=``."""

    def reset_peak(self) -> None:
        """Start counting the peak from now."""

    def peak_bytes(self) -> int:
        """The most bytes the allocator held since `reset_peak`: what it reserved from the
        device, its cached blocks and fragmentation included, not only what tensors use."""

    def outside_bytes(self) -> int:
        """The bytes in use on the device now outside the allocator: the CUDA context,
        NCCL's buffers, other libraries' and other processes' memory."""

    def total_bytes(self) -> int:
        """The device's memory."""

    def process_fraction(self) -> float:
        """The share of `total_bytes` this process's allocator may take (PyTorch's
        ``set_per_process_memory_fraction``; 1.0 where none is set)."""


@dataclass(frozen=True)
class AcceleratorMemory:
    """``device``'s allocator statistics and the driver's view, through `torch.accelerator`
    (CUDA, XPU, a PrivateUse1 device whose allocator derives `c10::DeviceAllocator`)."""

    device: torch.device

    def reset_peak(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return torch.accelerator.max_memory_reserved(self.device)

    def outside_bytes(self) -> int:
        free, total = torch.accelerator.get_memory_info(self.device)
        return max(0, total - free - torch.accelerator.memory_reserved(self.device))

    def total_bytes(self) -> int:
        return torch.accelerator.get_memory_info(self.device)[1]

    def process_fraction(self) -> float:
        # torch.accelerator reads no cap: the device module's (torch.cuda, torch.xpu), if any.
        module = getattr(torch, self.device.type, None)
        read = getattr(module, "get_per_process_memory_fraction", None)
        return 1.0 if read is None else float(read(self.device))


def device_memory_of(device: torch.device) -> DeviceMemory | None:
    """The statistics of ``device``, or None where it keeps none (a CPU; an accelerator
    whose allocator answers no `torch.accelerator` memory query)."""
    if not is_accelerator(device):
        return None
    try:
        torch.accelerator.get_memory_info(device)
    except (RuntimeError, AttributeError):  # no such query (torch 2.6: no memory queries)
        return None
    return AcceleratorMemory(device)


@dataclass(frozen=True)
class Candidate:
    """A tensor the budget may keep on the device: its device bytes while kept, and the
    link bytes a step moves while it is offloaded."""

    name: str  # the parameter's (the unit's, for weights)
    kind: str  # "gradient", "optimizer state" or "weights"
    device_bytes: int
    link_bytes: int


@dataclass(frozen=True)
class BudgetDecision:
    """What a budget kept on the device after measuring the first steps."""

    budget_bytes: int
    measured_peak: int  # the measured steps', everything offloaded
    kept: tuple[Candidate, ...]
    offloaded: tuple[Candidate, ...]

    @property
    def kept_bytes(self) -> int:
        return sum(c.device_bytes for c in self.kept)

    def kept_names(self, kind: str) -> set[str]:
        return {c.name for c in self.kept if c.kind == kind}

    def describe(self) -> str:
        kinds = [c.kind for c in (*self.kept, *self.offloaded)]
        plural = {"gradient": "gradients", "optimizer state": "optimizer states"}
        plural["weights"] = "units of weights"
        parts = [
            f"{len(self.kept_names(kind))} of {kinds.count(kind)} {name}"
            for kind, name in plural.items()
            if kind in kinds
        ]
        of = " of the weights (the gradients and the state as before)" if "weights" in kinds else ""
        kept = f"{' and '.join(parts)} ({self.kept_bytes / MIB:.1f} MiB)"
        if not parts:
            kept = (
                "nothing: it keeps no gradient compressed with error feedback (it would lose "
                "its residual), and no optimizer state is on the host"
            )
        return (
            f"measured peak {self.measured_peak / MIB:.1f} MiB with everything offloaded, "
            f"budget {self.budget_bytes / MIB:.1f} MiB: kept on the device {kept}; "
            f"{sum(c.link_bytes for c in self.offloaded) / MIB:.1f} MiB{of} cross the link a step"
        )


def decide(
    candidates: Sequence[Candidate], *, measured_peak: int, budget_bytes: int, budget: str
) -> BudgetDecision:
    """Keep on the device what fits the budget's room above the measured peak, fewest
    device bytes freed per link byte first (the optimizer state before a gradient that
    frees as much); raise if the measured step alone passes the budget."""
    room = budget_bytes - measured_peak
    if room < 0:
        with_state = any(c.kind != "gradient" for c in candidates)
        everything = "every gradient and the optimizer state" if with_state else "every gradient"
        if any(c.kind == "weights" for c in candidates):
            everything = "the weights, every gradient and the optimizer state"
        fixes = "raise the budget, "
        if not with_state:
            fixes += "offload the optimizer state (offload_optimizer_state=True), "
        # An optimizer that had state before the cache (resumed, or stepped plainly) keeps
        # it on the device until its first fused step: the first steps measured it there.
        earlier = (
            " If the optimizer had state on the device before the cache was created, call "
            "hook_manager.offload_state_of(optimizer) right after creating it, so the first "
            "steps run without that state."
            if with_state
            else ""
        )
        raise MemoryBudgetError(
            f"memory_budget={budget!r} is {budget_bytes / MIB:.1f} MiB, and the first steps "
            f"peaked at {measured_peak / MIB:.1f} MiB with {everything} offloaded: "
            f"{(measured_peak - budget_bytes) / MIB:.1f} MiB over. To fit: {fixes}compress "
            "more, or lower the activations (smaller micro-batches, activation checkpointing)."
            f"{earlier}"
        )

    def value(c: Candidate) -> tuple[float, bool]:
        return c.device_bytes / max(c.link_bytes, 1), c.kind == "gradient"

    # A kept gradient steps with its parameter's state on the device: its cost counts an
    # offloaded state too (every state is decided before any gradient: `value`).
    state_bytes = {c.name: c.device_bytes for c in candidates if c.kind == "optimizer state"}
    kept, offloaded, kept_states = [], [], set()
    for candidate in sorted(candidates, key=value):
        cost = candidate.device_bytes
        if candidate.kind == "gradient" and candidate.name not in kept_states:
            cost += state_bytes.get(candidate.name, 0)
        if cost <= room:
            kept.append(candidate)
            room -= cost
            if candidate.kind != "gradient":
                kept_states.add(candidate.name)
        else:
            offloaded.append(candidate)
    return BudgetDecision(budget_bytes, measured_peak, tuple(kept), tuple(offloaded))


class BudgetWatch:
    """A manager's budget: measures the steps through the second after the warm-up (a
    resumed run: two of its own at least), then keeps on the device what fits. It keeps its
    own running maximum of its samples, so an outside reset of the peak statistics
    (per-step logging) lowers no sample already taken."""

    def __init__(
        self,
        budget: MemoryBudget,
        memory: DeviceMemory | None,
        device: str,
        *,
        warmup_steps: int,
        weights: Weights | None = None,
    ) -> None:
        """``weights``: the weights' owner where they are on the host (``offload_parameters``):
        then the budget keeps units of weights (see the module docstring)."""
        self.budget = budget
        self.memory = memory
        self.weights = weights
        self.decision: BudgetDecision | None = None
        self.warmup_steps = warmup_steps
        # The pipeline's step count at this watch's first restore: a resumed run's is the
        # loaded one (deciding on it alone measured no optimizer step).
        self.first_step: int | None = None
        self.peak = 0  # the running maximum of the samples
        if memory is None:
            self.note = (
                f"memory_budget={budget.text!r}: a {device} device keeps no memory statistics, "
                "so there is nothing to budget: everything is offloaded"
            )
            logger.info("gradient-cache: %s", self.note)
        else:
            self.note = (
                f"memory_budget={budget.text!r}: measuring the steps through the second after "
                "the warm-up (resumed: two of its own at least)"
            )
            memory.reset_peak()

    def measure_from_now(self) -> None:
        """Training starts: an undecided budget's peak counts from here, so a resume's
        loaded state, on the device until offloaded, is not measured as part of a step."""
        if self.memory is not None and self.decision is None:
            self.memory.reset_peak()
            self.peak = 0

    def sample(self) -> None:
        """Take the device's figure now into the running maximum (until the decision)."""
        if self.memory is not None and self.decision is None:
            self.peak = max(self.peak, checked_peak(self.memory) + self.memory.outside_bytes())

    def before_restore(self, pipeline: Pipeline) -> None:
        """After the measured steps (their state exists, the peak holds them): decide and
        keep what fits; raises before the step's restore if nothing can fit."""
        self.sample()
        if self.memory is None or self.decision is not None:
            return
        if self.first_step is None:
            self.first_step = pipeline.steps
        # Through the second step after the (lossless) warm-up, and the second of this
        # watch's own: a first step creates the optimizer's state in place (a resumed run's
        # new optimizer too), while later steps bring the next bucket's state ahead too (a
        # higher peak: deciding on the first ran out of memory).
        if pipeline.steps < max(self.warmup_steps, self.first_step) + 2:
            return
        usable = int(self.memory.total_bytes() * self.memory.process_fraction())
        decision = decide(
            candidates_of(pipeline) if self.weights is None else units_of(self.weights),
            measured_peak=self.peak,
            budget_bytes=self.budget.bytes_of(usable),
            budget=self.budget.text,
        )
        if self.weights is not None:  # raises, all on the host still, if they do not fit
            self.weights.keep_on_device(decision.kept_names("weights"))
        self.decision = decision
        by_name = pipeline.params_by_name()
        for name in decision.kept_names("gradient"):
            # Later backward passes leave its gradient on the device, as exclude_layers would.
            pipeline.records[by_name[name]].keep_on_device = True
        states = pipeline.optimizer_state
        if states is not None:
            states.keep_on_device([by_name[n] for n in decision.kept_names("optimizer state")])
        self.note = f"memory_budget={self.budget.text!r}: {decision.describe()}"
        logger.info("gradient-cache: %s", self.note)


def checked_peak(memory: DeviceMemory) -> int:
    """``memory.peak_bytes()``, refused unless a whole number of bytes >= 0: a NaN would
    silently offload everything, a negative peak keep more than fits."""
    peak = memory.peak_bytes()
    if isinstance(peak, bool) or not isinstance(peak, numbers.Integral) or peak < 0:
        raise RuntimeError(
            f"memory_budget: the device-memory reader {type(memory).__name__}.peak_bytes() "
            f"returned {peak!r}; expected a whole number of bytes >= 0. Fix that reader (the "
            "device_memory= passed to create_gradient_cache), or drop memory_budget."
        )
    return int(peak)


def candidates_of(pipeline: Pipeline) -> list[Candidate]:
    """Each cached gradient without a residual (its steady route's payload, both ways) and, with
    the state offloaded, each parameter's state host copies."""
    routes = pipeline.plan.at(pipeline.config.warmup_steps)
    candidates = [
        Candidate(
            record.name,
            "gradient",
            device_bytes=route.numel * param.element_size(),
            link_bytes=2 * (route.payload_bytes + route.residual_bytes),
        )
        for param, record in pipeline.records.items()
        # One with a residual (what compression held back) would lose it, kept on the device.
        if (route := routes[param]).residual is None
    ]
    states = pipeline.optimizer_state
    by_param = {} if states is None else states.bytes_by_param()
    candidates += [
        Candidate(pipeline.records[param].name, "optimizer state", nbytes, 2 * nbytes)
        for param, nbytes in by_param.items()
        if param in pipeline.records and nbytes
    ]
    return candidates


def units_of(weights: Weights) -> list[Candidate]:
    """The units of the weights on the host as `unit_candidates`, by their names."""
    sizes = {
        name: sum(p.numel() * p.element_size() for p in params)
        for name, params in weights.units.items()
    }
    rest = sizes.pop(REST, None)
    return unit_candidates(None if rest is None else (REST, rest), list(sizes.items()))


def unit_candidates(
    rest: tuple[str, int] | None, blocks: Sequence[tuple[str, int]]
) -> list[Candidate]:
    """The weights' units, ``(name, bytes)`` each (``blocks`` in forward order). A streamed
    unit costs four copies a one-micro-batch step (forward, backward, the step's two); the
    rest and the last block three: they stay from forward to the end of backward."""
    units = [] if rest is None else [(*rest, 3)]
    last = len(blocks) - 1
    units += [(name, nbytes, 3 if i == last else 4) for i, (name, nbytes) in enumerate(blocks)]
    return [Candidate(name, "weights", nbytes, copies * nbytes) for name, nbytes, copies in units]
