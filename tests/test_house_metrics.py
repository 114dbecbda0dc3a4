"""Issue 42's "Must show" bounds on the engine's shape, measured by the tools that report
them (tools/house_metrics.py, tools/follow_optimizer.py): run in-process, so a refactor
that breaks a bound fails here with the figures in the message."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a module (tools/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


house_metrics = load_tool("house_metrics")
follow_optimizer = load_tool("follow_optimizer")


def test_the_largest_engine_class_is_under_350_lines() -> None:
    metrics = house_metrics.measure()
    largest = metrics.classes[0]
    assert largest.lines < 350, house_metrics.report(metrics)


def test_no_engine_function_is_over_80_lines() -> None:
    metrics = house_metrics.measure()
    found = house_metrics.breaches(metrics, max_class=None, max_function=80)
    assert not found, "\n".join(found)


def test_following_the_optimizer_through_the_step_stays_in_few_files() -> None:
    """The manager's step (3 buckets, offloaded state): at most 8 comebacks to a file
    already left, no file entered more than 4 times (the issue's bounds)."""
    result = follow_optimizer.main_scenario()
    found = follow_optimizer.breaches([result], max_comebacks=8, max_entries=4)
    assert not found, "\n".join([*found, follow_optimizer.report(result)])


def test_following_a_weight_on_the_host_through_a_step_stays_in_few_files() -> None:
    """Issue 50's bounds on the weights' life: one block weight of a model whose weights,
    gradients and state are on the host enters at most 12 files and is handed back to a
    file at most 45 times through one training step (every call counted)."""
    follow_weight = load_tool("follow_weight")
    result = follow_weight.walk_one_step(
        "the weights on the host", offload_optimizer_state=True, offload_parameters=True
    )
    files, back = len(result.every.entries()), follow_weight.returns(result.every)
    assert files <= 12 and back <= 45, follow_weight.report(result)
