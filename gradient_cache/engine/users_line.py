"""Where a warning about what the user passed points: the user's own line."""

from __future__ import annotations

import os
import sys
from types import FrameType

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def outside_the_package() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function that calls this: the first
    frame outside gradient_cache, so the warning names the user's line however many of the
    package's frames lie between (`create_gradient_cache`, the manager, the decorator).
    Python 3.12's ``skip_file_prefixes`` does this."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level
