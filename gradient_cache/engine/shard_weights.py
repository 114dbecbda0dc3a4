"""FSDP2's shards in host memory, on the device only while in use (``offload_parameters``).

Under ``fully_shard`` each parameter ``P`` is a `DTensor` whose local tensor is a view of
a padded flat tensor of FSDP2's own: this rank's *shard* ``S``, which FSDP2's all-gather
reads before a module's forward (and before its backward where it resharded after
forward), and which the optimizer updates. Nothing else reads it: the all-gathered weights
and the gradients live in other tensors.

So these weights keep ``S``'s storage object and only move its memory, as `HostWeights`
does with a device tensor of its own: the master (the padded shard, in host slabs: pinned
on CUDA, the host budget checked first) is copied into the storage (``resize_`` and fill)
before FSDP2's all-gather or the optimizer reads it, and the storage is given up
(``resize_(0)``) once they are done. FSDP2's flat view keeps pointing at ``S``.

``P``'s local tensor is the one thing that moves (as FSDP2's ``reset_sharded_param`` moves
it): at rest a view of the master, so that ``model.parameters()`` and ``state_dict()``
read host tensors (`DTensor`s around host tensors, as FSDP2's ``CPUOffloadPolicy`` gives
them); in use (the step, and whenever FSDP2 may re-read it: its lazy init, a load) its
view of ``S``. Streams (CUDA) are `HostWeights'`; FSDP2's all-gather copy-in runs on a
stream of its own, which the stream hooks order after the refill (`Backend.let_read`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from . import sharding
from .backend import Backend
from .host_weights import HostWeights, Param, WeightAt, _Weight


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole of ``tensor``'s storage (the padded shard)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        storage, 0, (storage.nbytes() // tensor.element_size(),), (1,)
    )


class ShardWeights(HostWeights):
    """The masters of ``named_params``' shards (FSDP2 `DTensor` parameters); construction
    copies each shard into its master and leaves the shard on the device, in use, until
    the first time it may go (`_rest`)."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, Param]],
        backend: Backend,
        *,
        fraction: float,
        flat_shards: Mapping[Param, Callable[[], torch.Tensor]],
    ) -> None:
        """``flat_shards``: each parameter's flat padded shard as FSDP2 holds it now (what
        its all-gather reads), read each time: FSDP2 may replace it."""
        # Each parameter's local tensor: its view of S (FSDP2's) and of the master (at rest).
        self._locals: dict[Param, tuple[torch.Tensor, torch.Tensor]] = {}
        self._flat_shards = flat_shards
        super().__init__(named_params, backend, fraction=fraction)

    def _check(self, named_params: Sequence[tuple[str, Param]]) -> None:
        """Every parameter one of FSDP2's shards (each has a padded storage of its own):
        the cache's own check refuses unsharded trainable ones, this the frozen ones."""
        for name, param in named_params:
            if not sharding.is_dtensor(param):
                raise ValueError(
                    f"offload_parameters=True under FSDP2 cannot move parameter {name!r}: it "
                    "is not one of FSDP2's shards. Shard every parameter (fully_shard(model) "
                    "after the blocks) before creating the cache."
                )

    def _source(self, param: Param) -> torch.Tensor:
        """The whole padded shard, which FSDP2's all-gather reads."""
        return _flat(sharding.local(param))

    def _weight(self, source: torch.Tensor, master: torch.Tensor) -> _Weight:
        return _Weight(master, source, source)  # the shard's own storage, in its dtype

    def _rest(self, param: Param, weight: _Weight) -> None:
        """The master filled; S stays on the device, in use, until the first time it may
        go (FSDP2's pre-hook of a forward running now may already be under way)."""
        on_device = sharding.local_object(param)  # FSDP2's narrow view of S
        at_rest = weight.master[: on_device.numel()].view(on_device.shape)
        self._locals[param] = (on_device, at_rest)
        weight.at, weight.in_use = WeightAt.DEVICE, weight.full
        weight.version = param._version  # a write from now on is a write to copy back

    def _show(self, param: Param, weight: _Weight) -> None:
        """``P``'s local tensor: its view of S once arrived, else of its master."""
        on_device, at_rest = self._locals[param]
        sharding.set_local(param, on_device if weight.place() is weight.full else at_rest)

    def in_place(self, param: Param) -> bool:
        """Whether FSDP2 still all-gathers ``param`` from S (its ``reset_sharded_param``,
        run while S is given up, would take other memory for the shard)."""
        weight, flat = self._weights.get(param), self._flat_shards.get(param)
        return weight is not None and flat is not None and flat().is_set_to(weight.full)

    def close(self) -> None:
        """Every shard back on the device for good, as plain FSDP2 keeps it (one on the
        device stays: it is the newest). Raises, with nothing changed but some shards
        brought, where the device has no room: unlike a parameter on one process, a shard
        left on the host would be read freed by FSDP2's next all-gather."""
        try:
            self.ensure(list(self._weights))
        except torch.OutOfMemoryError as error:
            size = sum(w.master.nbytes for w in self._weights.values()) / 2**20
            raise RuntimeError(
                f"remove_hooks(): this rank's shards ({size:.1f} MiB) did not fit back on "
                "the device, where plain FSDP2 keeps them. The cache stays attached and "
                "keeps streaming them; free device memory and call remove_hooks() again, "
                "or save the model (model.state_dict()) and train on with the cache."
            ) from error
        self._weights, self._locals = {}, {}
