"""The pipeline's step life (engine/pipeline.py): its states, the phases that move them, and
the refusals of a phase started from the wrong state.

`test_call_orders.py` drives the same states in random legal orders against a model of
them; here each transition is pinned down once, by name.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from helpers import FailsOnce, batches, loss_of, make_model

import gradient_cache
from gradient_cache.engine.pipeline import PHASES_FROM, StepState, StepStateError

IDLE, CAPTURING, CACHED, STEPPING, INTERRUPTED = StepState
SMALL = 0.004  # MiB: several buckets, so the fused step steps more than one
DATA = batches(2, seed=3)


def _cache(model: torch.nn.Module, **options):
    return gradient_cache.create_gradient_cache(
        model, compression_ratio=1, bucket_size_mb=SMALL, **options
    )


def _states(manager) -> tuple[StepState, bool]:
    engine = manager.engine
    return engine.state, engine.step_pending


def test_a_step_goes_idle_capturing_cached_idle_and_is_pending_exactly_when_not_idle() -> None:
    model = make_model()
    manager = _cache(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _states(manager) == (IDLE, False)
    loss_of(model, *DATA[0]).backward()
    assert _states(manager) == (CAPTURING, True)
    manager.compress_and_free_gradients()
    assert _states(manager) == (CACHED, True)
    loss_of(model, *DATA[1]).backward()  # a second micro-batch: capturing again
    assert _states(manager) == (CAPTURING, True)
    manager.apply_gradients()
    assert _states(manager) == (IDLE, False)
    optimizer.step()


def test_a_fused_step_of_one_optimizer_of_two_leaves_the_step_stepping() -> None:
    model = make_model()
    manager = _cache(model)
    params = list(model.parameters())
    first = torch.optim.SGD(params[:2], lr=0.1)
    second = torch.optim.SGD(params[2:], lr=0.1)
    loss_of(model, *DATA[0]).backward()
    manager.step(first)
    assert _states(manager) == (STEPPING, True)  # counted, the second's gradients cached
    steps = manager.summary().steps
    manager.step(second)
    assert _states(manager) == (IDLE, False)
    assert manager.summary().steps == steps == 1  # one step, delivered by two restores


def test_a_backward_after_a_fused_step_raised_is_refused_naming_the_state_and_the_fix() -> None:
    model = make_model()
    manager = _cache(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    failure = FailsOnce(optimizer)
    loss_of(model, *DATA[0]).backward()
    failure.arm(1)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer, max_grad_norm=0.5)
    assert _states(manager) == (INTERRUPTED, True)
    refusal = r"while its step is interrupted: .* call step\(optimizer\) again"
    with pytest.raises(StepStateError, match=refusal):
        loss_of(model, *DATA[1]).backward()  # the retry would clip it with a stale factor
    # The refused gradient was not taken: it stays on its parameter, nothing is lost.
    assert any(p.grad is not None for p in model.parameters())
    manager.discard_gradients()
    optimizer.zero_grad()
    assert _states(manager) == (IDLE, False)


def test_every_phase_refuses_the_states_it_cannot_start_from_naming_the_state() -> None:
    manager = _cache(make_model())
    engine = manager.engine
    refused = [(p, s) for p, allowed in PHASES_FROM.items() for s in StepState if s not in allowed]
    assert refused  # the table forbids something
    for phase, state in refused:
        engine.state = state
        with pytest.raises(StepStateError, match=f"cannot {phase} while its step is {state.value}"):
            engine._enter(phase, IDLE)
        assert engine.state is state  # a refused phase changes nothing
    engine.state = IDLE


def test_only_the_pipeline_assigns_pipeline_attributes() -> None:
    """Each piece of the step's state has one owner: no other module of the package writes
    the pipeline's attributes (``pipeline.x = ...``, ``engine.x = ...``)."""
    package = pathlib.Path(gradient_cache.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if path.name == "pipeline.py" and path.parent.name == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _names_a_pipeline(target.value):
                    offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not offenders, offenders


def _names_a_pipeline(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in {"pipeline", "engine"}
    if isinstance(node, ast.Attribute):
        return node.attr in {"engine", "_pipeline", "pipeline"}
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Attribute) and node.func.attr == "_live"
    return False
