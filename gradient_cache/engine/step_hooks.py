"""The optimizer's step hooks around a fused step: fired once, as around ``optimizer.step()``.

The fused step steps a bucket at a time; the user's step hooks (``register_step_pre_hook``,
``register_step_post_hook``, global ones too) must still fire once per step. Each bucket
steps through `unhooked_step`, and the hooks fire around the whole step (`fire_pre_hooks`,
`fire_post_hooks`), or, for the integrations, around the user's own ``optimizer.step()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

HookArgs = tuple[tuple[Any, ...], dict[str, Any]]


def hook_tables(optimizer: torch.optim.Optimizer) -> tuple[list[Any], list[Any]]:
    """The pre- and post-hooks ``optimizer.step()`` fires, in the order torch fires them
    (`Optimizer.profile_hook_step`): global pre-hooks first, global post-hooks last."""
    pre = [*_global_optimizer_pre_hooks.values(), *optimizer._optimizer_step_pre_hooks.values()]
    post = [*optimizer._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()]
    return pre, post


def fire_pre_hooks(optimizer: torch.optim.Optimizer) -> HookArgs:
    """The step pre-hooks, once, as ``optimizer.step()`` fires them (with its arguments:
    the optimizer, no closure); the arguments a hook may return go to the post-hooks."""
    args: tuple[Any, ...] = (optimizer,)
    kwargs: dict[str, Any] = {}
    for hook in hook_tables(optimizer)[0]:
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"A step pre-hook of {type(optimizer).__name__} must return None or a "
                    f"tuple of (new_args, new_kwargs), but got {result!r}."
                )
            args, kwargs = result
    return args, kwargs


def fire_post_hooks(
    optimizer: torch.optim.Optimizer, fired: HookArgs, *, wait_for_state: Callable[[], None] | None
) -> None:
    """The step post-hooks, once, with what the pre-hooks returned. ``wait_for_state``
    (the state offloaded): the host waits for the state's copies back before a post-hook
    reads ``optimizer.state`` (an EMA, a logger); without such a hook (each marked
    ``reads_no_state``) the step ends with no host wait, the next forward queued at once."""
    args, kwargs = fired
    post_hooks = hook_tables(optimizer)[1]
    if wait_for_state is not None and any(
        not getattr(hook, "reads_no_state", False) for hook in post_hooks
    ):
        wait_for_state()
    for hook in post_hooks:
        hook(optimizer, args, kwargs)


def unhooked_step(
    optimizer: torch.optim.Optimizer, *, through_instance: bool = False
) -> Callable[[], object]:
    """``optimizer.step()`` with no step hook firing: while it runs, the global and the
    optimizer's hook tables are emptied (a subclass's ``super().step()`` reaches its
    parent's hooked wrapper, which would fire them, and the integrations' own pre-hook,
    again). ``through_instance``: call ``optimizer.step`` itself, so that an instance
    wrapper (an LR scheduler's, which notes that the optimizer stepped) runs, as it would
    around a plain step; else the class's ``step`` as it was before ``Optimizer.__init__``
    wrapped it in ``profile_hook_step`` (marked ``hooked``), no instance wrapper: the
    integrations' user calls ``optimizer.step()`` itself."""
    step: Any = type(optimizer).step  # typed as overloads, which name no __wrapped__
    unwrapped = step.__wrapped__ if getattr(step, "hooked", False) else step
    original = (lambda _: optimizer.step()) if through_instance else unwrapped
    tables: list[dict[int, Any]] = [
        _global_optimizer_pre_hooks,
        _global_optimizer_post_hooks,
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
    ]

    def step_once() -> object:
        saved = [dict(table) for table in tables]
        for table in tables:
            table.clear()
        try:
            return original(optimizer)
        finally:
            for table, hooks in zip(tables, saved, strict=True):
                table.update(hooks)  # the same keys, in order: handles still remove them

    return step_once
