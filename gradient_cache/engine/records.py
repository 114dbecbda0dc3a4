"""Each cached parameter's record: its facts, gathered once, and where its gradient is
(`GradientAt`, set by the phase that moves it; the containers follow the record, which
`tests/test_call_orders.py` checks after every call)."""

from __future__ import annotations

import enum
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .route import Route
from .sharding import is_dtensor

Param = torch.nn.Parameter


class GradientAt(enum.Enum):
    """Where the cache has a parameter's gradient of the pending step (its newest part:
    under accumulation an earlier part may be stored while the next waits in a bucket)."""

    NONE = "none"  # the cache has none: in ``.grad`` (the user's), or no gradient at all
    OPEN_BUCKET = "in an open bucket"  # taken from ``.grad``, on the device, not launched
    IN_FLIGHT = "in flight"  # launched: encoded, its copy to the host not waited for
    STORED = "stored"  # in host memory, in the store, complete (after a drain)
    KEPT_ON_DEVICE = "kept on the device"  # left in ``.grad`` by a memory budget's decision
    HELD_FOR_STEP = "held for the step"  # a device gradient the fused step steps last


# Where a gradient the cache holds (of a pending step, not in ``.grad``) is.
HELD_BY_THE_CACHE = (GradientAt.OPEN_BUCKET, GradientAt.IN_FLIGHT, GradientAt.STORED)


class StateAt(enum.Enum):
    """Where a parameter's offloaded optimizer state is, for one optimizer
    (`optimizer_state.StateCopies`: a parameter has a state per optimizer, and parameters
    the cache does not take, excluded layers, have state too)."""

    HOST = "host"  # the host copies are in ``optimizer.state`` (between steps)
    IN_TRANSIT = "in transit"  # brought for its bucket's step, not yet installed
    DEVICE = "device"  # installed for its step, or kept there (a new state has no place yet)


@dataclass
class GroupArrivals:
    """Gradients of one group (`Pipeline`'s ``groups``) arrived in this backward so far."""

    size: int
    count: int = 0

    def arrive(self) -> bool:
        """Count one arrival; whether it completes the group (the count starts again)."""
        self.count = (self.count + 1) % self.size
        return self.count == 0


@dataclass
class CachedParam:
    """One cached parameter's record."""

    name: str
    param: Param
    route: Route  # at the current step: the pipeline moves it on where the warm-up ends
    group: GroupArrivals | None  # FSDP2: the gradients it arrives with, in one buffer
    sharded: bool  # a DTensor: its gradient is taken as this rank's shard and handed back
    gradient: GradientAt = GradientAt.NONE
    # A memory budget's decision: later backward passes leave its gradient on the device.
    keep_on_device: bool = False
    # The optimizer whose fused step took its gradient in the pending step (or the last
    # one, until the next begins); weakly. None: no fused step took it.
    taken_by: weakref.ref[torch.optim.Optimizer] | None = None


def make_records(
    named_params: Sequence[tuple[str, Param]],
    routes: Mapping[Param, Route],
    groups: Sequence[Sequence[Param]],
) -> dict[Param, CachedParam]:
    """Each cached parameter's record at its first route; ``groups``: FSDP2's, whose
    gradients arrive together in one buffer (each group's cached members share a count)."""
    cached = {param for _, param in named_params}
    group_of: dict[Param, GroupArrivals] = {}
    for group in groups:
        members = [p for p in group if p in cached]
        group_of.update(dict.fromkeys(members, GroupArrivals(len(members))))
    return {
        param: CachedParam(name, param, routes[param], group_of.get(param), is_dtensor(param))
        for name, param in named_params
    }
