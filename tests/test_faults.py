"""Faults survived: after each, discard_gradients() leaves a manager that trains on exactly.

The batch that fails is skipped with the calls a user makes for a skipped step
(``optimizer.zero_grad()`` and ``discard_gradients()``); the run then ends where a run
that never saw that batch ends: plain PyTorch at ratio 1, the same cache at ratio 100.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import TiedLM, assert_same_parameters, batches, interrupt_at, loss_of, make_model
from test_optimizer_state import OPTIONS as STATE_ON_THE_HOST
from test_optimizer_state import assert_same_state

import gradient_cache
from gradient_cache import Ladder
from gradient_cache.engine import fused_step, sharding
from gradient_cache.engine.backend import CpuBackend
from gradient_cache.engine.capture import Capture
from gradient_cache.engine.fused_step import Journeys
from gradient_cache.engine.pipeline import Pipeline

SMALL = 0.004  # MiB: several buckets per backward, so some launch before the fault


class Faulty(TiedLM):
    """TiedLM that raises ``error`` in forward or partway through backward, when armed."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.fault: tuple[str, BaseException] | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.fault is None:
            return super().forward(tokens)
        where, error = self.fault
        self.fault = None
        if where == "forward":
            raise error
        hidden = self.embed(tokens)

        def fail(grad: torch.Tensor) -> None:
            raise error  # the MLP's gradients are offloaded by now, the embedding's not

        hidden.register_hook(fail)
        hidden = self.norm(hidden + self.mlp(hidden))
        return hidden @ self.embed.weight.t()


def fail_in_encode(monkeypatch: pytest.MonkeyPatch, manager) -> None:
    """The next encode of ``mlp.0.weight`` raises an out-of-memory error, once."""
    capture = manager.engine.capture
    original = Capture._encode

    def encode(self, param, grad, loss_scale):
        if self.pipeline.records[param].name == "mlp.0.weight":
            monkeypatch.setattr(capture, "_encode", original.__get__(capture))
            raise torch.OutOfMemoryError("injected: out of memory while encoding")
        return original(self, param, grad, loss_scale)

    monkeypatch.setattr(capture, "_encode", encode.__get__(capture))


FAULTS = {
    "exception in forward": ("forward", RuntimeError("injected in forward")),
    "exception mid-backward": ("backward", RuntimeError("injected in backward")),
    "KeyboardInterrupt mid-backward": ("backward", KeyboardInterrupt()),
    "out of memory while encoding": ("encode", torch.OutOfMemoryError()),
}


def train(options: dict | None, *, fault: str | None, monkeypatch) -> torch.nn.Module:
    """Four Adam steps; with ``fault``, batch 2 fails and is skipped (it is absent without)."""
    model = Faulty()
    manager = None if options is None else gradient_cache.create_gradient_cache(model, **options)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for index, (tokens, targets) in enumerate(batches(5)):
        if index == 2:
            if fault is None:
                continue
            where, error = FAULTS[fault]
            if where == "encode":
                fail_in_encode(monkeypatch, manager)
            else:
                model.fault = (where, error)
            with pytest.raises(type(error)):
                loss_of(model, tokens, targets).backward()
                manager.compress_and_free_gradients()
            if where != "forward":  # it struck with some buckets already offloaded
                assert manager.engine.store
            optimizer.zero_grad()
            manager.discard_gradients()
            continue
        loss_of(model, tokens, targets).backward()
        if manager is not None:
            manager.apply_gradients()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("ratio", [1, 100])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_after_a_fault_training_goes_on_as_if_the_batch_was_skipped(
    fault: str, ratio: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = dict(compression_ratio=ratio, min_compress_numel=1, bucket_size_mb=SMALL)
    faulted = train(options, fault=fault, monkeypatch=monkeypatch)
    reference = train(None if ratio == 1 else options, fault=None, monkeypatch=monkeypatch)
    assert_same_parameters(reference, faulted)


class RestoreFailsOnce(CpuBackend):
    """The CPU backend; once armed, its second restore raises (a bucket already restored)."""

    def __init__(self, config: gradient_cache.EngineConfig) -> None:
        keep_previous = config.residual_options.keep_previous_residual
        super().__init__(torch.device("cpu"), keep_previous_residual=keep_previous)
        self.restores_left: int | None = None

    def start_restore(self, items, *, clip_factor):
        if self.restores_left is not None:
            self.restores_left -= 1
            if self.restores_left < 0:
                self.restores_left = None
                raise torch.OutOfMemoryError("injected: out of memory while restoring")
        return super().start_restore(items, clip_factor=clip_factor)


@pytest.mark.parametrize("ratio", [1, 100])
def test_an_apply_that_failed_partway_is_finished_by_the_next_counted_once(ratio: int) -> None:
    """apply_gradients() raises after one bucket went back; calling it again finishes the
    step, which is counted once: the warm-up (2 steps) ends when it would have."""
    options = dict(
        compression_ratio=ratio,
        min_compress_numel=1,
        codec=Ladder(selection="exact"),
        warmup_steps=2,
        bucket_size_mb=SMALL,
    )
    reference, failing = TiedLM(), TiedLM()
    failing.load_state_dict(reference.state_dict())
    backends: list[RestoreFailsOnce] = []

    def factory(params, config, *, plan):
        backends.append(RestoreFailsOnce(config))
        return backends[-1]

    managers = [
        gradient_cache.create_gradient_cache(reference, **options),
        gradient_cache.create_gradient_cache(failing, **options, backend_factory=factory),
    ]
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (reference, failing)]
    for step, (tokens, targets) in enumerate(batches(4)):
        for model, manager, optimizer in zip(
            (reference, failing), managers, optimizers, strict=True
        ):
            loss_of(model, tokens, targets).backward()
            if manager is managers[1] and step == 0:
                backends[0].restores_left = 1
                with pytest.raises(torch.OutOfMemoryError):
                    manager.apply_gradients()
                assert manager.engine.store  # the rest is still cached
            manager.apply_gradients()
            optimizer.step()
            optimizer.zero_grad()
        assert [m.get_compression_summary()["steps"] for m in managers] == [step + 1] * 2
    assert_same_parameters(reference, failing)


class Interrupt:
    """Once armed, the ``nth`` call of ``owner.name`` that ``when(*args)`` accepts (``nth``
    0: the last of a step, as many as it counted unarmed) raises KeyboardInterrupt before it
    runs: a signal arriving between two of the library's calls (no error can come there)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        owner: object,
        name: str,
        *,
        nth: int = 1,
        when: Callable[..., bool] = lambda *args: True,
    ) -> None:
        self.left: int | None = None
        self.calls = 0  # accepted calls unarmed
        original = getattr(owner, name)

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            if self.left is None:
                self.calls += when(*args)
            elif when(*args):
                self.left -= 1
                if not self.left:
                    self.left = None
                    raise KeyboardInterrupt
            return original(*args, **kwargs)

        self.nth = nth
        monkeypatch.setattr(owner, name, interrupted)

    def arm(self, calls_a_step: int) -> None:
        self.left = self.nth or calls_a_step


# Where the interrupt strikes in the fused step: (the cache's options, the call it comes at).
WINDOWS: dict[str, tuple[dict, tuple[object, str, dict]]] = {
    # The first bucket stepped, its step not yet counted: the retry stepped it again.
    "first bucket's step, before its deliver": (
        dict(compression_ratio=1, bucket_size_mb=SMALL),
        (Pipeline, "deliver", dict(when=lambda pipeline, params: bool(params))),
    ),
    # A later bucket stepped, its payloads still cached: the retry stepped it again.
    "a bucket's step, before its payloads leave": (
        dict(compression_ratio=1, bucket_size_mb=SMALL),
        (Pipeline, "_spend", dict(nth=2)),
    ),
    # Its payloads spent, its state not yet sent home: it went back as before its step.
    "a bucket's spend, before its state goes home": (
        STATE_ON_THE_HOST,
        (Journeys, "send_back", dict(nth=2)),
    ),
    # The held gradients (the excluded LayerNorm's, stepped last) stepped, their state
    # not yet sent home: it went back as before their step.
    "the held gradients' step, before their state goes home": (
        STATE_ON_THE_HOST,
        (Journeys, "send_back", dict(nth=0)),
    ),
    # One gradient of a bucket assigned, the next not: the first stayed for the retry.
    "a bucket's gradients half assigned": (
        dict(compression_ratio=1, bucket_size_mb=SMALL),
        (sharding, "as_grad_of", dict(nth=2)),
    ),
}


@pytest.mark.parametrize("window", list(WINDOWS))
def test_an_interrupted_fused_step_retried_gives_plains_result(
    window: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt inside step(optimizer) at a point only a signal reaches, then the
    docs' recovery (step(optimizer) again): AdamW's weights and state are plain's, bit for
    bit, and the step is counted once (probe N: a bucket stepped twice, 0.0157 off plain)."""
    options, (owner, name, choice) = WINDOWS[window]
    interrupt = Interrupt(monkeypatch, owner, name, **choice)
    armed = lambda: contextlib.nullcontext(interrupt.arm(interrupt.calls))  # noqa: E731
    manager = retried_as_plain(options, armed)
    assert interrupt.left is None  # it struck
    assert manager.get_compression_summary()["steps"] == 3


@pytest.mark.parametrize(
    "options",
    [dict(compression_ratio=1, bucket_size_mb=SMALL), STATE_ON_THE_HOST],
    ids=["state-on-device", "state-on-the-host"],
)
def test_a_fused_step_interrupted_clearing_a_buckets_gradients_retried_is_plain(options) -> None:
    """A signal where a bucket's step returned and its gradients leave ``.grad`` one by one
    (the loop's jump back, where Python checks for signals): those not yet cleared stayed,
    and the retry took them for device gradients and stepped them again (probe B: 0.019 off
    plain, silently). The way out clears every bucket's; the retry gives plain's bits."""
    retried_as_plain(
        options, lambda: interrupt_at(fused_step._step_with, "param.grad = None", nth=2)
    )


def retried_as_plain(
    options: dict[str, Any], armed: Callable[[], contextlib.AbstractContextManager[object]]
) -> gradient_cache.GradientCacheHookManager:
    """Three AdamW steps of plain PyTorch and of the cache made with ``options``, the second
    fused step interrupted within ``armed()``, then called again: the weights and state
    equal, bit for bit. Returns the manager."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(cached, **options)
    for index, (tokens, targets) in enumerate(batches(3)):
        loss_of(plain, tokens, targets).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        loss_of(cached, tokens, targets).backward()
        if index == 1:
            with armed(), pytest.raises(KeyboardInterrupt):
                manager.step(cached_opt)
        manager.step(cached_opt)
        cached_opt.zero_grad()
    assert_same_state(plain_opt, cached_opt, plain, cached)
    return manager
