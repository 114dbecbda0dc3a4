"""`@gradient_cache.optimize`: the cache for every model trained inside one function call.

While the decorated function runs, two process-wide PyTorch hooks are in place:

* a module forward pre-hook attaches a `GradientCacheHookManager` to each root model the
  first time it runs a forward pass with gradients enabled;
* `routing.StepRouting`: ``optimizer.step()`` is the cache's fused step (restored and
  stepped a bucket at a time), and ``clip_grad_norm_`` is answered from the cache.

When the function returns or raises, both hooks are removed and every manager is
detached, which puts any gradient still cached back into ``param.grad``; each model's cache
state passes to the next call's manager for it (an epoch function called once an epoch).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from ..data_parallel import check_data_parallel
from ..engine.config import DEFAULT_COMPRESSION_RATIO
from ..manager import GradientCacheHookManager
from . import CacheOptions
from .routing import StepRouting

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("gradient_cache")

#: The name of the Metaflow artifact that holds the summaries of a decorated step.
FLOW_ARTIFACT = "gradient_cache_summaries"

_active_lock = threading.Lock()
_active: _Session | None = None  # the hooks are process-wide, so one session at a time
# Each model's cache a call's close left attached (no room on the device for its gradients):
# `manager_of` finds it between calls, and the next decorated call closes it first.
_unclosed: weakref.WeakKeyDictionary[torch.nn.Module, GradientCacheHookManager] = (
    weakref.WeakKeyDictionary()
)


def optimize(
    compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
    *,
    exclude_layers: Sequence[str] | None = None,
    verbose: bool = False,
    **options: Any,
) -> GradientCacheDecorator:
    """Cache the gradients of every model trained inside the decorated function.

    The function needs no change: a loop of ``loss.backward()``, ``optimizer.step()``
    and ``optimizer.zero_grad()`` trains as without the decorator (bit for bit at
    ``compression_ratio=1``), with each gradient held in host memory from the moment
    backward produces it until ``optimizer.step()``, which is the cache's fused step:
    it restores and steps one bucket at a time (`routing.StepRouting`).
    Gradient accumulation (several backward passes per step) and closures
    (``optimizer.step(closure)``, e.g. LBFGS) work as in plain PyTorch.

    Args:
        compression_ratio, exclude_layers, verbose, options: as for
            `gradient_cache.create_gradient_cache`, applied to every model; and
            ``fused_step=False`` to restore every gradient before any step instead (for an
            optimizer whose update of a parameter reads other parameters' gradients).
            ``exclude_layers`` entries are matched against each model's own parameter
            names; an entry that matches no model's parameter is warned about when the
            function returns.

    Which models: a root model is the first module of a call chain that runs a forward
    pass with gradients enabled, together with all its submodules; one manager is
    attached per root. Models used only under ``torch.no_grad()`` or
    ``torch.inference_mode()``, and models without trainable parameters, are left
    alone. A model's trainable parameters are taken when it is first seen; if a
    submodule ran on its own first, its manager is replaced by its parent's.

    Clipping and unscaling work: while the function runs, ``torch.nn.utils``'s
    ``clip_grad_norm_`` and ``clip_grads_with_norm_`` are answered from the cache, and
    ``clip_grad_value_`` and ``GradScaler.unscale_`` restore every cached gradient before
    they read any (`gradient_readers`), so Hugging Face's ``Trainer`` and ``accelerate``
    clip as without the cache. Other code that reads or changes
    gradients between ``backward()`` and ``optimizer.step()`` (gradient logging, a
    ``zero_grad()`` that skips a step) sees none: call ``manager_of(model)``'s
    ``apply_gradients()`` (or ``discard_gradients()``) before it. Only one decorated
    function may run at a time in a process (the hooks are process-wide). Models
    sharded with FSDP2's ``fully_shard`` work (each rank caches its shards); models
    under classic ``DistributedDataParallel`` are refused, with the reason.

    Summaries: after each call, ``wrapper.last_summaries`` is a list with one dict per
    cached model, in the order the models were first seen: ``"model"`` (the class name)
    plus the keys of ``get_compression_summary()``. It is set even if the function
    raised. Under Metaflow (``@step`` above ``@optimize(...)``), where each step runs in
    its own process, the same list is stored on the flow as the artifact
    ``gradient_cache_summaries``.

    Example::

        @gradient_cache.optimize(compression_ratio=100)
        def train(model, data):
            optimizer = torch.optim.AdamW(model.parameters())
            for x, y in data:
                loss_fn(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()

        train(model, data)
        print(train.last_summaries[0]["memory_saved_mb"])
    """
    if callable(compression_ratio):
        raise TypeError(
            "optimize must be called with its options: write @gradient_cache.optimize() or "
            "@gradient_cache.optimize(compression_ratio=100), not @gradient_cache.optimize."
        )
    return GradientCacheDecorator(
        compression_ratio, exclude_layers=exclude_layers, verbose=verbose, **options
    )


class GradientCacheDecorator:
    """What `optimize` returns (the seed's name for it): applied to a function, it caches
    the gradients of every model trained inside each call. Made with `optimize`'s
    arguments, checked here."""

    def __init__(
        self,
        compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
        *,
        exclude_layers: Sequence[str] | None = None,
        verbose: bool = False,
        **options: Any,
    ) -> None:
        self.settings = CacheOptions.from_arguments(
            compression_ratio=compression_ratio,
            exclude_layers=exclude_layers,
            verbose=verbose,
            options=options,
        )

    def __call__(self, func: F) -> F:
        if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func):
            raise TypeError(
                f"optimize cannot decorate {func.__qualname__}: it is a generator or async "
                "function, whose body runs after the call returns, when the cache's hooks "
                "are already gone. Decorate the function that runs the training loop."
            )
        settings = self.settings
        # Each model's cache state (residuals, step count, generators) from one call to the
        # next: an epoch function called per epoch trains as one long-lived cache.
        carried: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Any]] = (
            weakref.WeakKeyDictionary()
        )

        # functools.wraps sets __wrapped__, through which Metaflow reads the step's source.
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            session = _Session(settings, func.__qualname__, carried)
            try:
                with session:
                    return func(*args, **kwargs)
            finally:
                this = own()  # weakly: a cell holding the wrapper is a cycle (a closure's
                if this is not None:  # models alive until a collection)
                    # A function attribute, which no Callable type declares.
                    this.last_summaries = session.summaries  # type: ignore[attr-defined]
                _store_on_flow(args, session.summaries)

        own = weakref.ref(wrapper)
        wrapper.last_summaries = []  # type: ignore[attr-defined]  # as above
        return cast(F, wrapper)  # functools.wraps keeps func's signature


def manager_of(model: torch.nn.Module) -> GradientCacheHookManager:
    """The manager the running ``@optimize`` function uses for ``model``: for checkpoints.

    Attaches one now if ``model`` has not run a forward pass yet, so that a checkpoint can
    be loaded before the first backward. Pass the model whose forward you call (the
    root). Inside the decorated function::

        cache = gradient_cache.manager_of(model)
        cache.load_state_dict(checkpoint["cache"])  # when resuming
        ...
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "cache": cache.state_dict()}, path)
    """
    session = _active
    if session is None and model in _unclosed:
        return _unclosed[model]  # a call's close left it attached: remove_hooks() it again
    if session is None:
        raise RuntimeError(
            "gradient_cache.manager_of() works only while a function decorated with "
            "gradient_cache.optimize runs; call it inside that function. Without the "
            "decorator, create_gradient_cache() returns the manager itself."
        )
    if session.manager_for(model) is None and model not in session._seen:
        session.attach(model)
    manager = session.manager_for(model)
    if manager is None:
        raise ValueError(
            f"{type(model).__name__} has no gradients to cache in {session.name} (no "
            "trainable parameter, all of them excluded, or only used under no_grad)."
        )
    return manager


class _Session:
    """One call of a decorated function: its global hooks, root models and managers."""

    def __init__(
        self,
        settings: CacheOptions,
        name: str,
        carried: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Any]],
    ) -> None:
        self.settings = settings
        self.name = name
        self._carried = carried  # the decorated function's: each root's state at its last return
        self.managers: dict[torch.nn.Module, GradientCacheHookManager] = {}
        self.summaries: list[dict[str, Any]] = []
        # Every module already handled (cached, skipped, or inside one of those). Weak,
        # so modules built on the fly inside a forward are not kept alive.
        self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._matched_patterns: set[str] = set()
        self._handles: list[Any] = []
        self._routing = StepRouting(self.managers.values, fused=settings.fused_step)

    # --- lifetime -----------------------------------------------------------------

    def __enter__(self) -> _Session:
        global _active
        with _active_lock:
            if _active is not None:
                raise RuntimeError(
                    f"{self.name} is decorated with gradient_cache.optimize and was called while "
                    f"{_active.name}, also decorated, is running. The cache's hooks are global "
                    "to the process, so only one decorated function may run at a time: keep "
                    "the decorator on the outermost training function only."
                )
            _active = self
        try:
            for root, manager in list(_unclosed.items()):
                manager.remove_hooks(abandon_an_awaited_backward=True)  # .grad: the last step's
                del _unclosed[root]
        except BaseException:
            _active = None
            raise
        self._handles = [register_module_forward_pre_hook(self._on_forward)]
        # optimizer.step() is the fused step; clip_grad_norm_ & co. answered from the cache.
        self._routing.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        global _active
        try:
            self._routing.__exit__(None, None, None)
            for handle in self._handles:
                handle.remove()
            self.summaries = [
                {"model": type(root).__name__, **manager.get_compression_summary()}
                for root, manager in self.managers.items()
            ]
            for root, manager in self.managers.items():
                engine = manager.engine
                if engine is not None and not engine.step_pending:
                    self._carried[root] = manager.state_dict()
                elif engine is not None:  # its close puts the step's gradients in .grad
                    warnings.warn(
                        f"{self.name} ended with a step of {type(root).__name__} pending "
                        "(a backward after its last optimizer.step()): its gradients go "
                        "back to .grad, and its cache state (error-feedback residuals, the "
                        "step count) does not pass to the next call, whose cache starts "
                        "afresh. End the function after optimizer.step().",
                        UserWarning,
                        stacklevel=3,
                    )
        finally:
            try:
                self._detach_all()
            finally:
                _active = None
        unmatched = [p for p in self.settings.exclude_layers if p not in self._matched_patterns]
        if unmatched and self.managers and exc_type is None:
            models = sorted({type(root).__name__ for root in self.managers})
            warnings.warn(
                f"exclude_layers entries {unmatched} matched no trainable parameter name of the "
                f"models trained in {self.name} ({', '.join(models)}); check "
                "model.named_parameters() for the names.",
                UserWarning,
                stacklevel=3,
            )

    def _detach_all(self) -> None:
        """Detach every manager (each puts its cached gradients back), even if one fails."""
        error: BaseException | None = None
        for root, manager in self.managers.items():
            try:
                # Never refused: the function ended (or raised) with any forward in it.
                manager.remove_hooks(abandon_an_awaited_backward=True)
            except torch.OutOfMemoryError as caught:  # attached still: the next call closes it
                _unclosed[root] = manager
                error = error or caught
            except BaseException as caught:  # detach the rest, then re-raise the first
                error = error or caught
        if error is not None:
            try:
                raise error
            finally:  # this frame, in its traceback, would hold it in a cycle (and the models)
                error = None

    # --- the global hooks ---------------------------------------------------------

    def _on_forward(self, module: torch.nn.Module, inputs: Any) -> None:
        """Fires for every module call; attaches to roots not seen before."""
        if torch.is_grad_enabled() and module not in self._seen:
            self.attach(module)

    def manager_for(self, model: torch.nn.Module) -> GradientCacheHookManager | None:
        """The manager of ``model`` or of the root it belongs to, if any."""
        for root, manager in self.managers.items():
            if model is root or model in set(root.modules()):
                return manager
        return None

    def _refuse_sharing(self, module: torch.nn.Module) -> None:
        """A module called on its own that shares a parameter with another one called on
        its own (an embedding and a head tied to it): each would be a model with a cache of
        its own, and a parameter can be in one cache only."""
        for root in self.managers:
            shared = _shared_with(module, root)
            if shared:
                raise ValueError(
                    f"{self.name} called {type(module).__name__} and {type(root).__name__} "
                    f"each on its own, and they share parameters ({', '.join(shared[:3])}): "
                    "@gradient_cache.optimize caches each model called on its own, and a "
                    "parameter can be in one cache only. Call gradient_cache.manager_of(m) "
                    "first in the function, with m a module holding both (the one whose "
                    "parameters the optimizer takes): it then caches them as one model."
                )

    def attach(self, module: torch.nn.Module) -> None:
        """Make ``module`` a root: cache its trainable parameters (if any are left)."""
        # The outermost module of a forward pass fires first, so its submodules are
        # marked seen before they run.
        modules = set(module.modules())
        self._seen.update(modules)
        check_data_parallel(module)  # classic DDP: refused with the reason
        trainable = [name for name, p in module.named_parameters() if p.requires_grad]
        patterns = [p for p in self.settings.exclude_layers if any(p in n for n in trainable)]
        self._matched_patterns.update(patterns)
        if all(any(p in name for p in patterns) for name in trainable):
            return  # nothing to cache: frozen, parameter-free, or wholly excluded
        for inner in [root for root in self.managers if root in modules]:
            # A submodule that ran on its own first: its parent's manager replaces it.
            self.managers.pop(inner).remove_hooks(abandon_an_awaited_backward=True)
        self._refuse_sharing(module)
        budget = self.settings.config.memory_budget
        if budget is not None and self.managers:
            raise ValueError(
                f"memory_budget={budget!r} covers one model per decorated function, and "
                f"{self.name} trains a second ({type(module).__name__}, beside "
                f"{type(next(iter(self.managers))).__name__}): each model's cache would spend "
                "the whole budget's room. Drop memory_budget, or decorate a function that "
                "trains one model."
            )
        self.managers[module] = manager = self.settings.create_manager(
            module, exclude_layers=patterns
        )
        state = self._carried.pop(module, None)
        if state is not None:
            try:
                manager.load_state_dict(state)
            except (ValueError, RuntimeError) as error:  # the model changed since (its message)
                warnings.warn(
                    f"{self.name}: {type(module).__name__}'s cache starts afresh in this call "
                    f"(its error-feedback residuals and warm-up from the last call dropped): "
                    f"{error}",
                    UserWarning,
                    stacklevel=3,
                )
        if self.settings.verbose:
            logger.info(
                "gradient-cache: caching %s (%d trainable parameters) in %s",
                type(module).__name__,
                len(trainable),
                self.name,
            )


def _shared_with(module: torch.nn.Module, root: torch.nn.Module) -> list[str]:
    """The names in ``module`` of the parameters it shares with ``root`` (a tied weight)."""
    theirs = set(root.parameters())
    return [name for name, param in module.named_parameters() if param in theirs]


def _store_on_flow(args: tuple[Any, ...], summaries: list[dict[str, Any]]) -> None:
    """Under Metaflow, keep the summaries as an artifact of the decorated step."""
    if not args or "metaflow" not in sys.modules:
        return  # a FlowSpec cannot exist without metaflow imported
    from metaflow import FlowSpec

    if isinstance(args[0], FlowSpec):
        setattr(args[0], FLOW_ARTIFACT, summaries)
