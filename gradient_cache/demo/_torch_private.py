"""The private torch names the demo's CPU tensor accounting needs, imported in one place.

No public torch API gives a dispatch mode (an object that sees every operator) or flattens
operator arguments, so `gradient_cache.demo.accounting` uses these; the rest of the package
uses none. A torch that moved them fails here, with what to do, rather than deep inside
the accounting.
"""

from __future__ import annotations

import torch

try:
    from torch.utils._python_dispatch import (
        TorchDispatchMode,
        _get_current_dispatch_mode,
        is_traceable_wrapper_subclass,
    )
    from torch.utils._pytree import tree_leaves
except ImportError as error:
    raise ImportError(
        f"torch {torch.__version__} does not have the private dispatch-mode names "
        "(torch.utils._python_dispatch: TorchDispatchMode, _get_current_dispatch_mode, "
        "is_traceable_wrapper_subclass; torch.utils._pytree.tree_leaves) that the CPU tensor "
        "accounting of gradient_cache.demo needs: it was written for torch>=2.3's dispatch "
        "modes. The rest of gradient_cache works without them."
    ) from error

__all__ = [
    "TorchDispatchMode",
    "_get_current_dispatch_mode",
    "is_traceable_wrapper_subclass",
    "tree_leaves",
]
