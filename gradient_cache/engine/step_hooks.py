"""The optimizer's step hooks around a fused step: fired once, as around ``optimizer.step()``.

Each bucket steps with none firing (`StepHooks.unhooked_step`); under the integrations the
user's own ``optimizer.step()`` fires them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

#: The cache's own global step hooks (the manager's refusal of a plain step over gradients
#: it holds): not the user's, so the hooks a fused step fires once leave them out.
OWN_HOOKS: set[Callable[..., Any]] = set()


class StepHooks:
    """One fused step's view of ``optimizer``'s step hooks. ``through_instance``: buckets
    step through ``optimizer.step`` itself, so an instance wrapper (an LR scheduler's) runs
    as around a plain step; else (the integrations) through the class's ``step`` unwrapped
    from ``profile_hook_step``."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, through_instance: bool) -> None:
        self._optimizer = optimizer
        step: Any = type(optimizer).step  # typed as overloads, which name no __wrapped__
        unwrapped = step.__wrapped__ if getattr(step, "hooked", False) else step
        # Bound here once: each bucket's call runs the optimizer's own code, nothing of ours.
        self._step = optimizer.step if through_instance else functools.partial(unwrapped, optimizer)
        self._fired: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def _tables(self) -> tuple[list[Any], list[Any]]:
        """The pre- and post-hooks ``optimizer.step()`` fires, in the order torch fires
        them (`Optimizer.profile_hook_step`): global pre-hooks first, global post last."""
        optimizer = self._optimizer
        pre = [
            *(hook for hook in _global_optimizer_pre_hooks.values() if hook not in OWN_HOOKS),
            *optimizer._optimizer_step_pre_hooks.values(),
        ]
        post = [
            *optimizer._optimizer_step_post_hooks.values(),
            *_global_optimizer_post_hooks.values(),
        ]
        return pre, post

    def fire_pre_hooks(self) -> None:
        """The step pre-hooks, once, as ``optimizer.step()`` fires them (with its arguments:
        the optimizer, no closure); the arguments a hook may return go to the post-hooks."""
        optimizer = self._optimizer
        args: tuple[Any, ...] = (optimizer,)
        kwargs: dict[str, Any] = {}
        for hook in self._tables()[0]:
            result = hook(optimizer, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"A step pre-hook of {type(optimizer).__name__} must return None or a "
                        f"tuple of (new_args, new_kwargs), but got {result!r}."
                    )
                args, kwargs = result
        self._fired = args, kwargs

    def fire_post_hooks(self, *, wait_for_state: Callable[[], None] | None) -> None:
        """The step post-hooks, once, with what the pre-hooks returned; none if those did not
        fire (a skipped step). ``wait_for_state`` runs first unless every hook is marked
        ``reads_no_state``: the host waits for the state only where a hook may read it."""
        if self._fired is None:
            return
        args, kwargs = self._fired
        post_hooks = self._tables()[1]
        if wait_for_state is not None and any(
            not getattr(hook, "reads_no_state", False) for hook in post_hooks
        ):
            wait_for_state()
        for hook in post_hooks:
            hook(self._optimizer, args, kwargs)

    def unhooked_step(self) -> object:
        """``optimizer.step()`` with the hook tables emptied while it runs: a subclass's
        ``super().step()`` reaches its parent's hooked wrapper, which would fire them (and
        the integrations' own pre-hook) again."""
        optimizer = self._optimizer
        tables: list[dict[int, Any]] = [
            _global_optimizer_pre_hooks,
            _global_optimizer_post_hooks,
            optimizer._optimizer_step_pre_hooks,
            optimizer._optimizer_step_post_hooks,
        ]
        saved = [dict(table) for table in tables]
        for table in tables:
            table.clear()
        try:
            return self._step()
        finally:
            for table, hooks in zip(tables, saved, strict=True):
                table.update(hooks)  # the same keys, in order: handles still remove them


def after_the_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], then: Callable[[], object]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """For an optimizer step pre-hook: ``then`` once the step's closure ran (Lightning's
    runs the backward and the clipping), or now where there is none. Returns what the
    pre-hook returns: the step's arguments with the closure wrapped, or None."""
    # args holds the optimizer itself, then step's own arguments: step(closure=None).
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        then()
        return None

    def closure_then() -> Any:
        loss = closure()
        then()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then}
    return (args[0], closure_then, *args[2:]), kwargs
