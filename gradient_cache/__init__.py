"""gradient-cache: take gradients off the device during backward, restore them for the step."""

from .codecs.options import Ladder, TopK
from .compression import GradientCompressor
from .engine.config import EngineConfig
from .engine.hostmem import HostMemoryError
from .integrations.decorator import manager_of, optimize
from .manager import GradientCacheHookManager, create_gradient_cache

__version__ = "0.1.0"

__all__ = [
    "EngineConfig",
    "GradientCacheHookManager",
    "GradientCompressor",
    "HostMemoryError",
    "Ladder",
    "TopK",
    "__version__",
    "create_gradient_cache",
    "manager_of",
    "optimize",
]
