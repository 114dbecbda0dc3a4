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
from typing import Any

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
    ("a residual on another device (torch.load with a map_location)",
     edit_residual(lambda r: r.to("meta")),
     "The state holds tensors on meta; `state_dict()` saves CPU tensors: read the checkpoint "
     "with torch.load(path, map_location='cpu')"),
    ("a non-finite residual", edit_residual(with_infinity), "holds non-finite values"),
    ("a residual for an unknown parameter",
     lambda s: s["residuals"].update(ghost=torch.zeros(3)), "names 'ghost'"),
    ("a generator state that is not one",
     edit_random_state(lambda r: r.update({first(r): torch.zeros(3, dtype=torch.uint8)})),
     "expected a dither's draw counter"),
    ("an unknown generator", edit_random_state(lambda r: r.update(ghost=torch.zeros(1))),
     "has a generator 'ghost'"),
    ("a payload with its codes cut short", edit_payload("packed", lambda v: v[:-1]),
     "payload['packed'] is a cpu torch.uint8 tensor of shape (67,)"),
    ("a payload that counts fewer values", edit_payload("count", lambda c: c - 1),
     "payload['count'] is 0; expected 1"),
    ("a payload index out of range", edit_payload("indices", lambda i: i + 10**6),
     "expected unique indices below"),
    ("a payload of another dtype", edit_payload("dtype", lambda d: "float16"),
     "payload['dtype'] is torch.float16"),
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


def trained_as_far(options: dict = OPTIONS):
    """A manager that trained as far as the saving one and finished its step: nothing
    pending, so a load is allowed."""
    model, manager, optimizer = build_checkpointed(options)
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


# Payloads as another codec's route makes them, or not as the encoder ever makes them:
# without these checks each loads (then trains wrongly or fails later with a bare error),
# or crashes the process inside a compiled decode. (what is wrong, the cache's options, how
# to damage a state, an excerpt of the message)
Q4 = dict(codec="q4")
INT8 = dict(codec="int8")
TOPK = dict(compression_ratio=100, codec="topk")  # error feedback: pending residuals
LOSSLESS = dict(compression_ratio=1)


def edit_largest(field: str, change: Callable[[Any], Any]) -> Callable[[dict], None]:
    """Change ``field`` of the payload of the parameter with the most entries."""

    def damage(state: dict) -> None:
        items = [item for bucket in state["buckets"] for item in bucket]
        payload = max(items, key=lambda item: item["payload"]["numel"])["payload"]
        payload[field] = change(payload[field])

    return damage


def negative_scale(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` with its last block scale (its last 4 bytes, fp32) negated."""
    packed = packed.clone()
    packed[-4:].view(torch.float32).neg_().sub_(1)
    return packed


def duplicate_index(indices: torch.Tensor) -> torch.Tensor:
    indices = indices.clone()
    indices[1] = indices[0]
    return indices


def drop_pending_residual(state: dict) -> None:
    state["pending_residuals"].pop(state["buckets"][0][0]["name"])


def dense_instead(state: dict) -> None:
    item = state["buckets"][0][0]
    item["payload"] = {"kind": "dense", "tensor": torch.zeros(item["payload"]["numel"])}


def fp32_earlier(state: dict) -> None:
    """An earlier micro-batch's part beside an fp32 gradient: only a compute dtype's has one."""
    payload = state["buckets"][0][0]["payload"]
    payload["earlier"] = payload["tensor"].clone()


def with_extra_bytes(count: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda packed: torch.cat([packed, torch.zeros(count, dtype=torch.uint8)])


CODEC_CASES = [
    ("int8 codes made 2-D", INT8, edit_payload("packed", lambda p: p.view(1, -1)),
     "payload['packed'] is a cpu torch.uint8 tensor of shape (1,"),
    ("int8 codes with 4 bytes more", INT8, edit_payload("packed", with_extra_bytes(4)),
     "expected a contiguous 1-D CPU torch.uint8 tensor of"),
    ("an int8 block scale below zero", INT8, edit_payload("packed", negative_scale),
     "block scales >= 0"),
    ("q4 codes read as 3 bits", Q4, edit_payload("bits", lambda b: 3), "payload['bits'] is 3"),
    ("q4 codes read as 2 bits", Q4, edit_payload("bits", lambda b: 2), "payload['bits'] is 2"),
    ("q4 codes read unrotated", Q4, edit_payload("rotated", lambda r: not r),
     "payload['rotated'] is False"),
    ("q4 codes with 64 bytes more", Q4, edit_payload("packed", with_extra_bytes(64)),
     "payload['packed'] is a cpu torch.uint8 tensor"),
    ("a q4 block scale below zero", Q4, edit_payload("packed", negative_scale),
     "block scales >= 0"),
    ("a top-k index twice", TOPK, edit_largest("indices", duplicate_index),
     "expected unique indices below"),
    ("a dense payload on a top-k route", TOPK, dense_instead,
     "payload['kind'] is 'dense'; this manager's codec 'topk' makes 'sparse'"),
    ("a cached gradient's pending residual dropped", TOPK, drop_pending_residual,
     "state['pending_residuals'] has no entry for"),
    ("an fp32 gradient saved as bf16", LOSSLESS,
     edit_payload("tensor", lambda t: t.bfloat16()), "payload['tensor'] is a cpu torch.bfloat16"),
    ("a dense gradient made 2-D", LOSSLESS, edit_payload("tensor", lambda t: t.view(-1, 1)),
     "payload['tensor'] is a cpu torch.float32 tensor of shape"),
    ("an fp32 earlier part", LOSSLESS, fp32_earlier,
     "payload['earlier'] is a cpu torch.float32 tensor"),
]  # fmt: skip


@pytest.fixture(scope="module")
def saved_by() -> Callable[[dict], dict]:
    """The state each options' cache saves after `TRAINED` micro-batches (one each)."""
    states: dict[str, dict] = {}

    def saved(options: dict) -> dict:
        key = repr(sorted(options.items()))
        if key not in states:
            model, manager, optimizer = build_checkpointed(options)
            run_checkpointed(model, manager, optimizer, range(TRAINED))
            states[key] = save_and_load(model, manager, optimizer)["cache"]
        return copy.deepcopy(states[key])

    return saved


@pytest.mark.parametrize(
    ("wrong", "options", "damage", "excerpt"), CODEC_CASES, ids=[c[0] for c in CODEC_CASES]
)
def test_a_payload_unlike_its_codecs_is_refused_and_changes_nothing(
    saved_by, wrong, options, damage, excerpt
) -> None:
    """Refused by name before anything changes: the same manager then resumes the intact
    state and trains bit for bit as one that only ever loaded that."""
    state = saved_by(options)
    damage(state)
    model, manager, optimizer = trained_as_far(options)
    with pytest.raises(ValueError, match=re.escape(excerpt)):
        manager.load_state_dict(state)
    manager.load_state_dict(saved_by(options))
    untouched_model, untouched, untouched_optimizer = trained_as_far(options)
    untouched.load_state_dict(saved_by(options))
    more = range(TRAINED, len(CHECKPOINT_DATA))
    run_checkpointed(model, manager, optimizer, more)
    run_checkpointed(untouched_model, untouched, untouched_optimizer, more)
    assert_same_parameters(model, untouched_model)
