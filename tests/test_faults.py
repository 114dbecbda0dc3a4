"""Faults survived: after each, discard_gradients() leaves a manager that trains on exactly.

The batch that fails is skipped with the calls a user makes for a skipped step
(``optimizer.zero_grad()`` and ``discard_gradients()``); the run then ends where a run
that never saw that batch ends: plain PyTorch at ratio 1, the same cache at ratio 100.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TiedLM, assert_same_parameters, batches, loss_of

import gradient_cache
from gradient_cache import Ladder
from gradient_cache.engine.backend import CpuBackend
from gradient_cache.engine.capture import Capture

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
