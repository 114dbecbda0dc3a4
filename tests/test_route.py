"""Routes (engine/route.py): planned once per manager, and every step's derived from that plan."""

from __future__ import annotations

import pytest
import torch
from helpers import batches, loss_of, make_model

import gradient_cache
from gradient_cache.codecs import Codecs
from gradient_cache.engine import route as route_module
from gradient_cache.engine.config import EngineConfig
from gradient_cache.engine.route import RoutePlan, plan_routes


def test_routes_are_planned_once_per_manager_through_warm_up_and_a_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The codec choice runs once per manager: not again where the warm-up ends, nor when a
    checkpoint's state is checked and loaded (the saved step count's routes are derived)."""
    calls = []
    original = route_module.plan_routes

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(route_module, "plan_routes", counted)
    options = dict(compression_ratio=100, warmup_steps=1, min_compress_numel=1)
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert len(calls) == 1
    for tokens, targets in batches(2):  # the first step warms up, the second is compressed
        loss_of(model, tokens, targets).backward()
        manager.step(optimizer)
    loss_of(model, *batches(1, seed=5)[0]).backward()
    state = manager.state_dict()  # mid-step: the cached payloads are checked against routes
    manager.remove_hooks()
    for param in model.parameters():
        param.grad = None
    resumed = gradient_cache.create_gradient_cache(model, **options)
    resumed.load_state_dict(state)
    assert len(calls) == 2  # one for each manager
    assert any(route.compressed for route in resumed.engine.routes.values())


def test_a_warm_up_route_is_lossless_with_dense_room_and_the_steady_one_follows_it() -> None:
    config = EngineConfig(warmup_steps=2, min_compress_numel=1)
    codecs = Codecs.for_options(config, ratio=3, selection="exact")
    shapes = {"weight": ((64, 32), torch.float32), "bias": ((1,), torch.float32)}
    plan = RoutePlan(shapes, codecs=codecs, config=config, selection="exact")
    warm, steady = plan.at(1), plan.at(2)
    assert steady == plan_routes(shapes, codecs=codecs, config=config, steps=2)
    assert warm == plan_routes(shapes, codecs=codecs, config=config, steps=0)
    assert warm["weight"].codec is codecs.lossless and warm["weight"].dense_room
    assert steady["weight"].codec.lossy and not steady["weight"].dense_room
    assert steady["weight"].shape == (64, 32) and steady["weight"].numel == 64 * 32
    assert warm["weight"].slot.regions[0] == 64 * 32 * 4  # room for the dense warm-up payload
