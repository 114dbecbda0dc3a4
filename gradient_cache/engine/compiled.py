"""What the cache needs of ``torch.compile``, without importing ``torch._dynamo``.

Importing ``torch._dynamo`` costs about 1.6 s of a process's start on a CPU (more than
``import torch`` itself); a process that never compiles (a data-loader worker, a ``torchrun``
rank, the demo's runs) should not pay it. Before anything has imported it nothing can be
compiling, and no module can be a compiled one.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_Function = TypeVar("_Function", bound=Callable[..., Any])


def outside_graphs(method: _Function) -> _Function:
    """``method`` run eagerly under ``torch.compile`` (a graph break), as
    ``torch.compiler.disable`` makes it: hooks that resize storage or raise cannot be traced."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return method(*args, **kwargs)
            import torch._dynamo

            disabled = torch._dynamo.disable(method, recursive=True)
        return disabled(*args, **kwargs)

    return run  # type: ignore[return-value]


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(model)`` wraps, or ``model`` itself."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod
    return model
