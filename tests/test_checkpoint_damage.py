"""A damaged or edited cache state is refused, naming the key, before anything changes.

Each case damages one part of a real checkpoint (saved mid-accumulation, so it holds
residuals, random states and cached payloads) and loads it into a manager that has trained
as far as the saving one: the load must raise a ValueError whose message names what is
wrong, and the manager must then train exactly like one that never saw the call.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
from helpers import (
    CHECKPOINT_DATA,
    assert_same_parameters,
    build_checkpointed,
    run_checkpointed,
    save_and_load,
)

# Top-k with error feedback, an fp32 residual and int8 values: residuals, a dither's draw
# counter and quantized sparse payloads.
OPTIONS = dict(compression_ratio=100, codec="topk", residual_dtype="float32", value_dtype="int8")
TRAINED = 3  # micro-batches before the save: a step, then one cached


def first(entries: dict) -> str:
    return sorted(entries)[0]


def edit_residual(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def damage(state: dict) -> None:
        name = first(state["residuals"])
        state["residuals"][name] = change(state["residuals"][name])

    return damage


def edit_payload(field: str, change: Callable[[torch.Tensor], torch.Tensor]):
    def damage(state: dict) -> None:
        payload = state["buckets"][0][0]["payload"]
        payload[field] = change(payload[field])

    return damage


def edit_random_state(change: Callable[[dict], None]) -> Callable[[dict], None]:
    def damage(state: dict) -> None:
        change(state["random_state"])

    return damage


def with_infinity(residual: torch.Tensor) -> torch.Tensor:
    return residual.clone().index_fill_(0, torch.tensor([0]), float("inf"))


# (what is wrong, how to damage a state, an excerpt of the message)
CASES = [
    ("a missing key", lambda s: s.pop("residuals"), "missing keys ['residuals']"),
    ("an extra key", lambda s: s.update(notes="x"), "unknown keys ['notes']"),
    ("a format version from the future", lambda s: s.update(format_version=99),
     "saved by a newer gradient-cache"),
    ("another codec", lambda s: s["recipe"].update(codec="q4"),
     "codec: checkpoint 'q4', this manager 'topk'"),
    ("a negative step count", lambda s: s.update(steps=-1), "state['steps'] is -1"),
    ("shards that are not a pair", lambda s: s.update(shards=[0]), "state['shards'] is [0]"),
    ("a residual of the wrong shape", edit_residual(lambda r: r[:-1]),
     "expected a CPU torch.float32 tensor of shape"),
    ("a residual of the wrong dtype", edit_residual(lambda r: r.double()),
     "a cpu torch.float64 tensor"),
    ("a residual on another device", edit_residual(lambda r: r.to("meta")),
     "a meta torch.float32 tensor"),
    ("a non-finite residual", edit_residual(with_infinity), "holds non-finite values"),
    ("a residual for an unknown parameter",
     lambda s: s["residuals"].update(ghost=torch.zeros(3)), "names 'ghost'"),
    ("a generator state that is not one",
     edit_random_state(lambda r: r.update({first(r): torch.zeros(3, dtype=torch.uint8)})),
     "expected a dither's draw counter"),
    ("an unknown generator", edit_random_state(lambda r: r.update(ghost=torch.zeros(1))),
     "has a generator 'ghost'"),
    ("a payload with its codes cut short", edit_payload("packed", lambda v: v[:-1]),
     "the saved payload cannot be read"),
    ("a payload that counts fewer values", edit_payload("count", lambda c: c - 1),
     "the payload holds"),
    ("a payload index out of range", edit_payload("indices", lambda i: i + 10**6),
     "every index below"),
    ("a payload of another dtype", edit_payload("dtype", lambda d: "float16"),
     "torch.float16 values"),
    ("a payload that is not one", lambda s: s["buckets"][0][0].update(payload={"kind": "?"}),
     "the saved payload cannot be read"),
    ("a pending norm below zero",
     lambda s: s.update(pending_norms={first(s["residuals"]): torch.tensor(-float("inf"))}),
     "expected a norm >= 0"),
]  # fmt: skip


@pytest.fixture(scope="module")
def saved() -> dict:
    model, manager, optimizer = build_checkpointed(OPTIONS)
    run_checkpointed(model, manager, optimizer, range(TRAINED))
    state = save_and_load(model, manager, optimizer)["cache"]
    assert state["residuals"] and state["random_state"] and state["buckets"]
    return state


def trained_as_far():
    """A manager that trained as far as the saving one and finished its step: nothing
    pending, so a load is allowed."""
    model, manager, optimizer = build_checkpointed(OPTIONS)
    run_checkpointed(model, manager, optimizer, range(TRAINED + 1))
    return model, manager, optimizer


@pytest.mark.parametrize(("wrong", "damage", "excerpt"), CASES, ids=[c[0] for c in CASES])
def test_a_damaged_state_is_refused_and_changes_nothing(saved, wrong, damage, excerpt) -> None:
    state = copy.deepcopy(saved)
    damage(state)
    model, manager, optimizer = trained_as_far()
    with pytest.raises(ValueError, match=re.escape(excerpt)):
        manager.load_state_dict(state)
    untouched_model, untouched, untouched_optimizer = trained_as_far()
    more = range(TRAINED + 1, len(CHECKPOINT_DATA))
    run_checkpointed(model, manager, optimizer, more)
    run_checkpointed(untouched_model, untouched, untouched_optimizer, more)
    assert_same_parameters(model, untouched_model)
    after, expected = manager.state_dict(), untouched.state_dict()
    assert after["steps"] == expected["steps"]
    for name, residual in expected["residuals"].items():
        assert torch.equal(after["residuals"][name], residual), name


def test_the_intact_state_loads(saved) -> None:
    """The cases damage a state that loads: the refusals come from the damage alone."""
    _, manager, _ = trained_as_far()
    manager.load_state_dict(copy.deepcopy(saved))
