"""The integrations' fused step (`integrations.routing`): under `@gradient_cache.optimize`,
``optimizer.step()`` restores and steps a bucket at a time and ``clip_grad_norm_`` is
answered from the cache, bit for bit with the same loop undecorated."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import assert_same_parameters, batches, loss_of, make_model
from torch import nn

import gradient_cache

LOSSLESS = dict(compression_ratio=1, bucket_size_mb=0.004)  # several buckets per backward
Loop = Callable[..., object]


class WatchedAdamW(torch.optim.AdamW):
    """AdamW that records the most gradient bytes present in ``.grad`` at any step it takes
    (a bucket's, under the fused step: its hooks would fire once per call, not per bucket)."""

    most = 0

    def step(self, closure=None):  # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        present = sum(p.grad.numel() * 4 for p in params if p.grad is not None)
        self.most = max(self.most, present)
        return super().step(closure)


# AdamW's own step hooked, as once any plain AdamW exists in the process: super().step() then
# fires the step hooks (the routing's pre-hook included) again inside the call. The tests
# here see that whatever ran before them.
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def clipped_loop(model: nn.Module, *, micro_batches: int = 2) -> dict[str, object]:
    """Accumulation, clip_grad_norm_ after the last micro-batch, the step; what it saw."""
    optimizer = WatchedAdamW(model.parameters(), lr=1e-2)
    norms, emptied_after_clip, after_step = [], [], []
    for tokens, targets in batches(5):
        for part in range(micro_batches):
            rows = slice(part * 4 // micro_batches, (part + 1) * 4 // micro_batches)
            (loss_of(model, tokens[rows], targets[rows]) / micro_batches).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        emptied_after_clip.append([p.grad is None for p in model.parameters()])
        optimizer.step()
        after_step.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        optimizer.zero_grad()
    return {
        "norms": norms,
        "emptied": emptied_after_clip,
        "most": optimizer.most,
        "after": after_step,
    }


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize(
    "options",
    [{}, {"exclude_layers": ["norm"]}, {"offload_optimizer_state": True}],
    ids=["all-cached", "excluded-layers", "state-on-host"],
)
def test_the_decorated_step_is_the_fused_step_with_plain_bits(options: dict) -> None:
    """The clip answered from the cache (same norm, nothing restored), the step a bucket at
    a time (the excluded layers' device gradients stepped once), plain's weights."""
    plain, cached = make_model(), make_model()
    expected = clipped_loop(plain)
    got = gradient_cache.optimize(**LOSSLESS, **options)(clipped_loop)(cached)
    assert_same_parameters(plain, cached)
    for want, have in zip(expected["norms"], got["norms"], strict=True):
        assert torch.equal(want, have) and want > 0.05  # every step clipped
    excluded = options.get("exclude_layers", ["-"])[0]
    names = [name for name, _ in cached.named_parameters()]
    for emptied in got["emptied"]:  # the clip restored nothing
        assert emptied == [excluded not in name for name in names]
    # After the step, the device gradients (excluded layers) are in .grad, clipped once, as
    # plain PyTorch leaves them; the cached ones are freed.
    for want, have in zip(expected["after"], got["after"], strict=True):
        for name, plain_grad, grad in zip(names, want, have, strict=True):
            assert grad is None if excluded not in name else torch.equal(grad, plain_grad)
    assert expected["most"] == gradient_bytes(plain)
    biggest = max(p.numel() * 4 for p in cached.parameters())
    assert got["most"] <= 2 * biggest + 4 * 4096  # a bucket (or the largest gradient) or so


def test_without_the_fused_step_the_gradients_are_restored_before_the_step() -> None:
    plain, cached = make_model(), make_model()
    clipped_loop(plain)
    got = gradient_cache.optimize(**LOSSLESS, fused_step=False)(clipped_loop)(cached)
    assert_same_parameters(plain, cached)
    assert got["most"] == gradient_bytes(cached)
    assert not any(any(emptied) for emptied in got["emptied"])


def test_a_backward_after_the_clip_adds_to_the_clipped_gradients() -> None:
    """Plain PyTorch clips in place; the cache defers the clip to the restore, so a later
    backward must find the clipped gradients (restored first), not the unclipped ones."""

    def loop(model: nn.Module) -> list[torch.Tensor]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        norms = []
        for tokens, targets in batches(3):
            loss_of(model, tokens[:2], targets[:2]).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            loss_of(model, tokens[2:], targets[2:]).backward()
            optimizer.step()
            optimizer.zero_grad()
        return norms

    plain, cached = make_model(), make_model()
    expected = loop(plain)
    decorated = gradient_cache.optimize(**LOSSLESS)(loop)
    got = decorated(cached)
    assert_same_parameters(plain, cached)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert decorated.last_summaries[0]["steps"] == 3  # one a step, not one a backward


def test_gradient_readers_after_the_clip_see_clipped_gradients() -> None:
    """clip_grad_value_ reads every gradient: it restores them, clipped by the deferred
    factor, as plain PyTorch's in-place clip left them."""

    def loop(model: nn.Module) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for tokens, targets in batches(3):
            loss_of(model, tokens, targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.002)
            optimizer.step()
            optimizer.zero_grad()

    plain, cached = make_model(), make_model()
    loop(plain)
    gradient_cache.optimize(**LOSSLESS)(loop)(cached)
    assert_same_parameters(plain, cached)


def test_one_optimizer_over_two_models_steps_each_gradient_once() -> None:
    """Two roots (two managers) and one optimizer: each manager's fused step steps its own
    buckets, and the device gradients (an excluded layer) only once."""

    def loop(encoder: nn.Module, head: nn.Module) -> None:
        params = [*encoder.parameters(), *head.parameters()]
        optimizer = torch.optim.Adam(params, lr=1e-2)
        for tokens, targets in batches(4):
            logits = head(encoder(tokens))
            nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            optimizer.step()  # no clip: one over two models' gradients restores them all
            optimizer.zero_grad()

    def models() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(3)
        return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32)), nn.Linear(32, 64)

    plain, cached = models(), models()
    loop(*plain)
    decorated = gradient_cache.optimize(**LOSSLESS, exclude_layers=["1.bias"])(loop)
    decorated(*cached)
    for a, b in zip(plain, cached, strict=True):
        assert_same_parameters(a, b)
    assert len(decorated.last_summaries) == 2


class FailsOnce(torch.optim.AdamW):
    """AdamW whose first step with a gradient raises before it changes anything, as an
    allocation failure does. Its super().step() is AdamW's hooked step: the integrations'
    hooks must not fire (again) from inside a bucket's step."""

    failures = 0

    def step(self, closure=None):  # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        if not self.failures and any(p.grad is not None for p in params):
            self.failures += 1
            raise torch.OutOfMemoryError("injected")
        return super().step(closure)


def test_a_step_that_raises_is_finished_by_calling_step_again() -> None:
    """An error inside the fused step (in a bucket's step) leaves the rest cached; the
    user's retry of optimizer.step() finishes it with plain's result."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # AdamW's step is now hooked

    def loop(model: nn.Module) -> int:
        optimizer = FailsOnce(model.parameters(), lr=1e-2)
        for tokens, targets in batches(3):
            loss_of(model, tokens, targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            try:
                optimizer.step()
            except torch.OutOfMemoryError:
                optimizer.step()
            optimizer.zero_grad()
        return optimizer.failures

    plain, cached = make_model(), make_model()
    assert loop(plain) == 1
    assert gradient_cache.optimize(**LOSSLESS)(loop)(cached) == 1
    assert_same_parameters(plain, cached)


def test_the_optimizers_step_hooks_fire_once_per_step() -> None:
    """The buckets are stepped without the optimizer's hooks, which fire once around the
    user's optimizer.step(): a post-hook's weight average is plain's."""

    def loop(model: nn.Module) -> tuple[int, list[torch.Tensor]]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        average = [p.detach().clone() for p in model.parameters()]
        calls = []

        def ema(*_: object) -> None:
            calls.append(1)
            for kept, param in zip(average, model.parameters(), strict=True):
                kept.mul_(0.9).add_(param.detach(), alpha=0.1)

        optimizer.register_step_post_hook(ema)
        for tokens, targets in batches(3):
            loss_of(model, tokens, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        return len(calls), average

    plain, cached = make_model(), make_model()
    plain_calls, plain_average = loop(plain)
    cached_calls, cached_average = gradient_cache.optimize(**LOSSLESS)(loop)(cached)
    assert plain_calls == cached_calls == 3
    assert all(torch.equal(a, b) for a, b in zip(plain_average, cached_average, strict=True))


def test_readers_of_every_gradient_are_refused_with_the_state_on_the_host() -> None:
    @gradient_cache.optimize(**LOSSLESS, offload_optimizer_state=True)
    def loop(model: nn.Module) -> None:
        loss_of(model, *batches(1)[0]).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)

    with pytest.raises(
        RuntimeError, match="clip_grad_value_ needs every gradient on the device at once"
    ):
        loop(make_model())


def test_the_state_offload_needs_the_fused_step() -> None:
    with pytest.raises(ValueError, match="offload_optimizer_state=True needs fused_step=True"):
        gradient_cache.optimize(offload_optimizer_state=True, fused_step=False)
    with pytest.raises(TypeError, match="fused_step must be True or False"):
        gradient_cache.optimize(fused_step="yes")


def test_the_managers_norm_and_clip_in_a_loop_of_your_own() -> None:
    """gradient_norm and clip_grads_with_norm_ are torch's get_total_norm and
    clip_grads_with_norm_ over cached gradients; a clip over part of the parameters
    restores and clips those in place."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(cached, **LOSSLESS)
    for tokens, targets in batches(3):
        loss_of(plain, tokens, targets).backward()
        loss_of(cached, tokens, targets).backward()
        half = list(plain.parameters())[::2]
        expected = torch.nn.utils.clip_grad_norm_(half, 0.05)
        cached_half = list(cached.parameters())[::2]
        total = manager.gradient_norm(cached_half)
        assert torch.equal(total, expected)
        manager.clip_grads_with_norm_(cached_half, 0.05, total)
        assert all(p.grad is not None for p in cached_half)  # a part: restored and clipped
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        total = manager.gradient_norm(cached.parameters())
        assert torch.equal(total, expected)
        manager.clip_grads_with_norm_(cached.parameters(), 0.05, total)
        with pytest.raises(RuntimeError, match="between a clip_grad_norm_ answered"):
            manager.state_dict()
        plain_opt.step()
        plain_opt.zero_grad()
        manager.step(cached_opt)
        cached_opt.zero_grad()
    assert_same_parameters(plain, cached)


def test_the_managers_clip_scales_a_gradient_listed_twice_twice_as_torchs_does() -> None:
    """A tied weight passed in through two module lists: torch's clip_grads_with_norm_
    scales its gradient once per entry, and so does the manager's."""
    manager = gradient_cache.create_gradient_cache(make_model(), **LOSSLESS)
    plain, cached = (torch.ones(3, requires_grad=True) for _ in range(2))
    for tensor in (plain, cached):
        tensor.grad = torch.full((3,), 2.0)
    torch.nn.utils.clip_grads_with_norm_([plain, plain], 1.0, torch.tensor(4.0))
    manager.clip_grads_with_norm_([cached, cached], 1.0, torch.tensor(4.0))
    assert torch.equal(cached.grad, plain.grad)
    manager.remove_hooks()


def test_a_resumed_run_clips_by_the_norms_the_uninterrupted_one_would() -> None:
    """The checkpoint carries the norm type the encodes compute: the first step after a
    resume clips by the encodes' norms (of the gradients before compression), as the
    uninterrupted run does, not by the host copies' (int8 here: they differ)."""
    options = dict(compression_ratio=4, min_compress_numel=1, bucket_size_mb=0.004)
    data = batches(4)

    def build() -> tuple[nn.Module, object, torch.optim.Optimizer]:
        model = make_model()
        manager = gradient_cache.create_gradient_cache(model, **options)
        return model, manager, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def run(model, manager, optimizer, part) -> None:
        for tokens, targets in part:
            loss_of(model, tokens, targets).backward()
            manager.step(optimizer, max_grad_norm=0.05)

    uninterrupted = build()
    run(*uninterrupted, data)
    first = build()
    run(*first, data[:2])
    saved = {"model": first[0].state_dict(), "optimizer": first[2].state_dict()}
    saved["cache"] = first[1].state_dict()
    first[1].remove_hooks()
    resumed = build()
    resumed[0].load_state_dict(saved["model"])
    resumed[2].load_state_dict(saved["optimizer"])
    resumed[1].load_state_dict(saved["cache"])
    run(*resumed, data[2:])
    assert_same_parameters(uninterrupted[0], resumed[0])
