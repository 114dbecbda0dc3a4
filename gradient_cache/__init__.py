"""gradient-cache: take gradients off the device during backward, restore them for the step."""

from .codecs.options import Ladder, TopK
from .compression import GradientCompressor
from .engine.budget import MemoryBudgetError
from .engine.config import EngineConfig
from .engine.hostmem import HostMemoryError
from .integrations.decorator import GradientCacheDecorator, manager_of, optimize
from .manager import GradientCacheHookManager, create_gradient_cache
from .stats import CompressionSummary

#: The seed's name for the typed summary (`GradientCacheHookManager.summary()`).
MemoryStats = CompressionSummary

# The seed's classes with no counterpart of the same shape: what replaced each, and where.
_REPLACED = {
    "AdaptiveGradientCompressor": (
        "the codec ladder: at each compression_ratio every tensor takes the best-training "
        "codec that fits its byte budget (codec=None, or gradient_cache.Ladder); "
        "GradientCompressor compresses one tensor by top-k. Docs: docs/compression.md"
    ),
    "GPUMemoryManager": (
        "the memory_budget= option (offload only what must leave the device, decided from "
        "the first steps' measured peak) and the summary's memory figures "
        "(hook_manager.summary()). Docs: docs/options.md#memory_budget and docs/summary.md"
    ),
}


def __getattr__(name: str) -> object:
    if name in _REPLACED:
        raise AttributeError(
            f"gradient_cache.{name} was the seed's and is gone; what replaced it: "
            f"{_REPLACED[name]}."
        )
    raise AttributeError(f"module 'gradient_cache' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "CompressionSummary",
    "EngineConfig",
    "GradientCacheDecorator",
    "GradientCacheHookManager",
    "GradientCompressor",
    "HostMemoryError",
    "Ladder",
    "MemoryBudgetError",
    "MemoryStats",
    "TopK",
    "__version__",
    "create_gradient_cache",
    "manager_of",
    "optimize",
]
