"""The pipeline (engine/pipeline.py): its step life (the states, the phases that move them, the
refusals of a phase started from the wrong state), buckets launched during backward, and an
encode that fails losing no gradient.

`test_call_orders.py` drives the same states in random legal orders against a model of
them; here each transition is pinned down once, by name.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from helpers import FailsOnce, assert_same_parameters, batches, loss_of, make_model, train

import gradient_cache
from gradient_cache import Ladder
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
    made_before = loss_of(model, *DATA[1])  # its graph made before the step
    failure.arm(1)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer, max_grad_norm=0.5)
    assert _states(manager) == (INTERRUPTED, True)
    refusal = r"while its step is interrupted: .* call step\(optimizer\) again"
    with pytest.raises(StepStateError, match=refusal):
        loss_of(model, *DATA[1]).backward()  # the retry would clip it with a stale factor
    # Refused at the forward: nothing of it reached .grad or the cache.
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(StepStateError, match=refusal):
        made_before.backward()  # refused where its gradients would be captured
    del made_before
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


def test_buckets_follow_backward_order_and_launch_during_backward(monkeypatch) -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1, bucket_size_mb=1e-6)
    pipeline = manager.engine
    launched: list[str] = []
    grads_left: list[int] = []
    original = pipeline.capture._encode

    def spy(param, grad, loss_scale):
        launched.append(pipeline.records[param].name)
        grads_left.append(sum(p.grad is not None for p in model.parameters()))
        return original(param, grad, loss_scale)

    monkeypatch.setattr(pipeline.capture, "_encode", spy)
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).backward()
    assert launched.index("mlp.2.weight") < launched.index("mlp.0.weight")  # backward order
    assert all(left == 0 for left in grads_left)  # each freed as soon as it was ready


def fail_on(pipeline, name: str, monkeypatch) -> None:
    """Make the encode of parameter ``name`` raise an out-of-memory error, once."""
    original = pipeline.capture._encode
    state = {"armed": True}

    def encode(param, grad, loss_scale):
        if state["armed"] and pipeline.records[param].name == name:
            state["armed"] = False
            raise torch.OutOfMemoryError("injected: out of memory")
        return original(param, grad, loss_scale)

    monkeypatch.setattr(pipeline.capture, "_encode", encode)


@pytest.mark.parametrize("ratio", [1, 20])
def test_an_encode_failure_at_the_drain_loses_no_gradient(monkeypatch, ratio: int) -> None:
    """Gradients not yet encoded go back to the parameters, whole; the rest stay cached."""
    options = dict(compression_ratio=ratio, min_compress_numel=1, codec=Ladder(selection="exact"))
    plain, reference, failing = make_model(), make_model(), make_model()
    ref_manager = gradient_cache.create_gradient_cache(reference, **options)
    manager = gradient_cache.create_gradient_cache(failing, **options)
    tokens, targets = batches(1)[0]
    for model in (plain, reference):
        loss_of(model, tokens, targets).backward()
    ref_manager.apply_gradients()
    loss_of(failing, tokens, targets).backward()  # one bucket, waiting for the drain
    engine = manager.engine
    waiting = [engine.records[p].name for p in engine.assembler.params()]
    fail_on(engine, waiting[2], monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):
        manager.compress_and_free_gradients()
    given_back = {n for n, p in failing.named_parameters() if p.grad is not None}
    assert given_back == set(waiting[2:])  # the first two were cached
    manager.apply_gradients()
    for name, param in failing.named_parameters():
        expected = plain if name in given_back else reference  # whole, or as cached
        assert torch.equal(param.grad, expected.get_parameter(name).grad), name


def test_an_encode_failure_in_backward_leaves_a_usable_manager(monkeypatch) -> None:
    """Backward raises; the user skips the batch; training then matches plain PyTorch."""
    data = batches(4)
    plain = make_model()
    train(plain, [data[0], *data[2:]])
    cached = make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, compression_ratio=1, bucket_size_mb=0.004
    )
    optimizer = torch.optim.Adam(cached.parameters(), lr=1e-2)
    for i, (tokens, targets) in enumerate(data):
        if i == 1:
            fail_on(manager.engine, "mlp.0.weight", monkeypatch)
            with pytest.raises(torch.OutOfMemoryError):
                loss_of(cached, tokens, targets).backward()
            manager.discard_gradients()
            optimizer.zero_grad()
            continue
        loss_of(cached, tokens, targets).backward()
        manager.apply_gradients()
        optimizer.step()
        optimizer.zero_grad()
    assert_same_parameters(plain, cached)
