"""What both placements' streams share: the save and load hooks on every module that owns
a parameter (a save or load of a submodule runs only its own subtree's hooks:
docs/ARCHITECTURE.md, "Traps"),
the end of backward, and the small rules every weight hook follows.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Set
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..module_hooks import ModuleHook
from .masters import HostWeights, Param

UNPICKLABLE = (
    "torch.save(model) pickles the module whole, and with offload_parameters=True its "
    "weights live in the gradient cache's host slabs. Save model.state_dict() instead "
    "(compact copies of the weights; the cache's own state is hook_manager.state_dict()), "
    "or call hook_manager.remove_hooks() first."
)


def module_hook(method: Callable[..., Any], *bound: Any) -> ModuleHook:
    """``method`` with ``bound`` first, as a module hook: inert in a copy, refused in a pickle."""
    return ModuleHook(functools.partial(method, *bound), unpicklable=UNPICKLABLE)


def in_backward() -> bool:
    """Whether autograd runs a backward on this thread (a checkpointed forward reruns there)."""
    return torch._C._current_graph_task_id() != -1


def tensors_needing_gradients(output: Any) -> list[torch.Tensor]:
    return [
        t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
    ]


def outputs_needing_gradients(output: Any, *, passed: Set[int] = frozenset()) -> list[torch.Tensor]:
    """A forward's output tensors that need gradients (`tensors_in`), but for those in the
    objects ``passed`` in (by id: a cache the blocks share holds earlier blocks' tensors)."""
    return [tensor for tensor in tensors_in(output, skip=passed) if tensor.requires_grad]


def tensors_in(value: Any, depth: int = 3, *, skip: Set[int] = frozenset()) -> list[torch.Tensor]:
    """The tensors in ``value``'s pytree containers and ``depth`` levels down the objects it
    cannot see into (a plain class, an unregistered dataclass), but for those in ``skip``."""
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif depth and _plain_object(leaf) and id(leaf) not in skip:
            found += tensors_in(vars(leaf), depth - 1, skip=skip)
    return found


def _plain_object(value: Any) -> bool:
    return hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module | type)


_MODULE_OWN = frozenset(vars(torch.nn.Module()))  # a module's own bookkeeping attributes


def left_on_modules(block: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors of a graph a block's forward left on its modules (``self.aux_loss``, also in a
    buffer's name), whose backward may run before the block's outputs'. Searched: tensors,
    lists, tuples, dicts, deques and dataclasses (other objects, a config: too many)."""
    return [
        tensor
        for module in block.modules()
        for name, value in vars(module).items()
        if _may_hold(name, value)
        for tensor in tensors_in(value, depth=2)
        if tensor.grad_fn is not None
    ]


_HOLDERS = (torch.Tensor, list, tuple, dict, collections.deque)


def _may_hold(name: str, value: Any) -> bool:
    """Whether a module's attribute ``name`` may hold a tensor of a graph."""
    if name in _MODULE_OWN:
        return name == "_buffers"  # a loss assigned to a buffer's name goes there
    return isinstance(value, _HOLDERS) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )


def refuse_create_graph() -> None:
    """A backward with ``create_graph=True`` would save the weights' device copies, which go
    when it ends, for a second backward to read freed."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "A backward with create_graph=True (torch.autograd.grad(..., create_graph=True), "
            "a gradient penalty) reached a model whose weights are on the host "
            "(offload_parameters=True): the graph it records would read the blocks' device "
            "copies after they are given back. Compute the penalty without create_graph, "
            "or create the cache without offload_parameters."
        )


class BackwardEnd:
    """``ended``, called once at the end of the backward running now: `queue` it from any
    hook of that backward. A backward that raised ends at the next forward
    (`after_a_failed_backward`); autograd's device thread may still run its hooks then,
    so they run under ``lock`` and skip that backward (`of_this_backward`), and the end
    first waits for that thread's node, which may read the weights it frees."""

    def __init__(self, ended: Callable[[], None], device: torch.device) -> None:
        self._ended = ended
        self._device = device
        self._queued = False
        self._task = -1  # the graph task whose end is queued
        self._failed = -1  # the last graph task that raised before its end
        self.raised = False  # ``ended`` is running for a backward that raised
        self.lock = threading.RLock()

    def queue(self) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._run)
            self._queued = True
            self._task = torch._C._current_graph_task_id()

    def _run(self) -> None:
        self._queued = False
        self._ended()

    def after_a_failed_backward(self) -> None:
        """Outside any backward: a callback still queued means its backward raised (autograd
        dropped it), so ``ended`` runs now (`raised` True meanwhile), or no later backward
        would queue its own."""
        with self.lock:
            if not self._queued:
                return
            self._failed = self._task  # its late hooks skip from now on
        self._wait_for_the_device_thread()  # unlocked: a late hook takes the lock to skip
        with self.lock:
            self.raised = True
            try:
                self._run()
            finally:
                self.raised = False

    def _wait_for_the_device_thread(self) -> None:
        """A one-node backward on the device: its thread runs it after its node running now,
        and skips the rest of a backward that raised."""
        if self._device.type == "cpu":
            return  # one thread: the backward that raised is over
        with torch.inference_mode(False), torch.enable_grad():
            torch.zeros((), device=self._device, requires_grad=True).backward()

    def in_a_failed_backward(self) -> bool:
        """Whether the hook running now belongs to a backward that raised."""
        return torch._C._current_graph_task_id() == self._failed


def of_this_backward(method: Callable[..., Any]) -> Callable[..., Any]:
    """A stream's backward hook, run under its ``end``'s lock, skipped in a failed backward."""

    @functools.wraps(method)
    def hook(self: Any, *args: Any) -> Any:
        with self.end.lock:
            if self.end.in_a_failed_backward():
                return None
            return method(self, *args)

    return hook


class OwnerHooks:
    """The save and load hooks on every module of ``model`` owning one of ``weights``'
    parameters. ``give_up``: the stream's way to send some home."""

    def __init__(
        self,
        model: torch.nn.Module,
        weights: HostWeights,
        *,
        give_up: Callable[[list[Param]], None],
    ) -> None:
        self.weights = weights
        self._give_up = give_up
        held = set(weights.params())
        owners = [
            (m, {n: p for n, p in m.named_parameters(recurse=False) if p in held})
            for m in model.modules()
        ]
        owned = collections.Counter(p for _, own in owners for p in own.values())
        self._tied = {p for p, count in owned.items() if count > 1}  # a tied head
        self._saved: dict[Param, weakref.ref[torch.Tensor]] = {}  # a tied weight's copy
        self.handles = []
        for owner, own in owners:
            if own:
                self.handles += [
                    owner.register_state_dict_pre_hook(module_hook(self._home, own)),
                    owner.register_state_dict_post_hook(module_hook(self._compact, own)),
                    owner.register_load_state_dict_pre_hook(module_hook(self._load_begins, own)),
                    owner.register_load_state_dict_post_hook(module_hook(self._loaded, own)),
                ]

    def _home(self, own: dict[str, Param], *args: Any) -> None:
        """``own`` (one module's parameters) home, no copy still using a master."""
        present = set(self.weights.present())
        self._give_up([p for p in own.values() if p in present])
        self.weights.wait_on_host()

    def _compact(
        self, own: dict[str, Param], module: Any, state: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        """Each of ``own`` in ``state`` as a copy of its own (``torch.save`` would write a
        master's whole slab, safetensors refuses it as shared); a tied one as one copy."""
        for name, param in own.items():
            value = state.get(prefix + name)
            if not isinstance(value, torch.Tensor) or not self.weights.holds(value):
                continue
            if param not in self._tied:
                state[prefix + name] = value.clone()
                continue
            earlier = self._saved.get(param)
            copy = earlier() if earlier is not None else None
            if copy is None or not any(v is copy for v in state.values()):
                copy = value.clone()
                self._saved[param] = weakref.ref(copy)
            state[prefix + name] = copy

    def _load_begins(self, own: dict[str, Param], *args: Any) -> None:
        """A load writes ``own``: the masters at rest, or (FSDP2) the shards filled first."""
        if self.weights.placement.loads_on_device:  # the masters themselves, not casts
            self.weights.ensure(own.values(), step=True)
        else:
            self._home(own)

    def _loaded(self, own: dict[str, Param], module: Any, incompatible_keys: Any) -> None:
        """Under FSDP2 the loaded shards to their masters, and their memory given up."""
        if self.weights.placement.loads_on_device:
            self.weights.store(own.values())
            self.weights.wait_on_host()
