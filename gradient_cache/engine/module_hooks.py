"""The cache's hooks on a user's modules, which a copy of the module does not carry live.

A module keeps its hooks in its own dicts, so ``copy.deepcopy(model)`` (an EMA copy,
``torch.optim.swa_utils.AveragedModel``) copies them, and with them, through the bound
methods, the whole cache: the copy then ran the cache's checks and moves on parameters the
cache never held, and refused to compute. Every hook the cache registers on a module is a
`ModuleHook`, whose copy is `inert`: the copy computes as a plain module does. (Under FSDP2
the cache also puts an ``unshard`` of its own on each ``fully_shard`` module, an instance
attribute, not a hook: a deepcopy of such a model copies it; not tested.)
``torch.save(model)`` pickles the hooks the same way (a reference to `inert`), or, where the
module's weights live in the cache's host slabs, refuses and names what to save instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def inert(*args: Any, **kwargs: Any) -> None:
    """What a copied module's cache hook does: nothing."""


def _inert() -> Callable[..., None]:
    return inert


class ModuleHook:
    """``function`` as a module hook (see the module docstring). ``unpicklable``: why a
    pickle of the module must be refused (its weights in host slabs), or None."""

    def __init__(self, function: Callable[..., Any], *, unpicklable: str | None = None) -> None:
        self.function = function
        self.unpicklable = unpicklable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return inert

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        if self.unpicklable is not None:
            raise TypeError(self.unpicklable)
        return _inert, ()
