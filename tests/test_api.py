"""The public surface: names, summary, bad input, calls out of order, lifetime."""

from __future__ import annotations

import copy
import gc
import logging
import threading
import warnings
import weakref

import pytest
import torch
from helpers import (
    assert_a_closed_manager_lets_the_model_go_without_a_gc_pass,
    assert_same_parameters,
    batches,
    loss_of,
    make_model,
    train_with_a_skipped_batch,
)
from test_parameters_offload import step

import gradient_cache
from gradient_cache import EngineConfig, GradientCacheHookManager
from gradient_cache.model_watch import ParameterWatch


def backward_once(model: torch.nn.Module, seed: int = 1) -> None:
    tokens, targets = batches(1, seed=seed)[0]
    loss_of(model, tokens, targets).backward()


def test_public_names() -> None:
    assert set(gradient_cache.__all__) >= {
        "create_gradient_cache",
        "GradientCacheHookManager",
        "GradientCompressor",
        "EngineConfig",
        "manager_of",
        "__version__",
    }
    assert isinstance(gradient_cache.__version__, str)
    manager = gradient_cache.create_gradient_cache(make_model())
    assert isinstance(manager, GradientCacheHookManager)


def test_summary_reports_real_figures() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=100,
        codec="topk",
        min_compress_numel=1,
        residual_dtype="float32",
    )
    backward_once(model)
    manager.apply_gradients()
    summary = manager.get_compression_summary()
    dense = sum(p.numel() * 4 for p in model.parameters())
    layers = summary["layers"]
    stored = sum(layer["stored_bytes"] for layer in layers.values())
    assert summary["memory_saved_mb"] == pytest.approx(dense / 2**20)
    assert summary["overall_compression_ratio"] == pytest.approx(dense / stored)
    # fp32 values plus int32 indices: 1% kept costs 2% of the bytes, at best 50x.
    assert 30 < summary["overall_compression_ratio"] <= 50
    for name, p in model.named_parameters():
        assert layers[name]["numel"] == p.numel()
        assert layers[name]["kept_fraction"] == pytest.approx(-(-p.numel() // 100) / p.numel())
    assert summary["steps"] == 1 and summary["process_rss_mb"] > 0
    assert summary["device"] == "cpu"
    assert summary["host_pool"] is None and summary["host_available_mb"] > 0
    assert summary["residual_mb"] == pytest.approx(dense / 2**20)
    assert summary["stored_fraction"] == pytest.approx(stored / dense)
    assert summary["host_held_mb"] == pytest.approx((stored + dense) / 2**20)


@pytest.mark.parametrize("residual_dtype", ["bfloat16", "int8"])
def test_summary_counts_the_residual_as_stored(residual_dtype: str) -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model,
        compression_ratio=100,
        codec="topk",
        error_feedback=True,
        residual_dtype=residual_dtype,
        min_compress_numel=1,
    )
    backward_once(model)
    manager.apply_gradients()
    if residual_dtype == "bfloat16":
        expected = sum(2 * p.numel() for p in model.parameters())
    else:  # a byte per entry in whole blocks of 64, and a 4-byte scale per block
        expected = sum((64 + 4) * -(-p.numel() // 64) for p in model.parameters())
    assert manager.get_compression_summary()["residual_mb"] == pytest.approx(expected / 2**20)
    backward_once(model, seed=2)  # pending: the step's new residuals beside the current ones
    manager.compress_and_free_gradients()
    held = manager.get_compression_summary()["residual_mb"]
    assert held == pytest.approx(2 * expected / 2**20)


def test_small_tensors_travel_uncompressed() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=100, min_compress_numel=1000
    )
    backward_once(model)
    manager.apply_gradients()
    for name, layer in manager.get_compression_summary()["layers"].items():
        assert layer["compressed"] == (layer["numel"] >= 1000), name
        if not layer["compressed"]:
            assert layer["kept_fraction"] == 1.0


def test_summary_before_any_step_is_empty_not_an_error() -> None:
    summary = gradient_cache.create_gradient_cache(make_model()).get_compression_summary()
    assert summary["steps"] == 0 and summary["memory_saved_mb"] == 0 and summary["layers"] == {}
    assert not summary["step_pending"]


def test_summary_describes_the_pending_step_then_the_restored_one() -> None:
    """The seed's pattern, compress_and_free_gradients() then the summary, shows what is
    cached now; after the restore the same figures describe the restored step."""
    model = make_model()
    manager = gradient_cache.create_gradient_cache(
        model, compression_ratio=100, codec="topk", min_compress_numel=1, selection="exact"
    )
    backward_once(model)
    waiting = manager.get_compression_summary()  # the last bucket waits on the device
    assert waiting["step_pending"] and waiting["memory_saved_mb"] == 0
    manager.compress_and_free_gradients()
    pending = manager.get_compression_summary()
    dense = sum(p.numel() * 4 for p in model.parameters())
    assert pending["step_pending"] and pending["steps"] == 0
    assert pending["memory_saved_mb"] == pytest.approx(dense / 2**20)
    assert 30 < pending["overall_compression_ratio"] <= 50
    manager.apply_gradients()
    restored = manager.get_compression_summary()
    assert not restored["step_pending"] and restored["steps"] == 1
    assert restored["layers"] == pending["layers"]
    assert restored["overall_compression_ratio"] == pending["overall_compression_ratio"]


@pytest.mark.parametrize("ratio", [0.5, 0, -3, float("nan"), float("inf")])
def test_bad_compression_ratio_values(ratio: float) -> None:
    with pytest.raises(ValueError, match="compression_ratio"):
        gradient_cache.create_gradient_cache(make_model(), compression_ratio=ratio)


@pytest.mark.parametrize("ratio", ["100", None, True, [100]])
def test_non_numeric_compression_ratio(ratio: object) -> None:
    with pytest.raises(TypeError, match="compression_ratio"):
        GradientCacheHookManager(make_model(), compression_ratio=ratio)


def test_model_must_be_a_module() -> None:
    model = make_model()
    with pytest.raises(TypeError, match=r"nn\.Module"):
        gradient_cache.create_gradient_cache(list(model.parameters()))


def test_model_without_trainable_parameters() -> None:
    model = make_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        gradient_cache.create_gradient_cache(model)


@pytest.mark.parametrize("exclude", ["norm", [3], ("norm", None), {"norm"}, [""]])
def test_exclude_layers_must_be_a_list_of_strings(exclude: object) -> None:
    with pytest.raises(TypeError, match="exclude_layers"):
        GradientCacheHookManager(make_model(), exclude_layers=exclude)


def test_exclude_layers_entry_that_matches_nothing_warns() -> None:
    with pytest.warns(UserWarning, match="'decoder'"):
        GradientCacheHookManager(make_model(), exclude_layers=["decoder", "norm"])


def test_excluding_everything_is_an_error() -> None:
    with pytest.raises(ValueError, match="excludes every trainable parameter"):
        GradientCacheHookManager(make_model(), exclude_layers=["embed", "mlp", "norm"])


def test_unknown_and_conflicting_options() -> None:
    with pytest.raises(TypeError, match="bucket_size"):
        gradient_cache.create_gradient_cache(make_model(), bucket_size=3)
    with pytest.raises(ValueError, match="not both"):
        gradient_cache.create_gradient_cache(make_model(), config=EngineConfig(), bucket_size_mb=1)
    with pytest.raises(TypeError, match="EngineConfig"):
        GradientCacheHookManager(make_model(), config={"bucket_size_mb": 1})


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(bucket_size_mb=0), "bucket_size_mb"),
        (dict(bucket_size_mb=float("nan")), "bucket_size_mb"),
        (dict(selection="fast"), "selection"),
        (dict(error_feedback="yes"), "error_feedback"),
        (dict(residual_location="gpu"), "residual_location"),
        (dict(min_compress_numel=0), "min_compress_numel"),
        (dict(min_compress_numel=2.5), "min_compress_numel"),
        (dict(host_memory_fraction=1.5), "host_memory_fraction"),
        (dict(backend="tpu"), "backend"),
    ],
)
def test_engine_config_validation(options: dict, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        EngineConfig.from_options(options)  # top-k's options: checked by TopK first


def test_cuda_backend_on_cpu_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="backend='cuda'"):
        gradient_cache.create_gradient_cache(make_model(), backend="cuda")


def test_step_validates_its_arguments() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer"):
        manager.step(model)
    with pytest.raises(ValueError, match="max_grad_norm"):
        manager.step(optimizer, max_grad_norm=-1)
    with pytest.raises(ValueError, match="norm_type"):
        manager.step(optimizer, max_grad_norm=1.0, norm_type=0)


def test_apply_without_compress_drains_first() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1, bucket_size_mb=1)
    backward_once(model)  # one big bucket: nothing has been launched yet
    manager.apply_gradients()
    assert all(p.grad is not None for p in model.parameters())


def test_a_post_accumulate_grad_hook_sees_the_gradient_where_registered_before() -> None:
    """As training-loop.md says: a parameter's post-accumulate-grad hook registered before
    the cache runs before the cache's, and sees plain's gradient in ``.grad``; one
    registered after runs after the cache took it, and sees None."""
    plain = make_model()
    loss_of(plain, *batches(1)[0]).backward()
    model = make_model()
    before: dict[int, torch.Tensor] = {}
    after: dict[int, torch.Tensor | None] = {}
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: before.update({id(p): p.grad.clone()}))
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: after.update({id(p): p.grad}))
    loss_of(model, *batches(1)[0]).backward()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(before[id(b)], a.grad) and after[id(b)] is None
    manager.remove_hooks()


def test_a_scaling_post_accumulate_grad_hook_scales_each_micro_batch_once() -> None:
    """As training-loop.md says: registered before the cache, a hook scaling ``.grad`` in
    place gives plain's gradient with one backward, but under accumulation plain's scales
    the running sum again ((g1·s + g2)·s) and the cache's each micro-batch once."""

    def gradients(micro_batches: int, cached: bool) -> list[torch.Tensor]:
        def halve(param: torch.Tensor) -> None:
            param.grad.mul_(0.5)

        model = make_model()
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(halve)
        manager = (
            gradient_cache.create_gradient_cache(model, compression_ratio=1) if cached else None
        )
        for tokens, targets in batches(micro_batches):
            loss_of(model, tokens, targets).backward()
        if manager is not None:
            manager.apply_gradients()
            manager.remove_hooks()
        return [p.grad for p in model.parameters()]

    def alone(index: int) -> list[torch.Tensor]:  # micro-batch ``index``'s gradient, unhooked
        model = make_model()
        loss_of(model, *batches(2)[index]).backward()
        return [p.grad for p in model.parameters()]

    assert all(map(torch.equal, gradients(1, cached=True), gradients(1, cached=False)))
    first, second = alone(0), alone(1)
    for cached, plain, g1, g2 in zip(
        gradients(2, cached=True), gradients(2, cached=False), first, second, strict=True
    ):
        assert torch.equal(cached, g1 * 0.5 + g2 * 0.5)
        assert torch.equal(plain, (g1 * 0.5 + g2) * 0.5)


def test_a_plain_optimizer_step_over_cached_gradients_is_refused_before_it_steps() -> None:
    """``optimizer.step()`` where ``hook_manager.step(optimizer)`` belongs: the gradients
    are the cache's, not in ``.grad``, so it would step nothing, silently. Refused before
    anything changes, naming the fix; after ``apply_gradients()`` it is plain's step."""
    plain, model = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, model)]
    for net in (plain, model):
        loss_of(net, *batches(1)[0]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"AdamW\.step\(\) while the gradient cache holds"):
        optimizers[1].step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    manager.apply_gradients()
    for optimizer in optimizers:
        optimizer.step()
    assert all(
        torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True)
    )
    manager.remove_hooks()


def test_compress_twice_and_apply_twice_are_harmless() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    backward_once(model)
    manager.compress_and_free_gradients()
    manager.compress_and_free_gradients()
    manager.apply_gradients()
    grads = [p.grad.clone() for p in model.parameters()]
    manager.apply_gradients()  # nothing cached: changes nothing
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


def test_disable_leaves_gradients_and_apply_adds_to_them() -> None:
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, compression_ratio=1)
    backward_once(cached, seed=1)
    manager.compress_and_free_gradients()
    manager.disable()
    backward_once(cached, seed=2)
    assert all(p.grad is not None for p in cached.parameters())
    manager.apply_gradients()
    manager.enable()
    backward_once(plain, seed=1)
    backward_once(plain, seed=2)
    for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_a_zero_grads_discard_waits_for_a_gradient_hook_still_running() -> None:
    """After a backward raised, autograd's device thread may still be in the capture's hook;
    a discard beside it left the store inconsistent (a KeyError in one CI run). The hook
    holds the capture's lock, and zero_grad()'s discard waits for it."""
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model, *batches(1)[0]).backward()
    lock = manager.engine.capture.lock
    zeroing = threading.Thread(target=optimizer.zero_grad)
    with lock:  # a hook of a backward that raised, still running
        zeroing.start()
        zeroing.join(timeout=0.5)
        assert zeroing.is_alive()  # waits for the hook
        assert manager.engine.step_pending  # nothing dropped beside it
    zeroing.join()
    assert not manager.engine.step_pending
    manager.remove_hooks()


@pytest.mark.parametrize("discard", [True, False], ids=["discard_gradients", "zero_grad-only"])
@pytest.mark.parametrize("fused_step", [False, True])
@pytest.mark.parametrize(
    ("ratio", "codec"),
    [
        (1, None),
        (100, None),
        (100, gradient_cache.TopK(error_feedback=False)),
        (100, gradient_cache.TopK()),
    ],
    ids=["lossless", "ladder", "top-k", "top-k with error feedback"],
)
def test_a_discarded_batch_leaves_no_trace(ratio: int, codec, fused_step, discard) -> None:
    """A run with a discarded batch ends exactly where a run that never saw it ends.

    Defaults otherwise: threshold selection and the int8 residual both draw random
    numbers, so the engine's generators must be rewound along with the residuals.
    (This test once passed ``error_feedback=`` with ``codec=None``, where it did nothing:
    the ladder ran in all four of its ratio-100 cases and top-k in none.)
    """
    options = dict(compression_ratio=ratio, min_compress_numel=1, codec=codec)
    skipping = train_with_a_skipped_batch(
        options, skip=True, fused_step=fused_step, discard=discard
    )
    reference = train_with_a_skipped_batch(options, skip=False, fused_step=fused_step)
    if ratio == 1:  # lossless: the same as plain PyTorch doing the same calls
        plain = train_with_a_skipped_batch(None, skip=True)
        for a, b in zip(plain.parameters(), skipping.parameters(), strict=True):
            assert torch.equal(a, b)
    for a, b in zip(reference.parameters(), skipping.parameters(), strict=True):
        assert torch.equal(a, b)


def test_two_optimizers_zero_grad_skips_a_batch_as_one_over_the_whole_model() -> None:
    """Each zero_grad() reaches half the gradients the cache holds (one would keep them
    all); together they reached all, so the batch is dropped (it was added into the next
    step: 0.116 off plain in a probe). A backward between them starts over: its gradients
    are new, and the second call alone reaches only part of them."""

    def halves(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
        params = list(model.parameters())
        return [torch.optim.SGD(params[i::2], lr=0.1, momentum=0.9) for i in (0, 1)]

    def run(manager_of=None) -> torch.nn.Module:
        model = make_model()
        manager = manager_of(model) if manager_of else None
        optimizers = halves(model)
        for index, (tokens, targets) in enumerate(batches(3)):
            loss_of(model, tokens, targets).backward()
            for optimizer in optimizers if index != 1 else ():  # batch 1: skipped
                if manager is None:
                    optimizer.step()
                else:
                    manager.step(optimizer)
            for optimizer in optimizers:
                optimizer.zero_grad()
        return model

    plain = run()
    cached = run(lambda model: gradient_cache.create_gradient_cache(model, compression_ratio=1))
    assert_same_parameters(plain, cached)
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    first, second = halves(model)
    backward_once(model)
    first.zero_grad()
    backward_once(model)
    second.zero_grad()
    assert manager.engine.step_pending  # the second backward's gradients stay
    manager.discard_gradients()


def test_grad_cleared_by_hand_is_accumulation_to_the_cache_and_discard_gradients_skips() -> None:
    """A batch skipped by ``p.grad = None`` by hand (docs/training-loop.md, "Skipping a
    step"): the cache holds its gradients and ``.grad`` is already None, so they join the
    next step, as plain PyTorch keeping them (accumulation); ``discard_gradients()`` in its
    place skips the batch as plain PyTorch's ``p.grad = None`` does."""

    def run(skip: str, cached: bool) -> torch.nn.Module:
        model = make_model()
        manager = None
        if cached:
            manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for index, (tokens, targets) in enumerate(batches(3)):
            loss_of(model, tokens, targets).backward()
            if index == 1:  # the batch skipped
                if skip == "discard" and manager is not None:
                    manager.discard_gradients()
                for param in model.parameters() if skip != "keep" else ():
                    param.grad = None
                continue
            step(model, optimizer, manager)
        return model

    assert_same_parameters(run("keep", cached=False), run("by hand", cached=True))
    assert_same_parameters(run("by hand", cached=False), run("discard", cached=True))


def test_step_completed_warns_about_gradients_still_cached() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    backward_once(model)
    with pytest.warns(UserWarning, match="still cached"):
        manager.step_completed()
    manager.apply_gradients()  # nothing was dropped
    assert all(p.grad is not None for p in model.parameters())
    manager.step_completed()  # nothing cached: no warning (warnings are errors here)


def test_remove_hooks_restores_cached_gradients_and_closes() -> None:
    model = make_model()
    with gradient_cache.create_gradient_cache(model, compression_ratio=1) as manager:
        backward_once(model)
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match="remove_hooks"):
        manager.apply_gradients()
    manager.remove_hooks()  # twice is harmless
    model.zero_grad()
    backward_once(model)  # hooks are gone: gradients stay on the parameters
    assert all(p.grad is not None for p in model.parameters())


def test_verbose_logs_a_line_per_step(caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=10, verbose=True)
    backward_once(model)
    with caplog.at_level(logging.INFO, logger="gradient_cache"):
        manager.apply_gradients()
        manager.apply_gradients()  # nothing cached: nothing restored, nothing logged
    assert "gradient-cache step 1" in caplog.text
    assert caplog.text.count("gradient-cache step") == 1


def test_a_closed_manager_lets_the_model_go_without_a_gc_pass() -> None:
    def build() -> tuple[torch.nn.Module, object]:
        model = make_model()
        manager = gradient_cache.create_gradient_cache(model, compression_ratio=100)
        backward_once(model)
        manager.apply_gradients()
        return model, manager

    assert_a_closed_manager_lets_the_model_go_without_a_gc_pass(build)


def test_a_second_manager_on_one_model_is_refused_until_the_first_is_removed() -> None:
    model = make_model()
    first = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    with pytest.raises(ValueError, match="already cached by another GradientCacheHookManager"):
        gradient_cache.create_gradient_cache(model, compression_ratio=1)
    with pytest.raises(ValueError, match="already cached"):  # a part of the model too
        gradient_cache.create_gradient_cache(model.mlp, compression_ratio=1)
    first.remove_hooks()
    second = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    backward_once(model)
    second.apply_gradients()
    assert all(p.grad is not None for p in model.parameters())


def forward_backward(model: torch.nn.Module) -> None:
    tokens, targets = batches(1, seed=1)[0]
    loss_of(model, tokens, targets).backward()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: setattr(m, "extra", torch.nn.Linear(2, 2)), "'extra.weight' added or unfrozen"),
        (
            lambda m: setattr(m.norm, "weight", torch.nn.Parameter(m.norm.weight.detach())),
            "'norm.weight' replaced by a new Parameter",
        ),
        # to("meta") makes new Parameters; to("cuda") would move these in place.
        (lambda m: m.to("meta"), "replaced by a new Parameter"),
    ],
    ids=["added", "replaced", "moved"],
)
def test_parameters_changed_after_creation_are_refused_before_backward(change, message) -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    change(model)
    with pytest.raises(RuntimeError, match=message) as info:
        forward_backward(model)
    assert "remove_hooks()" in str(info.value)
    assert all(p.grad is None for p in model.parameters())  # stopped before backward
    manager.remove_hooks()


def functional_call_steps(cached: bool) -> list[torch.Tensor]:
    """Four clipped SGD steps, each backward through ``torch.func.functional_call`` with a
    weight halved in place of the head's and through the model itself."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1) if cached else None
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(4, 8, generator=generator)
        halved = torch.func.functional_call(model, {"2.weight": model[2].weight * 0.5}, (x,))
        (halved.pow(2).mean() + model(x).pow(2).mean()).backward()
        step(model, optimizer, manager, clip=0.5)
    return [p.detach() for p in model.parameters()]


def test_a_functional_call_with_a_tensor_in_a_parameters_place_trains_as_plain() -> None:
    """A plain tensor in a parameter's place for one call is not a changed model (it was
    refused as "replaced by a new Parameter", advising a new cache)."""
    plain, cached = functional_call_steps(False), functional_call_steps(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, cached, strict=True))


def test_unfreezing_is_refused_and_freezing_needs_no_new_cache() -> None:
    frozen_at_start, reference = make_model(), make_model()
    frozen_at_start.norm.weight.requires_grad_(False)
    manager = gradient_cache.create_gradient_cache(frozen_at_start, compression_ratio=1)
    frozen_at_start.norm.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'norm\.weight' added or unfrozen"):
        forward_backward(frozen_at_start)
    manager.remove_hooks()

    manager = gradient_cache.create_gradient_cache(reference, compression_ratio=1)
    reference.norm.weight.requires_grad_(False)
    forward_backward(reference)
    manager.apply_gradients()
    assert reference.norm.weight.grad is None and reference.embed.weight.grad is not None


def test_a_replaced_parameter_is_not_kept_alive_once_the_cache_is_removed() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    old = weakref.ref(model.norm.weight)
    model.norm.weight = torch.nn.Parameter(model.norm.weight.detach().clone())
    manager.remove_hooks()
    gc.collect()
    assert old() is None
    with gradient_cache.create_gradient_cache(model, compression_ratio=1):
        pass  # the new one is cached


def test_parameters_moved_in_place_to_another_device_are_refused() -> None:
    """model.to("cuda") keeps each Parameter object and changes its device; stood in for
    by a watch that expects another device than the parameters'."""
    model = make_model()
    watch = ParameterWatch(
        model, list(model.named_parameters()), excluded=(), device=torch.device("meta")
    )
    with pytest.raises(RuntimeError, match=r"'embed\.weight' moved from meta to cpu"):
        forward_backward(model)
    watch.remove()
    forward_backward(model)


def test_without_the_previous_residual_a_discarded_batch_reaches_later_steps() -> None:
    """keep_previous_residual=False trades the undo for a residual's host memory."""
    options = dict(
        compression_ratio=100, codec="topk", min_compress_numel=1, keep_previous_residual=False
    )
    skipping = train_with_a_skipped_batch(options, skip=True)
    reference = train_with_a_skipped_batch(options, skip=False)
    pairs = zip(reference.parameters(), skipping.parameters(), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("ratio", [2, 3, 4, 8, 10, 16, 25, 50, 100])
def test_compression_ratio_delivers_at_least_that_many_times_fewer_bytes(ratio: float) -> None:
    """One knob, one meaning: at ratio r the cache holds at least r times fewer bytes than
    lossless offload (codes, scales and indices counted), on a small GPT whose norms and
    biases are a block or two each."""
    from gradient_cache.demo.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4))
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=ratio)
    tokens = torch.randint(256, (2, 64))
    model(tokens, tokens)[1].backward()
    manager.apply_gradients()
    summary = manager.get_compression_summary()
    assert summary["overall_compression_ratio"] >= ratio
    assert all(layer["codec"] != "lossless" for layer in summary["layers"].values())


def test_a_torch_whose_current_accelerator_raises_without_one_trains_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.6's ``torch.accelerator.current_accelerator()`` raises where there is no
    accelerator (later releases return None): every cache's creation raised it on a CPU.
    The cache takes that for none, and trains as on a newer torch."""

    def raising() -> None:
        raise RuntimeError("Cannot access accelerator device when none is available.")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", raising)
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, compression_ratio=1)
    for model in (plain, cached):
        loss_of(model, *batches(1)[0]).backward()
    manager.apply_gradients()
    assert all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(plain.parameters(), cached.parameters(), strict=True)
    )


def test_one_optimizer_over_two_caches_clips_by_the_global_norm_or_is_refused() -> None:
    """One optimizer over two models, each with a cache: ``max_grad_norm`` would clip each
    cache's share by its own norm (silently off plain's global clip), so it is refused,
    naming the fix; one cache over a ModuleDict of both clips as plain does."""

    def models() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.nn.Linear(8, 8)

    def train(encoder, decoder, caches) -> None:
        params = [*encoder.parameters(), *decoder.parameters()]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        for x in torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1)):
            ((decoder(encoder(x)) - x) ** 2).mean().backward()
            if not caches:
                torch.nn.utils.clip_grad_norm_(params, 0.05)
                optimizer.step()
            for cache in caches:
                cache.step(optimizer, max_grad_norm=0.05)
            optimizer.zero_grad()

    plain = models()
    train(*plain, [])
    encoder, decoder = models()
    one = gradient_cache.create_gradient_cache(
        torch.nn.ModuleDict({"encoder": encoder, "decoder": decoder}), compression_ratio=1
    )
    train(encoder, decoder, [one])
    cached = [*encoder.parameters(), *decoder.parameters()]
    assert all(
        torch.equal(a, b)
        for a, b in zip([*plain[0].parameters(), *plain[1].parameters()], cached, strict=True)
    )
    one.remove_hooks()
    encoder, decoder = models()
    caches = [
        gradient_cache.create_gradient_cache(m, compression_ratio=1) for m in (encoder, decoder)
    ]
    with pytest.raises(RuntimeError, match=r"2 gradient caches hold .*torch\.nn\.ModuleDict"):
        train(encoder, decoder, caches)


@pytest.mark.parametrize("state_on_host", [False, True], ids=["state-on-device", "state-on-host"])
def test_one_optimizer_over_two_caches_steps_through_each_or_refuses_to_drop_the_rest(
    state_on_host: bool,
) -> None:
    """One optimizer over two models, a cache each: stepping it through one cache left the
    other's gradients there, and zero_grad() dropped them, so that model never trained,
    without a word (a probe). That zero_grad() is refused now, dropping nothing; stepping
    it through both caches trains as plain PyTorch's one optimizer.step()."""

    def models() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(0)
        return torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def train(encoder, head, caches, *, steps: int = 3) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=1e-2)
        for x in torch.randn(steps, 4, 8, generator=torch.Generator().manual_seed(1)):
            head(encoder(x)).square().mean().backward()
            if not caches:
                optimizer.step()
            for cache in caches:
                cache.step(optimizer)
            optimizer.zero_grad()
        return optimizer

    options = {"compression_ratio": 1, "offload_optimizer_state": state_on_host}
    plain = models()
    train(*plain, [])
    cached = models()
    caches = [gradient_cache.create_gradient_cache(m, **options) for m in cached]
    train(*cached, caches)
    for a, b in zip(plain, cached, strict=True):
        assert_same_parameters(a, b)
    encoder, head = cached
    before = [p.detach().clone() for p in head.parameters()]
    with pytest.raises(RuntimeError, match=r"would drop .* 2 parameters \(weight, bias\)"):
        train(encoder, head, caches[:1], steps=1)
    assert all(torch.equal(a, b) for a, b in zip(before, head.parameters(), strict=True))
    caches[1].step(torch.optim.SGD(head.parameters(), lr=1.0))  # they are still there
    assert not any(torch.equal(a, b) for a, b in zip(before, head.parameters(), strict=True))


def test_a_zero_grad_over_some_of_the_held_gradients_warns_at_the_step() -> None:
    """``model.head.zero_grad()`` after backward, to hold the head still: the cache keeps
    every gradient of a pending step (it cannot drop a part), so the step moved the head
    where plain's does not, without a word (a probe). It warns at the step now, naming the
    fix, under the decorator too; an ordinary loop does not warn."""

    def loop(model: torch.nn.Module, step, partial: bool) -> None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x in torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)):
            model(x).square().mean().backward()
            if partial:
                model[2].zero_grad()
            step(optimizer)
            optimizer.zero_grad()

    def run(partial: bool, decorated: bool = False) -> list[warnings.WarningMessage]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if decorated:
                steps = gradient_cache.optimize(compression_ratio=1)(loop)
                steps(model, lambda optimizer: optimizer.step(), partial)
            else:
                manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
                loop(model, manager.step, partial)
                manager.remove_hooks()
        return [w for w in caught if "zero_grad() since the last backward" in str(w.message)]

    warned = run(partial=True)
    assert len(warned) == 2 and "reached 2 of the 4 parameters" in str(warned[0].message)
    assert "discard_gradients()" in str(warned[0].message)
    assert warned[0].filename == __file__
    assert len(run(partial=True, decorated=True)) == 2
    assert not run(partial=False) and not run(partial=False, decorated=True)
    # Two optimizers, the first's zero_grad() in place of its step: the second's step owns
    # none of what it dropped, and the second's zero_grad() drops the rest, as plain's.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1)
    first, second = (torch.optim.SGD(model[i].parameters(), lr=0.1) for i in (0, 2))
    model(torch.randn(8, 16)).square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first.zero_grad()
        manager.step(second)
        second.zero_grad()
    manager.remove_hooks()


def test_a_mid_accumulation_checkpoint_with_excluded_layers_resumes_as_the_docs_say() -> None:
    """docs/training-loop.md, Checkpoints: an excluded layer's gradient is the user's, in
    `.grad`, as in plain PyTorch; saved beside the cache's state and put back after the
    loads, the resumed run goes on bit for bit as the run that saved it (without it, the
    resumed step took one micro-batch of the excluded layer's gradient, 3.4e-2 off)."""
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def build() -> tuple[torch.nn.Module, GradientCacheHookManager, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)
        )
        cache = gradient_cache.create_gradient_cache(
            model, compression_ratio=1, exclude_layers=["2."]
        )
        return model, cache, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, cache, optimizer, indices) -> None:
        for i in indices:
            (model(batches[i]).pow(2).mean() / 2).backward()
            if i % 2 == 1:  # two micro-batches a step
                cache.step(optimizer)
                optimizer.zero_grad()

    saver = build()
    train(*saver, range(3))  # the first micro-batch of the second step is in
    cache_state = saver[1].state_dict()
    grads = {n: p.grad.clone() for n, p in saver[0].named_parameters() if p.grad is not None}
    assert set(grads) == {"2.weight", "2.bias"}  # the cached ones are in the cache's state
    model_state = {k: v.clone() for k, v in saver[0].state_dict().items()}
    optimizer_state = copy.deepcopy(saver[2].state_dict())
    train(*saver, range(3, 6))
    model, cache, optimizer = build()
    model.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
    cache.load_state_dict(cache_state)
    for name, param in model.named_parameters():
        if name in grads:
            param.grad = grads[name]
    train(model, cache, optimizer, range(3, 6))
    assert_same_parameters(saver[0], model)
