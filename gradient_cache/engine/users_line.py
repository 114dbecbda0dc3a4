"""Where a warning about what the user passed points: the user's own line."""

from __future__ import annotations

import sys
from types import FrameType

# torch calls the decorator's and the integrations' hooks: its frames are not the user's.
_LIBRARIES = ("gradient_cache", "torch")


def _library(module: str) -> bool:
    """A frame of the package (its demo, a user of it, aside) or of torch."""
    demo = module == "gradient_cache.demo" or module.startswith("gradient_cache.demo.")
    return module.partition(".")[0] in _LIBRARIES and not demo


def outside_the_package() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this: the first
    frame outside gradient_cache and torch, read by module name (a frame's file name can
    be where a wheel was built), so the warning names the user's line whatever lies between
    (`create_gradient_cache`, the manager, the decorator's hook under ``model(x)``). A
    framework's own frames (Lightning's trainer) are where it stops there. With no such
    frame (a hook on autograd's thread for a device), the warning's own line."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and _library(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
        level += 1
    return 1 if frame is None else level
