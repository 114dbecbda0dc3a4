"""The weights in host memory, on the device only while in use (``offload_parameters``).

At rest ``P.data`` is its fp32 *master* in host slabs; in use, a device tensor kept across
uses (a view of its unit's buffer for forward and backward, ``full`` for the step), its
memory allocated, filled and given up while its storage object (which autograd's saved
tensors share) stays. Each moment, its stream and what orders it, *dirty* and the *wire*:
docs/ARCHITECTURE.md, "The life of a weight".
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .. import sharding
from ..backend import Backend, Transfer
from ..hostmem import check_host_budget
from ..layout import gradient_strides
from ..state_slabs import StateSlabs
from . import at_rest

Param = torch.nn.Parameter


class WeightAt(enum.Enum):
    """Where a parameter's weights are: ``P.data`` is the host master (HOST), its device
    tensor is being filled (ARRIVING), or ``P.data`` is the filled device tensor (DEVICE)."""

    HOST = "host"
    ARRIVING = "arriving"
    DEVICE = "device"


@dataclass(eq=False)
class Unit:
    """Weights that come to the device together (a block, the rest): one ``buffer``, a view
    of it each, filled by one copy a host run (masters' or wires'; several over `RUN_BYTES`)."""

    buffer: torch.Tensor  # flat, on the device: memory only while a member is in use
    hosts: list[tuple[int, torch.Tensor]]  # (offset, flat host run) the buffer is filled from
    members: list[Param]
    arrival: Transfer | None = None  # the copy that filled the buffer, while it has memory


@dataclass
class Weight:
    master: torch.Tensor  # on the host: P.data at rest
    compute: torch.Tensor  # for forward and backward: memory only while in use
    full: torch.Tensor  # for the step, the master's dtype (``compute`` under FSDP2)
    unit: Unit | None = None  # whose buffer ``compute`` views (None: memory of its own)
    wire: torch.Tensor | None = None  # the master cast to the compute dtype, on the host
    wired: tuple[int, int, int] = (-1, -1, -1)  # `_versions` when ``wire`` was cast
    sent: tuple[int, int, int] = (-1, -1, -1)  # those its unit's buffer was filled at
    at: WeightAt = WeightAt.HOST
    in_use: torch.Tensor | None = None  # ``compute`` or ``full``, while not HOST
    arrival: Transfer | None = None
    exact: bool = False  # its device tensor in use holds the master itself, not a cast
    dirty: bool = False  # stepped on the device, its copy back not started
    version: int = 0  # P's version counter when its device tensor became P.data

    def place(self) -> torch.Tensor:
        """What ``P.data`` is: the device tensor in use once arrived, else the master."""
        if self.at is WeightAt.DEVICE and self.in_use is not None:
            return self.in_use
        return self.master


class Placement(Protocol):
    """Where a weight's device tensor lives and what ``P`` shows of it."""

    loads_on_device: bool  # a load writes the weights on the device, not the masters

    def check(self, named_params: Sequence[tuple[str, Param]]) -> None:
        """Refuse, naming it, a parameter this placement cannot move."""

    def source(self, param: Param) -> torch.Tensor:
        """What ``param``'s master copies."""

    def part_to_come(self, param: Param) -> bool:
        """Whether another use of ``param`` is still to accumulate in this backward."""

    def device_tensors(
        self, sources: list[torch.Tensor], masters: list[torch.Tensor]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
        """One unit's device buffer (None: none), laid out as its ``masters`` (`unit_offsets`),
        and each weight's compute and full (the step's) tensor, their memory given up."""

    def wire_dtype(self, param: Param) -> torch.dtype | None:
        """The dtype forward and backward read ``param`` in (its wire's), or None."""

    def rest(self, param: Param, weight: Weight) -> None:
        """``param`` at rest once its master is filled."""

    def show(self, param: Param, weight: Weight) -> None:
        """``param`` where ``weight`` is now (`Weight.place`)."""

    def in_place(self, param: Param, weight: Weight) -> bool:
        """Whether ``param`` still reads where ``weight`` put it."""

    def step_begins(self, weights: Iterable[tuple[Param, Weight]]) -> None:
        """The fused step begins: what it reads of ``weights`` at rest is plain."""

    def step_ends(self, weights: Iterable[tuple[Param, Weight]]) -> None:
        """The fused step ended (or raised): ``weights`` as between steps."""

    def close(self, weights: HostWeights) -> None:
        """Every weight back on the device for good, as plain PyTorch keeps it."""


class HostWeights:
    """The masters and device tensors of ``named_params``, a `Weight` record each, placed by
    ``placement`` and laid out by the ``units``, which must cover every one of them (a
    parameter in no unit gets no record). The host budget
    (``fraction``) is checked first: a refusal changes nothing."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, Param]],
        backend: Backend,
        placement: Placement,
        *,
        units: Sequence[Sequence[Param]],
        fraction: float,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.backend = backend
        self.placement = placement
        self.compute_dtype = compute_dtype
        placement.check(named_params)
        self._slabs = StateSlabs(
            backend.host_slab, fraction=fraction, round_up=backend.host_slabs_round_up, what=WHAT
        )
        self._weights: dict[Param, Weight] = {}
        self._copies_back = False  # a copy into a master may be in flight
        sources = {param: placement.source(param) for _, param in named_params}
        self._slabs.expect(sources.values())  # sizes the slabs (pinned on CUDA)
        # Every master (and wire) checked first, so that a refusal changes nothing; a
        # model on the host gives its own memory back weight by weight as its masters fill.
        wires = 0 if compute_dtype is None else compute_dtype.itemsize
        needed = sum(s.numel() * (s.element_size() + wires) for s in sources.values())
        on_host = sum(nbytes(s) for s in sources.values() if s.device.type == "cpu")
        check_host_budget(needed, fraction=fraction, what=WHAT, released=on_host)
        for unit in units:
            by_dtype: dict[torch.dtype, list[Param]] = {}  # a unit's buffer has one
            for param in unit:
                by_dtype.setdefault(sources[param].dtype, []).append(param)
            for same_dtype in by_dtype.values():
                self._lay_out(same_dtype, sources)
        self._names = {param: name for name, param in named_params}
        # Bytes moved either way since the last step ended, and in the last step.
        self.moved_bytes = self.moved_last_step = 0
        self._counted_step = -1  # the step moved_last_step counts

    def _lay_out(self, params: list[Param], sources: dict[Param, torch.Tensor]) -> None:
        """One unit's masters (and wires), laid out as its device buffer, and device tensors;
        each filled and its parameter at rest there in turn (never two whole copies)."""
        likes = [sources[p] for p in params]
        masters, hosts = self._regions(likes, likes[0].dtype)
        buffer, computes, fulls = self.placement.device_tensors(likes, masters)
        wires: list[torch.Tensor | None] = [None] * len(params)
        wire = self.placement.wire_dtype(params[0])
        if wire is not None and wire != likes[0].dtype:  # the masters' casts, forward reads
            casts, hosts = self._regions(likes, wire)
            wires = list(casts)
        unit = None if buffer is None else Unit(buffer, hosts, list(params))
        for i, param in enumerate(params):
            weight = Weight(masters[i], computes[i], fulls[i], unit, wires[i])
            weight.master.copy_(sources[param])
            if weight.wire is not None:  # the cast of the parameter itself
                weight.wire.copy_(sources[param])
            self._weights[param] = weight
            self.placement.rest(param, weight)
            weight.wired = _versions(param, weight)

    def _regions(
        self, likes: list[torch.Tensor], dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[tuple[int, torch.Tensor]]]:
        """A host tensor in ``dtype`` like each of ``likes`` at its `unit_offsets`, and each
        run's (offset in the unit, flat region). Runs of at most `RUN_BYTES`: pinned slabs are
        powers of two, so one of several GiB wastes up to half."""
        offsets, numel = unit_offsets(likes)
        views, runs = [], []
        for run, start, end in _runs(offsets, numel, dtype.itemsize):
            region = self._slabs.take([(end - start) * dtype.itemsize])[0].view(dtype)
            views += [_view(region, likes[i], offsets[i] - start) for i in run]
            runs.append((start, region))
        return views, runs

    @property
    def host_bytes(self) -> int:
        """What the masters' slabs take (on CUDA: what they pin)."""
        return self._slabs.reserved_bytes

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (not a Parameter; maybe a `DTensor`) views the masters' slabs."""
        return not isinstance(tensor, Param) and self._slabs.holds(sharding.local(tensor))

    def rests_on_host(self, param: Param) -> bool:
        """Whether ``param``'s weight is one of these (at rest in its master between steps)."""
        return param in self._weights

    def where(self, param: Param) -> WeightAt:
        return self._weights[param].at

    def in_place(self, param: Param) -> bool:
        """Whether ``param`` reads where these weights put it (not moved since: ``model.to``,
        ``p.data = t``, FSDP2's ``reset_sharded_param``)."""
        weight = self._weights.get(param)
        if weight is None:  # on the device for good (`drop`): a plain parameter there
            return param.device == self.backend.device
        return self.placement.in_place(param, weight)

    def device_bytes(self) -> int:
        """The device memory the weights hold now (arriving or in use)."""
        return sum(t.untyped_storage().nbytes() for t in self.device_tensors())

    def _held(self, params: Iterable[Param]) -> list[tuple[Param, Weight]]:
        """``params`` these weights hold, with their weights (an optimizer may step others)."""
        return [(p, self._weights[p]) for p in params if p in self._weights]

    def bring(self, params: Iterable[Param], *, step: bool = False) -> None:
        """Start filling the device tensors of those of ``params`` at home: ``step``, each
        its own in the master's dtype, else a whole unit's buffer by one copy where none of
        it is on the device yet. If this raises, they stay home."""
        held = self._held(params)
        for param, weight in held:
            wanted = weight.full if step else weight.compute
            other = weight.in_use is not wanted or (step and not weight.exact)
            if weight.at is not WeightAt.HOST and other:
                self.free([param])  # in use the other way (never between the step's phases)
        chosen = [(p, w) for p, w in held if w.at is WeightAt.HOST]
        if not chosen:
            return
        units = {} if step else {id(w.unit): w.unit for _, w in chosen if w.unit is not None}
        empty = [unit for unit in units.values() if unit.arrival is None]
        pairs, own, casts = [], [], []  # (device, host); memory of their own; (to, from)
        for unit in empty:
            for member in unit.members:
                self._loaded(member, self._weights[member])
        for param, weight in chosen:
            if step or weight.unit is None:
                own.append(weight.full if step else weight.compute)
                host = weight.master if step else self._loaded(param, weight)
                if host.dtype == own[-1].dtype:
                    pairs.append((own[-1], host))
                else:  # a wire to a staging tensor, widened into the device tensor there
                    staging = torch.empty_like(own[-1], dtype=host.dtype)
                    pairs.append((staging, host))
                    casts.append((own[-1], staging))
            elif weight.unit.arrival is not None and weight.sent != _versions(param, weight):
                # Its unit on the device already, and it was written since (a load).
                pairs.append((weight.compute, self._loaded(param, weight)))
        try:
            for device in [unit.buffer for unit in empty] + own:
                self.backend.resize_storage(device, nbytes(device))  # on the compute stream
            pairs[:0] = [  # one copy a run (a unit under RUN_BYTES: one)
                (unit.buffer.narrow(0, start, host.numel()), host)
                for unit in empty
                for start, host in unit.hosts
            ]
            transfer = self.backend.start_refill(pairs, casts=casts)
            self.moved_bytes += sum(nbytes(host) for _, host in pairs)
            for unit in empty:
                unit.arrival = transfer
            for _, weight in chosen:
                arrival = transfer if step or weight.unit is None else weight.unit.arrival
                weight.in_use = weight.full if step else weight.compute
                same = weight.in_use.dtype == weight.master.dtype
                weight.exact = step or (weight.wire is None and same)
                weight.at, weight.arrival = WeightAt.ARRIVING, arrival
        except BaseException:  # an allocation failed, or an interrupt (a signal) came
            self.backend.abandon_refills()  # the frees after any copy already queued
            for unit in empty:
                unit.arrival = None
            for _, weight in chosen:
                weight.at, weight.arrival = WeightAt.HOST, None
            for device in [unit.buffer for unit in empty] + own:
                self.backend.resize_storage(device, 0)
            raise

    def _loaded(self, param: Param, weight: Weight) -> torch.Tensor:
        """What fills ``param``'s compute tensor now: its master, or its wire, cast again where
        ``P`` or its master changed since (the host rounds to nearest even, as the device)."""
        if weight.wire is not None and weight.wired != _versions(param, weight):
            if self._copies_back:  # a step that raised: its copies back may still be writing
                self.wait_on_host()  # the master complete before the host reads it
            weight.wire.copy_(weight.master)
            weight.wired = _versions(param, weight)
        weight.sent = _versions(param, weight)
        return weight.master if weight.wire is None else weight.wire

    def refills(self, params: Iterable[Param]) -> list[Transfer] | None:
        """The copies on their way for ``params``, for a reader on another stream; None where
        one is on the device already (its event spent: wait for the compute stream)."""
        refills: dict[int, Transfer] = {}
        for _, weight in self._held(params):
            if weight.at is WeightAt.DEVICE:
                return None
            if weight.arrival is not None:
                refills[id(weight.arrival)] = weight.arrival
        return list(refills.values())

    def ensure(self, params: Iterable[Param], *, step: bool = False) -> None:
        """``params``' filled device tensors ``P.data``, safe for work queued from now on
        (``step``: the master's dtype, dirty until `store`)."""
        params = list(params)
        self.bring(params, step=step)
        for param, weight in self._held(params):
            if weight.at is WeightAt.ARRIVING:
                self._move(param, weight, WeightAt.DEVICE, weight.in_use)
                weight.version = param._version
            weight.dirty |= step

    def free(self, params: Iterable[Param]) -> None:
        """``params``' device memory given up, ``P.data`` the master (a dirty one copied back)."""
        held = self._held(params)
        refused = self._written(held)
        dirty = [param for param, weight in held if weight.dirty]
        if dirty:
            self.store(dirty)
        for param, weight in held:
            if weight.at is WeightAt.HOST:
                continue
            assert weight.in_use is not None  # set with ARRIVING
            in_use = weight.in_use
            self._move(param, weight, WeightAt.HOST, None)  # interrupted: memory kept till reused
            unit = weight.unit
            if unit is None or in_use is not weight.compute:
                self.backend.resize_storage(in_use, 0)
            elif all(self._weights[m].at is WeightAt.HOST for m in unit.members):
                # Its last member in use gone. The arrival forgotten first: an interrupt as
                # the memory goes leaves a unit the next bring refills, not one it trusts.
                unit.arrival = None
                self.backend.resize_storage(unit.buffer, 0)
        if refused:
            self._refuse(refused)

    def _move(
        self, param: Param, weight: Weight, at: WeightAt, in_use: torch.Tensor | None
    ) -> None:
        """``weight`` recorded ``at`` (``in_use``), its arrival awaited first (before its memory
        is read or handed on), and ``P`` shown where it says, as one: a forward refuses a ``P``
        read elsewhere, so an interrupt (a signal) inside the show shows it again on the way
        out. No call of ours between the wait and the record: an interrupt there cannot
        leave it ARRIVING with no arrival."""
        if weight.at is WeightAt.ARRIVING:
            self._arrived(weight)
        weight.at, weight.in_use = at, in_use
        try:
            self.placement.show(param, weight)
        except BaseException:
            self.placement.show(param, weight)
            raise

    def _written(self, held: list[tuple[Param, Weight]]) -> list[Param]:
        """Those of ``held`` written in place on the device (a renorm, a counter, a load)
        made dirty, as stepped; those in the compute dtype (no exact copy back) returned."""
        refused = []
        for param, weight in held:
            if weight.at is not WeightAt.DEVICE or param._version == weight.version:
                continue
            weight.version = param._version
            if weight.exact:
                weight.dirty = True
            else:
                refused.append(param)
        return refused

    def part_to_come(self, param: Param) -> bool:
        return self.placement.part_to_come(param)

    def refuse_a_host_gradient(
        self, param: Param, grad: torch.Tensor, *, in_grad: bool = False
    ) -> None:
        """A gradient of a weight held here computed on the host master (a use outside its
        window): autograd would accumulate it apart from the device's, on another thread.
        ``in_grad``: autograd put it in ``.grad`` already, where it goes (a host tensor
        there would meet the device's gradients at the next restore)."""
        if grad.device.type == self.backend.device.type or param not in self._weights:
            return
        if in_grad:
            param.grad = None
        raise RuntimeError(
            f"Parameter {self.name(param)!r} received a gradient computed on the {grad.device} "
            "(its host master, with offload_parameters=True): it was used outside the model's "
            "or its block's forward, where its weights are on the host (a regularizer over "
            "model.parameters() computed before the forward or after it, block.forward(x) "
            "instead of block(x), a forward hook registered on the block after the cache). "
            "Put a regularizer into the optimizer (weight_decay) or compute it inside the "
            "forward, call the blocks as modules, and register such a hook before the cache "
            "or with prepend=True."
        )

    def name(self, param: Param) -> str:
        """``param``'s name in the model (one these weights hold)."""
        return self._names[param]

    def names(self, params: Iterable[Param]) -> list[str]:
        """The names of those of ``params`` these weights hold, in the model's order."""
        wanted = set(params)
        return [name for param, name in self._names.items() if param in wanted]

    def _refuse(self, written: list[Param]) -> None:
        names = ", ".join(map(repr, self.names(written)))
        raise RuntimeError(
            f"Parameters {names} were written in place during a forward or backward in the "
            f"compute dtype ({self.compute_dtype}), and their fp32 masters on the host "
            "cannot take a bf16 write exactly (the write is lost). Write them outside the "
            "forward (between steps), keep such state in a buffer (register_buffer), or "
            "create the cache without compute_dtype. A forward with gradients whose output "
            "was dropped (a validation outside torch.no_grad()) keeps its weights in use "
            "until the next backward ends: run it under torch.no_grad()."
        )

    def forget(self, params: Iterable[Param]) -> None:
        """A failed step's bucket given up, nothing copied back (the masters are unchanged)."""
        held = self._held(params)  # once: ``params`` may be a generator
        for param, weight in held:
            weight.dirty, weight.version = False, param._version
        self.free(param for param, _ in held)

    def store(self, params: Iterable[Param]) -> None:
        """``params`` stepped or written on the device: copied into their masters, then freed."""
        present = [(p, w) for p, w in self._held(params) if w.at is WeightAt.DEVICE and w.exact]
        if not present:
            return
        pairs = [(weight.place(), weight.master) for _, weight in present]
        transfer = self.backend.start_to_host(pairs)
        self._copies_back = True
        for param, weight in present:  # the copies back started: the masters will be the newer
            weight.dirty, weight.version = False, param._version
        self.moved_bytes += sum(nbytes(device) for device, _ in pairs)
        # The compute stream waits for the copies back before the memory goes.
        self.backend.release(transfer)
        self.free(param for param, _ in present)

    def step_ended(self, steps: int) -> None:
        """A step of ``steps`` completed: dirty weights copied back and the host waits (the
        masters are the parameters at rest); several optimizers' steps count as one."""
        dirty = [param for param, weight in self._weights.items() if weight.dirty]
        if dirty:  # a bucket whose copy back raised, stepped by a retry's end: home now
            self.store(dirty)
        self.wait_on_host()
        if steps != self._counted_step:
            self.moved_last_step, self._counted_step = 0, steps
        self.moved_last_step += self.moved_bytes
        self.moved_bytes = 0

    def masters(self, params: Iterable[Param] | None = None) -> tuple[torch.Tensor, ...]:
        """The masters (of ``params``: every one these weights hold), in host memory."""
        return tuple(w.master for _, w in self._held(self._weights if params is None else params))

    def host_tensors(self) -> tuple[torch.Tensor, ...]:
        """The masters and the wires, in host memory (memory accounting)."""
        wires = tuple(w.wire for w in self._weights.values() if w.wire is not None)
        return self.masters() + wires

    def device_tensors(self) -> tuple[torch.Tensor, ...]:
        """The device tensors (memory accounting: a storage's size now is what it holds)."""
        tensors = {}
        for w in self._weights.values():
            for t in (w.compute if w.unit is None else w.unit.buffer, w.full):
                tensors[id(t)] = t
        return tuple(tensors.values())

    def params(self) -> list[Param]:
        return list(self._weights)

    def items(self) -> list[tuple[Param, Weight]]:
        return list(self._weights.items())

    @contextlib.contextmanager
    def plain_through_the_step(self) -> Iterator[None]:
        """The weights at rest plain through a fused step (its loops read their fields with
        no Python call each), and as between steps again however it ends (`at_rest`)."""
        self.placement.step_begins(self._weights.items())
        try:
            yield
        finally:
            self.placement.step_ends(self._weights.items())

    def drop(self, params: Iterable[Param]) -> None:
        """``params`` (whole units, at home) settled on the device are these weights' no more;
        their slab space stays reserved (a slab is given back whole)."""
        for param, weight in self._held(params):
            assert weight.at is WeightAt.HOST  # home first: nothing of them is in flight
            del self._weights[param]

    def present(self) -> list[Param]:
        """The parameters whose weights are on the device or on their way."""
        return [p for p, w in self._weights.items() if w.at is not WeightAt.HOST]

    def wait_on_host(self) -> None:
        """Block the host until every copy to or from a master is complete."""
        self.backend.wait_for_state_copies()
        self._copies_back = False

    def close(self) -> None:
        """Every weight back on the device for good (the placement's), the masters let go."""
        self.placement.close(self)
        self._weights = {}

    def _arrived(self, weight: Weight) -> None:
        assert weight.arrival is not None  # ARRIVING is set with its arrival
        self.backend.finish_to_device(weight.arrival)
        weight.arrival = None


@dataclass(frozen=True)
class StepJourney:
    """The fused step's journey of each bucket's weights, beside the optimizer state's
    (`optimizer_state.StateJourney`)."""

    weights: HostWeights

    def bring(self, params: Sequence[Param]) -> list[Param]:
        self.weights.bring(params, step=True)
        return list(params)

    def install(self, arrival: list[Param]) -> None:
        self.weights.ensure(arrival, step=True)

    def send_back(self, arrival: list[Param]) -> None:
        self.weights.store(arrival)

    def abandon(self, arrivals: Iterable[list[Param]]) -> None:
        for arrival in arrivals:
            self.weights.forget(arrival)

    def step_ended(self, steps: int) -> None:
        self.weights.step_ended(steps)


def nbytes(tensor: torch.Tensor) -> int:
    """A dense tensor's bytes (what its storage takes when filled)."""
    return tensor.numel() * tensor.element_size()


WHAT = "the weights' masters, offload_parameters=True"
UNIT_ALIGN = 16  # elements: each weight's place in a unit's regions and buffer starts here


def unit_offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Each of ``tensors``' offset in one flat region, a multiple of `UNIT_ALIGN` (aligned
    for any dtype's fast copies and kernels), and the region's size."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-tensor.numel() // UNIT_ALIGN) * UNIT_ALIGN
    return offsets, end


RUN_BYTES = 2**30  # the largest host run of a unit: `state_slabs.MAX_SLAB`'s slabs


def _runs(offsets: list[int], numel: int, itemsize: int) -> list[tuple[list[int], int, int]]:
    """A unit's weights' indices in runs of at most `RUN_BYTES` (a larger weight alone), each
    with where it starts and ends in the unit."""
    runs: list[tuple[list[int], int, int]] = []
    for i, end in enumerate([*offsets[1:], numel]):
        if runs and (end - runs[-1][1]) * itemsize <= RUN_BYTES:
            runs[-1] = (runs[-1][0] + [i], runs[-1][1], end)
        else:
            runs.append(([i], offsets[i], end))
    return runs


def _view(region: torch.Tensor, like: torch.Tensor, at: int) -> torch.Tensor:
    """``like``'s shape and dense strides at element ``at`` of ``region``, not a view: a
    view shares its slab's version counter, so any write into the slab would look like a
    write into this one (docs/ARCHITECTURE.md, "Traps")."""
    tensor = torch.empty(0, dtype=region.dtype, device=region.device)
    offset = region.storage_offset() + at
    return tensor.set_(region.untyped_storage(), offset, like.shape, gradient_strides(like))


def _versions(param: Param, weight: Weight) -> tuple[int, int, int]:
    """The version counters a write into ``param`` at rest or into its master moves, and
    the ``P.data`` reads at rest (a write through one moves neither counter)."""
    with at_rest.undispatched():
        version = param._version
    return version, weight.master._version, at_rest.DATA_READS.get(id(param), 0)
