"""Device-memory accounting: the peak of device-resident bytes over the phases of a step.

On a CUDA device the caching allocator keeps the figures: `CudaMemoryMeter` reads
``torch.cuda.max_memory_allocated`` per phase. On a CPU-only run "device" and host are the
same RAM and no allocator counts for us, so `TensorMemoryTracker` counts tensor storages
itself: a TorchDispatchMode sees every operator, registers each storage it touches (a
weakref drops it when it is freed) and, after each operator, takes

    device bytes = bytes of live storages - bytes the gradient cache holds as host copies

so the figures mean what they would on a GPU. On another accelerator (the emulated device
of `gradient_cache.testing`, whose allocator holds a real cap) `AllocatorAndTracker` reads
``torch.accelerator``'s allocator figures and runs the tracker beside them, for the
categories and a second, accounted figure. `device_memory_meter` picks the meter.

A tensor subclass that wraps other tensors (torchao's 8-bit optimizer state, a DTensor)
counts as the tensors inside it (``__tensor_flatten__``), not as the dense tensor it poses
as: an 8-bit Adam moment is its uint8 codes, block scales and code table.

Limits of the CPU tracker: it sees operators run on the thread that entered it, only
storages that an operator touched or that it was told about (parameters, gradients,
optimizer state, the cache's tensors), and not the scratch memory an operator frees before
it returns; code run under `DeviceMemoryMeter.opaque` (a compiled optimizer step) counts
as one such operator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..engine.devices import current_accelerator_type
from ..engine.figures import host_tensors
from ..engine.units import MIB as MIB  # re-exported: perf/ reads it from here
from ._torch_private import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    is_traceable_wrapper_subclass,
    tree_leaves,
)

if TYPE_CHECKING:
    from ..manager import GradientCacheHookManager

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
ENGINE_SCRATCH = "engine scratch"
OTHER = "activations and other"
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ENGINE_SCRATCH, OTHER)

TensorSource = Callable[[], Iterable[torch.Tensor]]
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


@dataclass(frozen=True, kw_only=True)
class MemoryReading:
    """Device-resident bytes at one moment, and the host-store bytes beside them."""

    device_bytes: int
    host_bytes: int
    #: Device bytes per entry of CATEGORIES; empty where the meter cannot tell (CUDA).
    by_category: dict[str, int] = field(default_factory=dict)
    #: The tensor tracker's device bytes beside an allocator's ``device_bytes``
    #: (`AllocatorAndTracker`); None where one meter gives the one figure.
    accounted_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class PhasePeak:
    """The device peak of one phase, and each category's own maximum over it."""

    peak: MemoryReading
    #: Per category, the most device bytes it held at any moment of the phase (CPU only).
    max_by_category: dict[str, int] = field(default_factory=dict)


class DeviceMemoryMeter(ABC):
    """Measures device memory over named phases: ``with meter, meter.phase("backward"): ...``.

    ``peaks[name]`` holds each finished phase's `PhasePeak`; ``reading()`` is the state now.
    Phases do not nest (the CUDA allocator keeps one peak counter).
    """

    def __init__(self) -> None:
        self.peaks: dict[str, PhasePeak] = {}
        self._in_phase = False

    @abstractmethod
    def reading(self) -> MemoryReading:
        """Device-resident bytes now."""

    @abstractmethod
    def _begin_phase(self) -> None: ...

    @abstractmethod
    def _end_phase(self) -> PhasePeak: ...

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the device peak of the enclosed code as ``peaks[name]``."""
        if self._in_phase:
            raise RuntimeError(f"Phase {name!r} started inside another phase; phases do not nest.")
        self._in_phase = True
        self._begin_phase()
        try:
            yield
        finally:
            self._in_phase = False
            self.peaks[name] = self._end_phase()

    @contextlib.contextmanager
    def opaque(self) -> Iterator[None]:
        """Run the enclosed code as one operator, unseen inside (the CPU tracker's dispatch
        mode makes torch.compile refuse to run, as torchao's 8-bit step is); the allocator's
        counters on CUDA see everything anyway."""
        yield

    def __enter__(self) -> DeviceMemoryMeter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None


def plain_tensors(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensor``, or the tensors a wrapper subclass holds (recursively): what occupies
    memory. A wrapper's own storage has the size of the dense tensor it poses as."""
    if type(tensor) is torch.Tensor or not is_traceable_wrapper_subclass(tensor):
        return (tensor,)  # the first test: the common case, and no wrapper (per operator)
    names, _ = tensor.__tensor_flatten__()
    inner = (getattr(tensor, name) for name in names)  # a DTensor also names its mesh
    return tuple(t for each in inner if isinstance(each, torch.Tensor) for t in plain_tensors(each))


def optimizer_state_tensors(optimizer: Optimizers | None) -> Iterator[torch.Tensor]:
    """The plain tensors in the state of ``optimizer`` (one, or several: one optimizer per
    parameter, as when stepping in backward). Non-tensor entries (bitsandbytes' int step
    counter) hold no tensor memory."""
    if optimizer is None:
        return
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    for each in optimizers:
        for state in each.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield from plain_tensors(value)


def cache_tensors(
    cache: GradientCacheHookManager,
) -> tuple[TensorSource, TensorSource, TensorSource]:
    """(host tensors, device scratch tensors, device weights) of a GradientCacheHookManager.

    Host: the cached payloads, the error-feedback residuals kept on the host, the optimizer
    state's host copies and the weights' masters. Scratch: the codecs' reusable buffers.
    Weights: the weights' device tensors (``offload_parameters``), resized in place.
    """

    def host() -> tuple[torch.Tensor, ...]:
        # Read before every operator: the host tensors alone, not every list of
        # `cache.cache_tensors()` (the same, once the cache is closed: none).
        engine = cache.engine
        return () if engine is None else host_tensors(engine)

    def scratch() -> tuple[torch.Tensor, ...]:
        return cache.cache_tensors().scratch

    # A weight keeps its device tensor while the cache lives (its storage is resized, the
    # tensor stays): read once, not before every operator.
    held_weights = cache.cache_tensors().weights

    def weights() -> tuple[torch.Tensor, ...]:
        return held_weights

    return host, scratch, weights


def device_memory_meter(
    model: torch.nn.Module,
    *,
    optimizer: Optimizers | None = None,
    cache: GradientCacheHookManager | None = None,
    cap_bytes: int | None = None,
) -> DeviceMemoryMeter:
    """The meter for the device ``model`` lives on; ``cache`` is its GradientCacheHookManager;
    ``optimizer`` one optimizer or several (one per parameter). ``cap_bytes``: on a CPU, the
    tracker holds this device cap (`TensorMemoryTracker`); on CUDA the allocator holds
    whatever cap the process set (``torch.cuda.set_per_process_memory_fraction``)."""
    # With offload_parameters the weights are host tensors at rest: the cache knows the device.
    engine = None if cache is None else cache.engine
    device = next(model.parameters()).device if engine is None else engine.backend.device
    host, scratch, weights = cache_tensors(cache) if cache is not None else (_nothing,) * 3
    if device.type == "cuda":
        return CudaMemoryMeter(device=device, host=host)
    if device.type != "cpu" and current_accelerator_type() != device.type:
        raise ValueError(
            f"No device-memory meter for {device}; expected a cpu model or one on the "
            "current accelerator (torch.accelerator)."
        )
    tracker = TensorMemoryTracker(
        params=list(model.parameters()),
        optimizer=optimizer,
        host=host,
        scratch=scratch,
        weights=weights,
        # An accelerator's allocator holds its own cap, and keeps host tensors apart.
        cap_bytes=cap_bytes if device.type == "cpu" else None,
        device_type=None if device.type == "cpu" else device.type,
    )
    if device.type == "cpu":
        return tracker
    return AllocatorAndTracker(AcceleratorMemoryMeter(host=host), tracker)


def _nothing() -> tuple[torch.Tensor, ...]:
    return ()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once; a wrapper
    subclass as the tensors inside it)."""
    plain = (inner for tensor in tensors for inner in plain_tensors(tensor))
    storages = {id(s): s.nbytes() for s in map(torch.Tensor.untyped_storage, plain)}
    return sum(storages.values())


def view_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` themselves: host payloads are views of one pinned slab."""
    return sum(t.numel() * t.element_size() for tensor in tensors for t in plain_tensors(tensor))


class CudaMemoryMeter(DeviceMemoryMeter):
    """Device figures from the CUDA caching allocator; the host store read at each phase end.

    Counts every tensor of the process on ``device``, not only one model's.
    """

    def __init__(self, *, device: torch.device, host: TensorSource = _nothing) -> None:
        super().__init__()
        self.device = device
        self._host = host

    def reading(self) -> MemoryReading:
        torch.cuda.synchronize(self.device)
        return MemoryReading(
            device_bytes=torch.cuda.memory_allocated(self.device),
            host_bytes=view_bytes(self._host()),
        )

    def _begin_phase(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def _end_phase(self) -> PhasePeak:
        torch.cuda.synchronize(self.device)
        return PhasePeak(
            peak=MemoryReading(
                device_bytes=torch.cuda.max_memory_allocated(self.device),
                host_bytes=view_bytes(self._host()),
            )
        )


class AcceleratorMemoryMeter(DeviceMemoryMeter):
    """Device figures from the current accelerator's allocator (``torch.accelerator``'s
    memory functions: the emulated device's, a CUDA or XPU device's); the host store read
    at each phase end. Counts every tensor of the process on the device."""

    def __init__(self, *, host: TensorSource = _nothing) -> None:
        super().__init__()
        self._host = host

    def reading(self) -> MemoryReading:
        torch.accelerator.synchronize()
        return MemoryReading(
            device_bytes=torch.accelerator.memory_allocated(),
            host_bytes=view_bytes(self._host()),
        )

    def _begin_phase(self) -> None:
        torch.accelerator.synchronize()
        torch.accelerator.reset_peak_memory_stats()

    def _end_phase(self) -> PhasePeak:
        torch.accelerator.synchronize()
        return PhasePeak(
            peak=MemoryReading(
                device_bytes=torch.accelerator.max_memory_allocated(),
                host_bytes=view_bytes(self._host()),
            )
        )


_PHASE = "phase"  # the name of the current phase in each of AllocatorAndTracker's meters


class AllocatorAndTracker(DeviceMemoryMeter):
    """An allocator's figures (``device_bytes``: what the device's cap is held against),
    with a `TensorMemoryTracker` beside it: its categories at its own peak and its device
    bytes (``accounted_bytes``). The tracker's dispatch mode slows a step as on the CPU."""

    def __init__(self, allocator: DeviceMemoryMeter, tracker: TensorMemoryTracker) -> None:
        super().__init__()
        self.allocator = allocator
        self.tracker = tracker
        self._phases = contextlib.ExitStack()

    def reading(self) -> MemoryReading:
        accounted = self.tracker.reading()
        return MemoryReading(
            device_bytes=self.allocator.reading().device_bytes,
            host_bytes=accounted.host_bytes,
            by_category=accounted.by_category,
            accounted_bytes=accounted.device_bytes,
        )

    def _begin_phase(self) -> None:
        # Each meter's own phase (the tracker samples after each operator only inside one);
        # the allocator's entered last, so its peak counter starts from the phase's start.
        self._phases = contextlib.ExitStack()
        self._phases.enter_context(self.tracker.phase(_PHASE))
        self._phases.enter_context(self.allocator.phase(_PHASE))

    def _end_phase(self) -> PhasePeak:
        self._phases.close()
        allocated, accounted = self.allocator.peaks[_PHASE], self.tracker.peaks[_PHASE]
        return PhasePeak(
            peak=MemoryReading(
                device_bytes=allocated.peak.device_bytes,
                host_bytes=accounted.peak.host_bytes,
                by_category=accounted.peak.by_category,
                accounted_bytes=accounted.peak.device_bytes,
            ),
            max_by_category=accounted.max_by_category,
        )

    @contextlib.contextmanager
    def opaque(self) -> Iterator[None]:
        with self.tracker.opaque():
            yield

    def __enter__(self) -> AllocatorAndTracker:
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.tracker.__exit__(*exc_info)


@dataclass
class _Entry:
    nbytes: int
    category: str
    ref: weakref.ref[torch.UntypedStorage]


class _OperatorObserver(TorchDispatchMode):
    """Calls ``on_operator(func, args, kwargs)``, which runs the operator, for each one."""

    def __init__(self, on_operator: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]) -> None:
        super().__init__()
        self._on_operator = on_operator

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self._on_operator(func, args, kwargs or {})


class TensorMemoryTracker(DeviceMemoryMeter):
    """Counts live CPU tensor storages by category, leaving out the host store.

    Args:
        params: the model's parameters; their storages count as parameters, and their
            gradients as gradients: ``param.grad``, and each gradient as backward hands it
            over, before a post-accumulate-grad hook (the cache's) can take it away.
        optimizer: one or several (one per parameter); their state tensors count as
            optimizer state (tagged on entry, at each phase start and after `opaque` code:
            run one step before measuring, so the state exists).
        host: the tensors held as host copies right now, read before every operator. An
            operator's new output counts as host too when all its tensor inputs do (the
            store merging two payloads), as it would run on the host of a GPU machine.
        scratch: the engine's reusable device buffers (tagged like the optimizer state).
        weights: device tensors whose storages their owner resizes in place (the cache's
            weights with ``offload_parameters``: allocated while in use, emptied after).
            No operator sees a storage resize, so each of these counts as parameters with
            its storage's size at each reading, not the size it had when first seen.
        cap_bytes: a device cap the tracker holds within phases, as a device's allocator
            would: an operator after which more device bytes are counted raises
            ``torch.OutOfMemoryError`` (the memory it took is not freed first, so the
            cap is held at the granularity of one operator).
        device_type: on an accelerator (the emulated device's ``"emu"``), count only the
            storages on it: host tensors are apart there, and the host store is what
            ``host`` holds. None (default): every storage, less the host store (the CPU).
    """

    def __init__(
        self,
        *,
        params: Sequence[torch.nn.Parameter] = (),
        optimizer: Optimizers | None = None,
        host: TensorSource = _nothing,
        scratch: TensorSource = _nothing,
        weights: TensorSource = _nothing,
        cap_bytes: int | None = None,
        device_type: str | None = None,
    ) -> None:
        super().__init__()
        self._cap_bytes = cap_bytes
        self._device_type = device_type
        self._params = [p for p in params if p.requires_grad]
        self._optimizer = optimizer
        self._host = host
        self._scratch = scratch
        self._weights = weights
        # The weights' storages and their entries, while entered: a storage held alive keeps
        # its id, which keys its entry, so the entry stays (see `_follow_resized_weights`).
        self._resized: list[tuple[torch.UntypedStorage, _Entry]] = []
        self._entries: dict[int, _Entry] = {}  # by id() of the live storage object
        self._gradient_keys: set[int] = set()  # the entries counted as gradients
        self._host_made: set[int] = set()  # entries made from host tensors only
        self._by_category = dict.fromkeys(CATEGORIES, 0)
        self._observer = _OperatorObserver(self._run_operator)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._peak = MemoryReading(device_bytes=0, host_bytes=0)
        self._max_by_category: dict[str, int] = {}

    # --- lifetime -----------------------------------------------------------------

    def __enter__(self) -> TensorMemoryTracker:
        self._tag(self._params, PARAMETERS)
        self._tag(self._weights(), PARAMETERS)
        # Held: a storage object kept alive keeps its id, which keys its entry.
        storages = [t.untyped_storage() for t in self._weights()]
        entries = ((s, self._entries.get(id(s))) for s in storages)
        self._resized = [(s, entry) for s, entry in entries if entry is not None]
        self._tag_state()
        self._tag_gradients()
        self._hooks = [p.register_hook(self._on_gradient) for p in self._params]
        self._observer.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._observer.__exit__(None, None, None)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._resized = []

    @contextlib.contextmanager
    def opaque(self) -> Iterator[None]:
        if _get_current_dispatch_mode() is not self._observer:
            raise RuntimeError("opaque() needs this tracker entered and its mode innermost.")
        self._observer.__exit__(None, None, None)
        try:
            yield
        finally:
            self._observer.__enter__()
            self._tag_state()  # a first step creates the state inside
            if self._in_phase:
                self._sample(self._host_ids())

    def _run_operator(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        host_ids = self._host_ids()
        inputs = _plain_leaves((args, kwargs))
        from_host = bool(inputs) and all(self._is_host(t, host_ids) for t in inputs)
        out = func(*args, **kwargs)
        for tensor in inputs:
            self._register(tensor, OTHER)
        for tensor in _plain_leaves(out):
            key = self._register(tensor, OTHER)
            if from_host:
                self._host_made.add(key)
        if self._in_phase:
            self._hold_cap(self._sample(host_ids))
        return out

    # --- readings -----------------------------------------------------------------

    def reading(self) -> MemoryReading:
        return self._with_host_bytes(self._measure(self._host_ids(), self._tag_gradients()))

    def _begin_phase(self) -> None:
        self._tag_state()
        self._peak = self.reading()
        self._max_by_category = dict(self._peak.by_category)

    def _end_phase(self) -> PhasePeak:
        self._sample(self._host_ids())
        peak = self._with_host_bytes(self._peak)
        return PhasePeak(peak=peak, max_by_category=self._max_by_category)

    def _with_host_bytes(self, reading: MemoryReading) -> MemoryReading:
        """On an accelerator (``device_type``) the host store is read now, not per operator
        (nothing of it is counted on the device), as the CUDA meter reads it."""
        if self._device_type is None:
            return reading
        return dataclasses.replace(reading, host_bytes=view_bytes(self._host()))

    def _sample(self, host_ids: set[int]) -> MemoryReading:
        now = self._measure(host_ids, self._tag_gradients())
        if now.device_bytes > self._peak.device_bytes:
            self._peak = now
        for name, nbytes in now.by_category.items():
            self._max_by_category[name] = max(self._max_by_category[name], nbytes)
        return now

    def _hold_cap(self, now: MemoryReading) -> None:
        """Raise as an allocator would where ``now`` is past the device cap."""
        if self._cap_bytes is not None and now.device_bytes > self._cap_bytes:
            raise torch.OutOfMemoryError(
                f"{now.device_bytes / MIB:.2f} MiB of device memory accounted, "
                f"{now.device_bytes - self._cap_bytes:_} bytes over the cap of "
                f"{self._cap_bytes / MIB:.2f} MiB"
            )

    def _measure(self, host_ids: set[int], grad_keys: set[int]) -> MemoryReading:
        self._follow_resized_weights()
        by_category = dict(self._by_category)
        host_bytes = 0
        for key in host_ids | self._host_made:
            entry = self._entries.get(key)
            if entry is not None:
                host_bytes += entry.nbytes
                # The CPU backend restores a lossless gradient by handing over the cached
                # tensor itself: while it is a parameter's .grad it is device memory too,
                # as the restored copy would be on a GPU.
                if key not in grad_keys:
                    by_category[entry.category] -= entry.nbytes
        return MemoryReading(
            device_bytes=sum(by_category.values()), host_bytes=host_bytes, by_category=by_category
        )

    # --- storages -----------------------------------------------------------------

    def _register(self, tensor: torch.Tensor, category: str) -> int:
        """The key of a plain ``tensor``'s storage, counted as ``category`` if it is new."""
        storage = tensor.untyped_storage()
        key = id(storage)  # stable while the storage lives: torch keeps one Python object
        if self._device_type is not None and storage.device.type != self._device_type:
            return key  # not the device's: no entry
        if key not in self._entries:
            ref = weakref.ref(storage, functools.partial(self._forget, key))
            self._entries[key] = _Entry(nbytes=storage.nbytes(), category=category, ref=ref)
            self._by_category[category] += storage.nbytes()
            if category == GRADIENTS:
                self._gradient_keys.add(key)
        return key

    def _follow_resized_weights(self) -> None:
        """Count each resized weight's storage at its size now (see ``weights``). Run after
        every operator: its entries were looked up on entering (a held storage keeps its
        entry: only its death removes it), and each size is read once."""
        for storage, entry in self._resized:
            nbytes = storage.nbytes()
            if entry.nbytes != nbytes:
                self._by_category[entry.category] += nbytes - entry.nbytes
                entry.nbytes = nbytes

    def _forget(self, key: int, _ref: weakref.ref[torch.UntypedStorage]) -> None:
        entry = self._entries.pop(key, None)
        self._gradient_keys.discard(key)
        self._host_made.discard(key)
        if entry is not None:
            self._by_category[entry.category] -= entry.nbytes

    def _tag(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Count ``tensors``' storages as device ``category`` from now on."""
        for tensor in (t for each in tensors for t in plain_tensors(each)):
            key = self._register(tensor, category)
            entry = self._entries.get(key)
            if entry is None:  # not on the device (``device_type``)
                continue
            if entry.category != category:
                self._by_category[entry.category] -= entry.nbytes
                self._by_category[category] += entry.nbytes
                entry.category = category
                if category == GRADIENTS:
                    self._gradient_keys.add(key)
                else:
                    self._gradient_keys.discard(key)
            self._host_made.discard(key)  # a gradient restored from the store is back

    def _tag_state(self) -> None:
        self._tag(optimizer_state_tensors(self._optimizer), OPTIMIZER_STATE)
        self._tag(self._scratch(), ENGINE_SCRATCH)

    def _tag_gradients(self) -> set[int]:
        """Tag every ``param.grad`` as a gradient; the keys of their storages. Run after
        every operator, so where every gradient is a plain tensor counted as a gradient
        already, and none was made from host tensors (`_tag` would change nothing), the
        keys are all it does, in set operations."""
        grads = [grad for grad in map(_grad, self._params) if grad is not None]
        if all(type(grad) is torch.Tensor for grad in grads):
            keys = set(map(id, map(_untyped_storage, grads)))
            if keys <= self._gradient_keys and keys.isdisjoint(self._host_made):
                return keys
        self._tag(grads, GRADIENTS)
        return {id(t.untyped_storage()) for g in grads for t in plain_tensors(g)}

    def _on_gradient(self, grad: torch.Tensor) -> None:
        # A tensor hook on a leaf runs before its gradient is accumulated into .grad.
        self._tag([grad], GRADIENTS)

    def _host_ids(self) -> set[int]:
        if self._device_type is not None:
            return set()  # no host storage has an entry (see ``device_type``)
        # The cache's host payloads are plain tensors (FSDP2's are local shards).
        return set(map(id, map(_untyped_storage, self._host())))

    def _is_host(self, tensor: torch.Tensor, host_ids: set[int]) -> bool:
        key = id(tensor.untyped_storage())
        return key in host_ids or key in self._host_made


_untyped_storage = operator.methodcaller("untyped_storage")
_grad = operator.attrgetter("grad")


# What an operator's arguments hold besides tensors and their lists, tuples and dicts.
_NO_TENSORS = (
    int, float, bool, complex, str, type(None),
    torch.dtype, torch.device, torch.layout, torch.memory_format,
)  # fmt: skip


def _plain_leaves(tree: Any) -> list[torch.Tensor]:
    """The plain tensors in a pytree of operator arguments or results. Run twice around
    every operator, so walked here for what operators take and give (tensors, in lists,
    tuples and dicts): 4x faster than torch's pytree, which flattens anything else."""
    found: list[torch.Tensor] = []
    _gather(tree, found)
    return found


def _gather(tree: Any, found: list[torch.Tensor]) -> None:
    if type(tree) is torch.Tensor:
        found.append(tree)
    elif isinstance(tree, (list, tuple)):  # a named tuple's fields, torch.Size's ints too
        for each in tree:
            _gather(each, found)
    elif isinstance(tree, dict):
        for each in tree.values():
            _gather(each, found)
    elif isinstance(tree, torch.Tensor):
        found.extend(plain_tensors(tree))
    elif not isinstance(tree, _NO_TENSORS):
        leaves = tree_leaves(tree)
        found.extend(
            t for leaf in leaves if isinstance(leaf, torch.Tensor) for t in plain_tensors(leaf)
        )
