"""The warnings about what the user passed at set-up name the user's line, however the
cache is made: `create_gradient_cache`, the manager itself, or the `optimize` decorator."""

from __future__ import annotations

import _thread
import inspect
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import batches, make_model
from test_parameters_offload import STREAMED, gpt

import gradient_cache
from gradient_cache.engine.config import EngineConfig
from gradient_cache.manager import DEFAULT_COMPRESSION_RATIO, GradientCacheHookManager

WARNED_OF = {
    "exclude_layers": ({"exclude_layers": ["no_such_layer"]}, "matches no trainable parameter"),
    "scale": (
        {"grad_scaler": torch.amp.GradScaler("cpu", init_scale=10000.0)},
        "not a power of two",
    ),
    "fp16": ({**STREAMED, "compute_dtype": torch.float16}, "float16 and no GradScaler"),
    # Top-k takes only tensors of 16,384 entries or more, which gpt() has none of.
    "ladder": ({"compression_ratio": 1000.0}, "the ladder's last rung"),
}


def made_by_the_function(model: torch.nn.Module, **options: Any) -> Any:
    return gradient_cache.create_gradient_cache(model, **options)


def made_by_the_manager(
    model: torch.nn.Module,
    *,
    compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
    exclude_layers: list[str] | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    **fields: Any,
) -> Any:
    return GradientCacheHookManager(
        model,
        compression_ratio=compression_ratio,
        exclude_layers=exclude_layers,
        grad_scaler=grad_scaler,
        config=EngineConfig(**fields),
    )


@pytest.mark.parametrize("case", sorted(WARNED_OF))
@pytest.mark.parametrize("make", [made_by_the_function, made_by_the_manager])
def test_a_set_up_warning_names_the_users_line(case: str, make: Callable[..., Any]) -> None:
    options, message = WARNED_OF[case]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = torch.nn.Linear(256, 256) if case == "ladder" else gpt()
        make(model, **options).remove_hooks()
    ours = [w for w in caught if message in str(w.message)]
    assert len(ours) == 1, [str(w.message)[:80] for w in caught]
    # The line in ``make`` that called the package, not the line that called ``make``.
    lines, first = inspect.getsourcelines(make)
    where = (ours[0].filename, ours[0].lineno)
    assert where[0] == __file__ and first <= where[1] < first + len(lines), where


def test_through_the_decorator_the_warning_names_the_users_call_of_the_model() -> None:
    """The decorator makes the cache in a hook torch calls at the model's first forward:
    the warning names the user's line that called the model, not torch's module code."""
    model = make_model()
    ((tokens, _),) = batches(1)

    @gradient_cache.optimize(grad_scaler=torch.amp.GradScaler("cpu", init_scale=10000.0))
    def forward(model: torch.nn.Module) -> None:
        model(tokens)  # the user's line

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward(model)
    (ours,) = [w for w in caught if "not a power of two" in str(w.message)]
    lines, first = inspect.getsourcelines(forward.__wrapped__)
    assert ours.filename == __file__ and first <= ours.lineno < first + len(lines), (
        ours.filename,
        ours.lineno,
    )


def test_the_steps_warning_of_fp16_autocast_without_a_scaler_names_the_users_step() -> None:
    model = make_model()
    ((tokens, _),) = batches(1)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = gradient_cache.create_gradient_cache(model)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(tokens).float().sum()
    loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        users_line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        manager.step(optimizer)
    (ours,) = [w for w in caught if "no GradScaler" in str(w.message)]
    assert (ours.filename, ours.lineno) == (__file__, users_line)
    manager.remove_hooks()


def test_with_no_frame_outside_the_package_the_warning_names_its_own_line() -> None:
    """A hook on a thread with no Python frame below it (autograd's thread for a device)
    gets the warning's own line, not a level past the stack's end ("sys", line 1)."""
    where: dict[str, object] = {"__name__": "gradient_cache.engine.somewhere"}
    exec(
        "import warnings\n"
        "from gradient_cache.engine.users_line import outside_the_package\n"
        "def hook(done):\n"
        "    try:\n"
        "        with warnings.catch_warnings(record=True) as caught:\n"
        "            warnings.simplefilter('always')\n"
        "            warnings.warn('from a hook', stacklevel=outside_the_package())\n"
        "        done.append(caught[0])\n"
        "    finally:\n"
        "        done.append(None)\n",
        where,
    )
    done: list[Any] = []
    _thread.start_new_thread(where["hook"], (done,))
    deadline = time.monotonic() + 30
    while len(done) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done and done[0] is not None and done[0].lineno == 7, done
