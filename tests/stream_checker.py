"""Stand-in accelerator streams and events, and a checker of every ordering the engine
relies on.

The accelerator backend makes its streams and events through an object it is given (a
`StreamApi`: torch's `torch.Stream`, `torch.Event` and `torch.accelerator.current_stream`);
`FakeAccelerator` is such an object for CPU tensors, and its streams, like torch's, are made
current by ``with stream:``. Everything runs at once, in program order, so results are exact,
and the `StreamChecker` (a dispatch mode that sees every tensor operation) judges whether
the same program would be correct on a GPU, where streams run concurrently:

* Vector clocks: the host and each stream are actors. An operation enqueued on a stream
  is ordered after everything the host did before enqueuing it; `wait_stream`,
  `wait_event`, the host's `synchronize` and a blocking copy to the host (`.to("cpu")`) join
  clocks; nothing else orders two actors.
* Memory: every storage is tracked by byte range. Two accesses to overlapping bytes by two
  actors, at least one a write, must be ordered, or it is a race. Pinned host memory
  (`allocate_pinned`) is host memory: an operation whose tensors are all host tensors is a
  host access (a host read of a payload must follow the copy that wrote it).
* The caching allocator: a new block is written by its allocating stream when allocated
  (it may reuse memory that stream used before); when a block is freed, the allocator may
  hand it to the next allocation on its allocating stream at once, so every access by
  another stream must already be ordered before that stream's position, unless
  `record_stream` named that stream.
* Hooks: inside backward, the host may not wait (`synchronize`, `.item()`, `nonzero`, a
  blocking copy) nor allocate pinned memory.
* Kernels: the compiled int8 kernels (`_int8_cpu.c`) write through raw pointers, which no
  dispatch mode sees; while the checker is entered they are off and the codecs' fused
  operations on (as on a GPU with Triton: one operation per encode and decode, whose
  schema names what it writes), and `dispatched` counts each operation by actor and name.
  `disabled()` runs a reference on the CPU's own paths.

PyTorch's own `torch.cuda._sanitizer` keeps similar clocks, but skips CPU tensors, host
accesses to pinned memory, `record_stream`, allocator reuse and byte ranges within a slab.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from gradient_cache.codecs import int8_kernels

HOST = "host"
# Operations whose result the host must read before it can go on.
_SYNCING = {
    getattr(torch.ops.aten, name).default
    for name in (
        "_local_scalar_dense",  # .item(), bool(t), float(t)
        "nonzero",
        "is_nonzero",
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
    )
}


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class Access:
    actor: str
    epoch: int
    start: int
    end: int
    write: bool
    what: str


@dataclass
class Block:
    """One storage: who allocated it, how large, and every access since."""

    ref: StorageWeakRef
    alloc: str
    nbytes: int
    host: bool = False
    accesses: list[Access] = field(default_factory=list)
    recorded: set[str] = field(default_factory=set)


class StreamChecker(TorchDispatchMode):
    """Records and judges every access; `violations` lists what a GPU could get wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.clocks: dict[str, dict[str, int]] = {HOST: {HOST: 0}}
        self.blocks: dict[int, Block] = {}
        self.violations: list[str] = []
        self.active = "compute"
        self.clocks["compute"] = {"compute": 0}
        self.watched: set[str] = set()  # streams whose device memory `peak_watched_bytes` counts
        self.peak_watched_bytes = 0
        self.dispatched: Counter[tuple[str, str]] = Counter()  # (actor, op name): calls
        self._saved_kernels: list[tuple[int8_kernels.CompiledKernels | None, frozenset[str]]] = []

    # --- the eager int8 path while entered ----------------------------------------------

    def __enter__(self) -> StreamChecker:
        # int8_kernels reads both at each call: CPU tensors then take the path CUDA tensors
        # take, one fused operation per encode and decode (whose reads and writes its
        # schema names), never the compiled kernels, whose writes no dispatch mode sees.
        self._saved_kernels.append((int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES))
        int8_kernels.CPU_KERNELS = None
        int8_kernels.FUSED_DEVICE_TYPES = int8_kernels.FUSED_DEVICE_TYPES | {"cpu"}
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES = self._saved_kernels.pop()

    # --- actors and clocks ----------------------------------------------------------

    def new_stream(self) -> str:
        name = f"stream{len(self.clocks) - 1}"
        self.clocks[name] = {name: 0}
        return name

    def _tick(self, actor: str) -> int:
        clock = self.clocks[actor]
        if actor != HOST:  # enqueued after everything the host did so far
            for other, time in self.clocks[HOST].items():
                clock[other] = max(clock.get(other, 0), time)
        clock[actor] = clock.get(actor, 0) + 1
        return clock[actor]

    def join(self, actor: str, clock: dict[str, int]) -> None:
        self._sweep()
        if actor != HOST:
            self._tick(actor)
        mine = self.clocks[actor]
        for other, time in clock.items():
            mine[other] = max(mine.get(other, 0), time)

    def snapshot(self, actor: str) -> dict[str, int]:
        self._sweep()
        self._tick(actor)
        return dict(self.clocks[actor])

    def host_wait(self, clock: dict[str, int], what: str) -> None:
        if in_backward():
            self.violations.append(f"host waits ({what}) inside a backward hook")
        self.join(HOST, clock)

    def _ordered(self, actor: str, access: Access) -> bool:
        return access.actor == actor or self.clocks[actor].get(access.actor, 0) >= access.epoch

    # --- memory ---------------------------------------------------------------------

    def mark_host(self, tensor: torch.Tensor) -> None:
        """``tensor`` is pinned host memory (the engine's pool slab)."""
        if in_backward():
            self.violations.append("pinned host memory allocated inside a backward hook")
        block = self._block(tensor, HOST)
        block.host, block.alloc, block.accesses = True, HOST, []

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        self._block(tensor, self.active).recorded.add(stream)

    def freed(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage gives its block back (``resize_(0)``): every access must
        be ordered before the allocating stream's present."""
        key = tensor.untyped_storage().data_ptr()
        block = self.blocks.get(key)
        if key and block is not None:
            self._free(key, block)

    def allocated(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage takes a new block on the active stream."""
        key = tensor.untyped_storage().data_ptr()
        stale = self.blocks.get(key)
        if stale is not None:  # a block given back without a word: judged now
            self._free(key, stale)
        self._block(tensor, self.active)

    def _block(self, tensor: torch.Tensor, actor: str) -> Block:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        block = self.blocks.get(key)
        if block is not None and block.ref.expired():
            self._free(key, block)
            block = None
        if block is None:
            # A block made by a host operation is host memory: the host frees it safely.
            block = Block(StorageWeakRef(storage), actor, storage.nbytes(), host=actor == HOST)
            self.blocks[key] = block
            # A new block may be memory its allocating stream used a moment ago.
            block.accesses.append(Access(actor, self._tick(actor), 0, block.nbytes, True, "alloc"))
        return block

    def _free(self, key: int, block: Block) -> None:
        del self.blocks[key]
        if block.host:
            return
        # Work the allocating stream does after the free is enqueued after the host's
        # present too: a host wait before the free orders it as well.
        for access in block.accesses:
            if access.actor in block.recorded or self._ordered(block.alloc, access):
                continue
            if self._ordered(HOST, access):
                continue
            self.violations.append(
                f"a block allocated on {block.alloc} was freed while {access.actor} may still "
                f"{'write' if access.write else 'read'} it ({access.what}): the allocator "
                f"could hand it to {block.alloc} again at once"
            )

    def _sweep(self) -> None:
        watched = 0
        for key, block in list(self.blocks.items()):
            if block.ref.expired():
                self._free(key, block)
            elif not block.host and any(a.actor in self.watched for a in block.accesses):
                watched += block.nbytes
        if in_backward():
            self.peak_watched_bytes = max(self.peak_watched_bytes, watched)

    def _access(self, actor: str, tensor: torch.Tensor, *, write: bool, what: str) -> None:
        if tensor.numel() == 0 or tensor.untyped_storage().data_ptr() == 0:
            return
        block = self._block(tensor, actor)
        size = tensor.element_size()
        start = tensor.storage_offset() * size
        extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        access = Access(actor, self.clocks[actor][actor], start, start + extent * size, write, what)
        for before in block.accesses:
            overlaps = before.start < access.end and access.start < before.end
            if overlaps and (write or before.write) and not self._ordered(actor, before):
                self.violations.append(
                    f"race: {actor} {'writes' if write else 'reads'} ({what}) bytes "
                    f"[{access.start}, {access.end}) that {before.actor} "
                    f"{'wrote' if before.write else 'read'} ({before.what}) unordered"
                )
        # Forget what ``access`` makes redundant: an older access it covers by the same
        # actor (unless a write followed by a read), or one it is ordered after and
        # overwrites. A later access ordered after ``access`` is ordered after those too.
        block.accesses = [
            before
            for before in block.accesses
            if not (
                before.start >= access.start
                and before.end <= access.end
                and (
                    (before.actor == actor and (write or not before.write))
                    or (write and self._ordered(actor, before))
                )
            )
        ]
        block.accesses.append(access)

    def _is_host(self, tensor: torch.Tensor) -> bool:
        block = self.blocks.get(tensor.untyped_storage().data_ptr())
        return block is not None and block.host and not block.ref.expired()

    # --- every tensor operation -----------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._sweep()
        if _is_view(func):  # aliases memory, touches none
            return func(*args, **kwargs)
        inputs = list(_schema_tensors(func, args, kwargs))
        tensors = [t for t, _ in inputs]
        actor = HOST if tensors and all(self._is_host(t) for t in tensors) else self.active
        if in_backward() and actor != HOST:
            if func in _SYNCING:
                self.violations.append(f"{func} waits for the device inside a backward hook")
            blocking_copy = func is torch.ops.aten.copy_.default and not _non_blocking(args, kwargs)
            if blocking_copy and any(self._is_host(t) for t in tensors):
                self.violations.append("a blocking host copy inside a backward hook")
        self._tick(actor)
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        self.dispatched[actor, name] += 1
        for tensor, write in inputs:
            self._access(actor, tensor, write=write, what=name)
        # A blocking `.to("cpu")` of a device tensor (a checkpoint's copy), or a blocking
        # `copy_` into host memory (the masters filled from the model's weights): CUDA's copy
        # returns once it is done, so the host is ordered after it.
        to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None
        to_host |= func is torch.ops.aten.copy_.default and self._is_host(args[0])
        if to_host and not _non_blocking(args, kwargs):
            self.join(HOST, dict(self.clocks[actor]))
        known = {t.untyped_storage().data_ptr() for t in tensors}
        for tensor in tree_leaves(out):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.untyped_storage().data_ptr() not in known
            ):
                self._access(actor, tensor, write=True, what=name)
        return out

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run a reference computation unchecked (its tensors are never seen), with the
        int8 paths a CPU run takes (the compiled kernels, no fused operations), so that a
        comparison with it checks the CUDA path's bytes against the CPU's."""
        paths = int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES
        if self._saved_kernels:
            int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES = self._saved_kernels[-1]
        try:
            with _disable_current_modes():
                yield
        finally:
            int8_kernels.CPU_KERNELS, int8_kernels.FUSED_DEVICE_TYPES = paths

    def assert_clean(self) -> None:
        assert not self.violations, "\n".join(dict.fromkeys(self.violations))


def _schema_tensors(func, args, kwargs) -> Iterator[tuple[torch.Tensor, bool]]:
    """Each tensor argument of ``func`` with whether the op writes it."""
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            value = args[i]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            continue
        write = argument.alias_info is not None and argument.alias_info.is_write
        for leaf in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(leaf, torch.Tensor):
                yield leaf, write


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def _non_blocking(args, kwargs) -> bool:
    return bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))


class FakeEvent:
    def __init__(self, checker: StreamChecker) -> None:
        self._checker = checker
        self.clock: dict[str, int] | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        actor = stream.name if stream is not None else self._checker.active
        self.clock = self._checker.snapshot(actor)

    def synchronize(self) -> None:
        assert self.clock is not None, "synchronize() on an event never recorded"
        self._checker.host_wait(self.clock, "Event.synchronize")


class FakeStream:
    def __init__(self, checker: StreamChecker, name: str) -> None:
        self._checker = checker
        self.name = name
        self._entered: list[str] = []  # the streams current before each `with`, innermost last

    def __enter__(self) -> FakeStream:
        """Current until the `with` ends, as `torch.Stream.__enter__` (re-entrant in 2.13)."""
        self._entered.append(self._checker.active)
        self._checker.active = self.name
        return self

    def __exit__(self, *exc: object) -> None:
        self._checker.active = self._entered.pop()

    def wait_stream(self, other: FakeStream) -> None:
        self._checker.join(self.name, dict(self._checker.clocks[other.name]))

    def wait_event(self, event: FakeEvent) -> None:
        assert event.clock is not None, "a stream waits on an event never recorded"
        self._checker.join(self.name, event.clock)

    def synchronize(self) -> None:
        self._checker.host_wait(dict(self._checker.clocks[self.name]), "Stream.synchronize")


class FakeAccelerator:
    """The accelerator backend's `StreamApi` (what it calls of torch's streams and events),
    on CPU tensors, checked."""

    def __init__(self, checker: StreamChecker) -> None:
        self.checker = checker
        self.compute = FakeStream(checker, "compute")
        self.pinned_allocations = 0

    def new_stream(self, device: object = None) -> FakeStream:
        return FakeStream(self.checker, self.checker.new_stream())

    def new_event(self, device: object = None) -> FakeEvent:
        return FakeEvent(self.checker)

    def current_stream(self, device: object = None) -> FakeStream:
        if self.checker.active == "compute":
            return self.compute
        return FakeStream(self.checker, self.checker.active)

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        """What ``tensor.record_stream(stream)`` tells the caching allocator."""
        self.checker.record_stream(tensor, stream.name)

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        """What a storage's ``resize_`` does in the caching allocator: a block given back
        (0), which the allocating stream may hand on at once, or a new one taken on the
        current stream."""
        if not nbytes:
            self.checker.freed(tensor)
        tensor.untyped_storage().resize_(nbytes)
        if nbytes:
            self.checker.allocated(tensor)

    def allocate_pinned(self, nbytes: int) -> torch.Tensor:
        self.pinned_allocations += 1
        slab = torch.empty(nbytes, dtype=torch.uint8)
        self.checker.mark_host(slab)
        return slab
