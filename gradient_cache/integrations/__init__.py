"""Integrations that attach the cache for you: `optimize` (a decorator) and, in
`gradient_cache.integrations.lightning`, a Lightning callback.

Both take the same arguments and check them once, when they are created, through
`CacheOptions`, so a typo fails at decoration or callback construction, not mid-training.
Lightning is imported only by its own module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.config import EngineConfig, validate_compression_ratio, validate_exclude_layers
from ..manager import GradientCacheHookManager

#: Summary fields every integration logs, as ``gradient_cache/<field>``: the Lightning
#: callback logs these at every optimizer step; the Hugging Face wrapper logs these and
#: ``host_held_mb`` (``integrations.transformers.TRAINER_LOGGED_FIELDS``).
SUMMARY_LOGGED_FIELDS = (
    "memory_saved_mb",
    "stored_gradient_mb",
    "overall_compression_ratio",
    "kept_fraction",
    "residual_mb",
)


def missing_extra(module: str, package: str, extra: str, error: ImportError) -> ImportError:
    """The error an integration module raises, from ``error``, when ``package`` fails to
    import: it names the extra that installs it. A missing package stays a
    ModuleNotFoundError with the original ``name``."""
    message = f"{module} needs {package}: pip install 'gradient-cache[{extra}]'"
    if isinstance(error, ModuleNotFoundError):
        return ModuleNotFoundError(message, name=error.name, path=error.path)
    # Installed but not importable (a version without a name this module uses, say).
    return ImportError(f"{message} ({error})", name=error.name, path=error.path)


@dataclass(frozen=True)
class CacheOptions:
    """The validated arguments of an integration; makes one manager per model."""

    compression_ratio: float
    exclude_layers: tuple[str, ...]
    verbose: bool
    config: EngineConfig
    #: Whether ``optimizer.step()`` is the fused step (`routing.StepRouting`); False
    #: restores every gradient before any step or gradient reader.
    fused_step: bool = True
    #: The GradScaler the loop scales with (the decorator's ``grad_scaler=``): its skipped
    #: steps leave no trace in the cache. An integration that finds its own passes that.
    grad_scaler: torch.amp.GradScaler | None = None

    @classmethod
    def from_arguments(
        cls,
        *,
        compression_ratio: Any,
        exclude_layers: Any,
        verbose: Any,
        options: dict[str, Any],
    ) -> CacheOptions:
        """Check every argument, naming the bad one, before anything is attached."""
        ratio = validate_compression_ratio(compression_ratio)
        patterns = validate_exclude_layers(exclude_layers)
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be True or False, got {verbose!r}.")
        options = dict(options)
        fused_step = options.pop("fused_step", True)
        grad_scaler = options.pop("grad_scaler", None)
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}."
            )
        if not isinstance(fused_step, bool):
            raise TypeError(f"fused_step must be True or False, got {fused_step!r}.")
        config = EngineConfig.from_options(options, compression_ratio=ratio)
        if config.offload_optimizer_state and not fused_step:
            raise ValueError(
                "offload_optimizer_state=True needs fused_step=True: the fused step brings "
                "the state to the device a bucket at a time, while fused_step=False restores "
                "every gradient before optimizer.step(), which would need the whole state "
                "on the device. Drop fused_step=False, or the state offload."
            )
        return cls(ratio, patterns, verbose, config, fused_step, grad_scaler)

    def create_manager(
        self,
        model: torch.nn.Module,
        *,
        exclude_layers: Sequence[str] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> GradientCacheHookManager:
        """A manager for ``model``; ``exclude_layers`` overrides the configured patterns."""
        patterns = self.exclude_layers if exclude_layers is None else exclude_layers
        return GradientCacheHookManager(
            model,
            compression_ratio=self.compression_ratio,
            exclude_layers=list(patterns),
            verbose=self.verbose,
            config=self.config,
            grad_scaler=self.grad_scaler if grad_scaler is None else grad_scaler,
        )
