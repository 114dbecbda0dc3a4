"""state_dict() / load_state_dict(): a resumed run continues bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import (
    CHECKPOINT_DATA as DATA,
)
from helpers import (
    CHECKPOINT_MICRO_BATCHES as MICRO_BATCHES,
)
from helpers import (
    CHECKPOINT_RECIPES as RECIPES,
)
from helpers import (
    CHECKPOINT_STEPS as STEPS,
)
from helpers import (
    assert_same_parameters,
    batches,
    loss_of,
    make_model,
    resumed_run,
    save_and_load,
)
from helpers import build_checkpointed as build
from helpers import run_checkpointed as run

import gradient_cache


@pytest.mark.parametrize("cut", [4, 5], ids=["between steps", "mid-accumulation"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_resumed_run_continues_bit_for_bit(recipe: str, cut: int) -> None:
    options = RECIPES[recipe]
    reference, reference_manager, optimizer = build(options)
    run(reference, reference_manager, optimizer, range(STEPS * MICRO_BATCHES))
    resumed, manager = resumed_run(options, cut)
    assert_same_parameters(reference, resumed)
    summary = manager.get_compression_summary()
    assert summary["steps"] == reference_manager.get_compression_summary()["steps"] == STEPS
    if recipe == "lossless":  # and the same as plain PyTorch
        plain = make_model()
        plain_optimizer = torch.optim.Adam(plain.parameters(), lr=1e-2)
        for index in range(STEPS * MICRO_BATCHES):
            loss_of(plain, *DATA[index]).backward()
            if index % MICRO_BATCHES == MICRO_BATCHES - 1:
                plain_optimizer.step()
                plain_optimizer.zero_grad()
        assert_same_parameters(plain, resumed)


def test_the_state_holds_residuals_and_the_cached_gradients_by_name() -> None:
    model, manager, optimizer = build(RECIPES["r100 error feedback"])
    run(model, manager, optimizer, range(3))  # a step, then one micro-batch cached
    state = manager.state_dict()
    names = {name for name, _ in model.named_parameters()}
    assert set(state["parameters"]) == names
    assert set(state["residuals"]) == set(state["pending_residuals"]) == names
    cached = [item["name"] for bucket in state["buckets"] for item in bucket]
    assert sorted(cached) == sorted(names)
    assert state["steps"] == 1 and state["random_state"]
    # CPU copies: saving them does not save (or alias) the engine's own memory.
    residual = manager.engine.backend.residuals.current()[model.embed.weight]
    assert state["residuals"]["embed.weight"].data_ptr() != residual.data_ptr()


def test_a_checkpoint_between_steps_holds_no_bucket_and_loads_with_no_step_pending() -> None:
    """A restored step leaves no (empty) bucket behind: saved, one would load as a step."""
    model, manager, optimizer = build(RECIPES["lossless"])
    run(model, manager, optimizer, range(MICRO_BATCHES))  # one step, every gradient restored
    state = manager.state_dict()
    assert state["buckets"] == []
    resumed = build(RECIPES["lossless"])[1]
    resumed.load_state_dict(state)
    assert not resumed.engine.step_pending


def test_a_discard_after_resuming_mid_step_rewinds_to_the_step_start() -> None:
    """The pending step's start (residuals, generators) travels with the checkpoint."""
    options = RECIPES["r100 error feedback"]
    model, manager, optimizer = build(options)
    run(model, manager, optimizer, range(2))
    loss_of(model, *DATA[2]).backward()
    saved = save_and_load(model, manager, optimizer)
    model, manager, optimizer = build(options)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    manager.load_state_dict(saved["cache"])
    manager.discard_gradients()
    run(model, manager, optimizer, range(4, 6))
    reference, reference_manager, reference_optimizer = build(options)
    run(reference, reference_manager, reference_optimizer, range(2))
    run(reference, reference_manager, reference_optimizer, range(4, 6))
    assert_same_parameters(reference, model)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(compression_ratio=10), "compression_ratio: checkpoint 100.0, this manager 10.0"),
        (dict(error_feedback=False), "error_feedback: checkpoint True, this manager False"),
        (dict(residual_dtype="bfloat16"), "residual_dtype: checkpoint 'int8'"),
        (dict(warmup_steps=3), "warmup_steps: checkpoint 0, this manager 3"),
        (dict(exclude_layers=["norm"]), "2 saved but not cached here"),
    ],
)
def test_loading_into_a_manager_built_otherwise_is_refused(change: dict, message: str) -> None:
    model, manager, optimizer = build(RECIPES["r100 error feedback"])
    run(model, manager, optimizer, range(2))
    state = manager.state_dict()
    manager.remove_hooks()
    other = build({**RECIPES["r100 error feedback"], **change})[1]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        other.load_state_dict(state)
    assert not other.engine.backend.residuals.current()  # refused before anything was loaded


def test_loading_needs_a_manager_with_nothing_pending() -> None:
    model, manager, _ = build(RECIPES["lossless"])
    state = manager.state_dict()
    loss_of(model, *DATA[0]).backward()
    with pytest.raises(RuntimeError, match="no step pending"):
        manager.load_state_dict(state)
    with pytest.raises(TypeError, match="expects the dict that"):
        manager.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="format_version 99"):
        manager.load_state_dict({**state, "format_version": 99})


@pytest.mark.parametrize(
    ("options", "old_recipe"),
    [
        # The int8 codec, once spelled value_dtype="int8" at ratio 1 with codec=None.
        (
            dict(compression_ratio=1, codec="int8"),
            dict(codec=None, value_dtype="int8", error_feedback=True, residual_dtype="int8"),
        ),
        # The ladder, whose recipe once carried top-k options that did nothing there.
        (
            dict(compression_ratio=100),
            dict(codec=None, value_dtype="int8", error_feedback=False, residual_dtype="float32"),
        ),
    ],
    ids=["int8 at ratio 1", "ladder"],
)
def test_a_checkpoint_saved_with_the_old_option_spelling_loads(
    options: dict, old_recipe: dict
) -> None:
    """Checkpoints from before the codec options moved onto the codec say the same run in
    other words: they load (format 3 both), and other settings are still refused."""
    model = make_model()
    state = gradient_cache.create_gradient_cache(model, **options).state_dict()
    state["recipe"] = state["recipe"] | old_recipe
    gradient_cache.create_gradient_cache(make_model(), **options).load_state_dict(state)
    state["recipe"]["warmup_steps"] = 5
    with pytest.raises(ValueError, match="warmup_steps: checkpoint 5, this manager 0"):
        gradient_cache.create_gradient_cache(make_model(), **options).load_state_dict(state)


@pytest.mark.parametrize("codec", ["int8", "q4"])
def test_a_clipped_fused_step_resumed_mid_accumulation_is_bit_for_bit(codec: str) -> None:
    """The clip of a step resumed between its micro-batches: the later micro-batches'
    encodes write their norms as the uninterrupted run's do (not read back from the
    quantized payloads: other bits)."""
    options = {"compression_ratio": 4, "codec": codec, "min_compress_numel": 1}

    def build_fused() -> tuple[torch.nn.Module, gradient_cache.GradientCacheHookManager, Any]:
        model = make_model()
        manager = gradient_cache.create_gradient_cache(model, **options)
        return model, manager, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, manager, optimizer, micro_batches: range) -> list[float]:
        norms = []
        for index in micro_batches:
            loss_of(model, *DATA[index]).backward()
            if index % MICRO_BATCHES == MICRO_BATCHES - 1:
                norms.append(manager.step(optimizer, max_grad_norm=0.05).item())
                optimizer.zero_grad()
        return norms

    cut = 2 * MICRO_BATCHES + 1  # a step's first micro-batch cached, the rest to come
    reference, reference_manager, reference_optimizer = build_fused()
    reference_norms = train(reference, reference_manager, reference_optimizer, range(cut))
    saved = save_and_load(reference, reference_manager, reference_optimizer)
    # The run that saved goes on: state_dict() drained it, as compress_and_free_gradients()
    # does, and the resumed run must continue it.
    end = range(cut, STEPS * MICRO_BATCHES)
    reference_norms += train(reference, reference_manager, reference_optimizer, end)
    model, manager, optimizer = build_fused()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    manager.load_state_dict(saved["cache"])
    norms = reference_norms[:2] + train(model, manager, optimizer, end)
    assert norms == reference_norms
    assert min(reference_norms) > 0.05  # the clip changed every step
    assert_same_parameters(reference, model)


@pytest.mark.parametrize(
    "codec", [{"codec": "int8"}, {"codec": "topk", "compression_ratio": 100}], ids=["int8", "topk"]
)
def test_a_checkpoint_between_backward_and_a_clipped_step_keeps_the_encodes_norms(
    codec: dict,
) -> None:
    """Saved after the backward, before a clipped fused step: the resumed step clipped by
    its payloads' norms, not the ones its encodes took from the gradients (7.63 for 7.53
    with int8, 5.28 for 7.28 with top-k, in a probe); the checkpoint carries them now."""

    def build_run():
        model = make_model()
        manager = gradient_cache.create_gradient_cache(model, min_compress_numel=1, **codec)
        return model, manager, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def run(save_at: int | None) -> tuple[torch.nn.Module, list[float]]:
        model, manager, optimizer = build_run()
        norms = []
        for index, (tokens, targets) in enumerate(batches(4)):
            loss_of(model, tokens, targets).backward()
            if index == save_at:
                saved = save_and_load(model, manager, optimizer)
                manager.remove_hooks()
                model, manager, optimizer = build_run()
                model.load_state_dict(saved["model"])
                optimizer.load_state_dict(saved["optimizer"])
                manager.load_state_dict(saved["cache"])
            norms.append(manager.step(optimizer, max_grad_norm=1.0).item())
            optimizer.zero_grad()
        manager.remove_hooks()
        return model, norms

    (uninterrupted, expected), (resumed, norms) = run(None), run(2)
    assert norms == expected
    assert_same_parameters(uninterrupted, resumed)


@pytest.mark.parametrize("scale_made", ["before the load", "after the load"])
def test_a_checkpoint_after_an_overflowing_backward_loads_and_its_step_is_skipped(
    scale_made: str,
) -> None:
    """Saved between an fp16 backward that overflowed and the clipped step its GradScaler
    skips: the encodes' norms are inf or NaN, as the gradients are. The load refused them
    as damage, and with the loaded scaler's scale made before the cache's load the resumed
    step stepped the non-finite gradients (two probes). Now it skips, as uninterrupted."""

    def build_run():
        model = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        manager = gradient_cache.create_gradient_cache(
            model, compression_ratio=1, grad_scaler=scaler
        )
        return model, manager, torch.optim.AdamW(model.parameters(), lr=1e-2), scaler

    def run(save_at: int | None) -> tuple[torch.nn.Module, list[float]]:
        model, manager, optimizer, scaler = build_run()
        scales = []
        for index, (tokens, targets) in enumerate(batches(4)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, tokens, targets) * (float("inf") if index == 2 else 1.0)
            scaler.scale(loss).backward()
            if index == save_at:
                saved = save_and_load(model, manager, optimizer)
                saved["scaler"] = scaler.state_dict()
                assert not all(n.isfinite() for n in saved["cache"]["pending_norms"].values())
                manager.remove_hooks()
                model, manager, optimizer, scaler = build_run()
                model.load_state_dict(saved["model"])
                optimizer.load_state_dict(saved["optimizer"])
                scaler.load_state_dict(saved["scaler"])
                # A loaded scaler makes its scale at its next scale(), as plain PyTorch's.
                if scale_made == "before the load":
                    scaler.scale(torch.zeros(()))
                manager.load_state_dict(saved["cache"])
                if scale_made == "after the load":
                    scaler.scale(torch.zeros(()))
            manager.step(optimizer, max_grad_norm=1.0)
            scaler.update()
            scales.append(scaler.get_scale())
            optimizer.zero_grad()
        manager.remove_hooks()
        return model, scales

    (uninterrupted, expected), (resumed, scales) = run(None), run(2)
    assert scales == expected and expected[2] < expected[1]  # the overflowed step skipped
    assert_same_parameters(uninterrupted, resumed)


@pytest.mark.parametrize("fused", [False, True], ids=["apply_gradients", "fused step"])
def test_state_dict_between_a_skipped_step_and_the_scaler_update_is_refused_unchanged(
    fused: bool,
) -> None:
    """state_dict() between a step the GradScaler skipped and ``scaler.update()`` settled
    the step as taken (its step count, draws and residuals kept): the saving run trained
    otherwise than one that never saved (a probe; int8 draws its rounding noise). Now it
    is refused and the run is the unsaved one bit for bit; a checkpoint after the update
    resumes bit for bit."""

    def build_run():
        model = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        manager = gradient_cache.create_gradient_cache(
            model, grad_scaler=scaler, min_compress_numel=1
        )
        return model, manager, torch.optim.AdamW(model.parameters(), lr=1e-2), scaler

    def run(save: bool) -> tuple[torch.nn.Module, int]:
        model, manager, optimizer, scaler = build_run()
        for index, (tokens, targets) in enumerate(batches(6)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, tokens, targets) * (float("inf") if index == 2 else 1.0)
            scaler.scale(loss).backward()
            if fused:
                manager.step(optimizer)
            else:
                manager.apply_gradients()
                scaler.step(optimizer)
            if save and index == 2:
                with pytest.raises(RuntimeError, match=r"after scaler\.update\(\)"):
                    manager.state_dict()
            scaler.update()
            if save and index == 2:  # the documented point: after the update
                saved = save_and_load(model, manager, optimizer)
                saved["scaler"] = scaler.state_dict()
                manager.remove_hooks()
                model, manager, optimizer, scaler = build_run()
                model.load_state_dict(saved["model"])
                optimizer.load_state_dict(saved["optimizer"])
                scaler.load_state_dict(saved["scaler"])
                manager.load_state_dict(saved["cache"])
            optimizer.zero_grad()
        steps = manager.get_compression_summary()["steps"]
        manager.remove_hooks()
        return model, steps

    (unsaved, unsaved_steps), (resumed, steps) = run(False), run(True)
    assert steps == unsaved_steps == 5  # the skipped step not counted
    assert_same_parameters(unsaved, resumed)


@pytest.mark.parametrize("saved_keep", [True, False], ids=["saved keeping", "saved not keeping"])
@pytest.mark.parametrize("loaded_keep", [True, False], ids=["loaded keeping", "loaded not"])
def test_a_mid_step_top_k_state_resumes_under_either_keep_previous_residual(
    saved_keep: bool, loaded_keep: bool
) -> None:
    """A mid-step top-k state saved keeping the previous residual (the pending step's new
    one beside it) loaded into a manager with ``keep_previous_residual=False`` (an option a
    load may change) put the loaded pending residual over the newer current one at the
    step's end (a probe: 0.016 off). Each way now resumes as the uninterrupted run of the
    loading manager's option (keeping or not trains the same without a discard)."""

    def options(keep: bool) -> dict[str, Any]:
        return dict(compression_ratio=100, codec="topk", keep_previous_residual=keep)

    reference, reference_manager, optimizer = build(options(loaded_keep))
    run(reference, reference_manager, optimizer, range(STEPS * MICRO_BATCHES))
    cut = 2 * MICRO_BATCHES + 1  # the third step's first micro-batch cached
    model, manager, optimizer = build(options(saved_keep))
    run(model, manager, optimizer, range(cut))
    saved = save_and_load(model, manager, optimizer)
    assert bool(saved["cache"]["pending_residuals"]) is saved_keep
    manager.remove_hooks()
    model, manager, optimizer = build(options(loaded_keep))
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    manager.load_state_dict(saved["cache"])
    run(model, manager, optimizer, range(cut, STEPS * MICRO_BATCHES))
    assert_same_parameters(reference, model)


def test_a_state_from_another_kind_of_device_goes_on_where_it_fits_and_says_what_restarts() -> None:
    """A state as a CUDA run saves it (edited here: its device type, and generator states of
    a Philox generator's 16 bytes, which a CPU generator refuses) loads on the CPU: the
    dither's draw counter, the same on every device, goes on; the generators restart from
    their seeds, named in a warning; a damaged counter is refused as on its own device."""
    options = dict(compression_ratio=100, codec="topk", value_dtype="int8")
    model, manager, optimizer = build(options)
    run(model, manager, optimizer, range(2 * MICRO_BATCHES + 1))  # the third step's first
    saved = save_and_load(model, manager, optimizer)
    manager.remove_hooks()
    cache = saved["cache"]
    counters = {n: s for n, s in cache["random_state"].items() if n.endswith(".values")}
    generators = sorted(set(cache["random_state"]) - set(counters))
    assert counters and generators and cache["random_state_at_step_start"]

    def as_cuda_saved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        philox = torch.zeros(16, dtype=torch.uint8)
        return {n: s if n in counters else philox for n, s in state.items()}

    from_cuda = dict(
        cache,
        random_device="cuda",
        random_state=as_cuda_saved(cache["random_state"]),
        random_state_at_step_start=as_cuda_saved(cache["random_state_at_step_start"]),
    )
    model, manager, optimizer = build(options)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    with pytest.warns(UserWarning, match="saved on a 'cuda' device and is loaded on 'cpu'") as seen:
        manager.load_state_dict(from_cuda)
    assert len(seen) == 1 and str(generators) in str(seen[0].message)
    engine = manager.engine
    assert engine is not None
    now = engine.codecs.random_state(torch.device("cpu"))
    assert set(now) == set(counters)  # the generators as new: nothing drawn since the seed
    assert all(torch.equal(now[n], counters[n]) for n in counters)
    run(model, manager, optimizer, range(2 * MICRO_BATCHES + 1, STEPS * MICRO_BATCHES))

    damaged = dict(from_cuda, random_state={**from_cuda["random_state"]})
    damaged["random_state"][next(iter(counters))] = torch.tensor([-1])
    _, fresh, _ = build(options)
    with pytest.raises(ValueError, match="draw counter"):
        fresh.load_state_dict(damaged)
