"""Error-feedback residual stores (engine/residuals.py), both kinds through one interface: a
pending step's residual beside the current one, promoted when the step is delivered, dropped
when it is discarded, and a replaced one brought back when a GradScaler skipped its step."""

from __future__ import annotations

import pytest
import torch

from gradient_cache.engine.pool import HostPool, SlotSpec
from gradient_cache.engine.residuals import DeviceResiduals, HostSlotResiduals, ResidualStore

NUMEL = 8


def _store(kind: str, params: list[torch.nn.Parameter], *, keep_previous: bool) -> ResidualStore:
    if kind == "device":
        return DeviceResiduals(torch.device("cpu"), keep_previous=keep_previous)
    spec = SlotSpec((4,), (NUMEL, torch.float32), spare_residual=keep_previous)
    pool = HostPool(dict.fromkeys(params, spec), allocate_pinned=None)
    return HostSlotResiduals(lambda: pool, lambda t: t, keep_previous=keep_previous)


def _full(value: float) -> torch.Tensor:
    return torch.full((NUMEL,), value)


def _value(residual: torch.Tensor | None) -> float | None:
    return None if residual is None else float(residual[0])


KINDS = ["device", "host slots"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_pending_residual_is_read_first_and_a_discard_leaves_the_current_one(kind: str) -> None:
    param = torch.nn.Parameter(torch.zeros(NUMEL))
    store = _store(kind, [param], keep_previous=True)
    store.write(param, _full(1.0), non_blocking=False)
    store.promote([param], keep_replaced=False)  # step 1 delivered: current is 1
    store.write(param, _full(2.0), non_blocking=False)  # step 2 pending
    assert _value(store.read(param)) == 2.0  # the next encode starts from the newest
    assert _value(store.current()[param]) == 1.0
    assert _value(store.pending()[param]) == 2.0
    store.drop_pending()  # step 2 discarded
    assert _value(store.read(param)) == 1.0 and not store.pending()


@pytest.mark.parametrize("kind", KINDS)
def test_a_replaced_residual_comes_back_when_its_step_was_skipped(kind: str) -> None:
    param = torch.nn.Parameter(torch.zeros(NUMEL))
    store = _store(kind, [param], keep_previous=True)
    store.write(param, _full(1.0), non_blocking=False)
    store.promote([param], keep_replaced=False)
    store.write(param, _full(2.0), non_blocking=False)
    store.promote([param], keep_replaced=True)  # step 2 delivered, the scaler not yet heard
    assert _value(store.current()[param]) == 2.0
    store.bring_back_replaced()  # the scaler skipped step 2
    assert _value(store.current()[param]) == 1.0
    store.write(param, _full(3.0), non_blocking=False)
    store.promote([param], keep_replaced=True)
    store.forget_replaced()  # step 3 stands
    store.bring_back_replaced()  # nothing kept: a no-op
    assert _value(store.current()[param]) == 3.0


def test_a_first_residual_brought_back_leaves_none() -> None:
    """A skipped first step had no residual before it: none is current afterwards."""
    param = torch.nn.Parameter(torch.zeros(NUMEL))
    store = _store("device", [param], keep_previous=True)
    store.write(param, _full(1.0), non_blocking=False)
    store.promote([param], keep_replaced=True)
    store.bring_back_replaced()
    assert store.read(param) is None and param not in store.current()


@pytest.mark.parametrize("kind", KINDS)
def test_without_keep_previous_a_write_is_current_at_once(kind: str) -> None:
    param = torch.nn.Parameter(torch.zeros(NUMEL))
    store = _store(kind, [param], keep_previous=False)
    store.write(param, _full(5.0), non_blocking=False)
    assert not store.pending() and _value(store.current()[param]) == 5.0
    store.drop_pending()  # a discard cannot undo it: nothing was kept beside it
    assert _value(store.read(param)) == 5.0


@pytest.mark.parametrize("kind", KINDS)
def test_load_takes_current_and_pending_and_counts_their_bytes(kind: str) -> None:
    first, second = torch.nn.Parameter(torch.zeros(NUMEL)), torch.nn.Parameter(torch.zeros(NUMEL))
    store = _store(kind, [first, second], keep_previous=True)
    store.load({first: _full(1.0), second: _full(2.0)}, {second: _full(4.0)})
    assert _value(store.read(first)) == 1.0 and _value(store.read(second)) == 4.0
    assert _value(store.current()[second]) == 2.0
    assert store.nbytes() == 3 * NUMEL * 4  # two current, one pending
