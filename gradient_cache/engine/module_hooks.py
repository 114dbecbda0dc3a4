"""The cache's hooks on a user's modules, which a copy of the module does not carry live.

A module's hooks are in its dicts: ``copy.deepcopy(model)`` (an EMA copy, ``AveragedModel``)
would copy the whole cache through them. A `ModuleHook`'s deepcopy or pickle is `inert`
(a pickle is refused where the weights live in host slabs). Not covered: under FSDP2 the
``unshard`` the cache sets on each ``fully_shard`` module is an attribute a deepcopy copies.
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
