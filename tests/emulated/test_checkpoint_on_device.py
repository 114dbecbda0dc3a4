"""The cache's ``state_dict()`` / ``load_state_dict()`` on the emulated device: saved
between two micro-batches of a step (gradients cached in the pinned pool, the codec's
random state, error feedback's residuals, the optimizer's state on the host), loaded into
a new model, optimizer and cache on the device, the run ends bit for bit as the
uninterrupted one."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from helpers import (
    CHECKPOINT_DATA,
    CHECKPOINT_MICRO_BATCHES,
    CHECKPOINT_STEPS,
    loss_of,
    make_model,
    save_and_load,
)

import gradient_cache
from gradient_cache.engine.accelerator import AcceleratorBackend

MICRO_BATCHES = CHECKPOINT_STEPS * CHECKPOINT_MICRO_BATCHES
CUT = 2 * CHECKPOINT_MICRO_BATCHES + 1  # the third step's first micro-batch cached
CLIP = 0.05
RECIPES = {
    # The default: the ladder at ratio 3 (int8 codes for fp32, rounded stochastically
    # from the engine's generators, whose state the checkpoint carries; no residual).
    "default int8": dict(),
    # Top-k with error feedback: an int8 residual per parameter in the pinned pool.
    "top-k error feedback": dict(compression_ratio=100, codec="topk"),
    "lossless": dict(compression_ratio=1),
    # The fused step, clipped, with the optimizer's state in host memory.
    "lossless, state on the host": dict(
        compression_ratio=1, offload_optimizer_state=True, bucket_size_mb=0.004
    ),
}
LOSSLESS = ("lossless", "lossless, state on the host")


def fused(options: dict) -> bool:
    return options.get("offload_optimizer_state", False)


def build(device: torch.device, options: dict):
    model, manager, optimizer = build_anywhere(device, options)
    assert isinstance(manager.engine.backend, AcceleratorBackend)
    return model, manager, optimizer


def build_anywhere(device: torch.device, options: dict):
    model = make_model().to(device)
    manager = gradient_cache.create_gradient_cache(model, min_compress_numel=1, **options)
    return model, manager, torch.optim.Adam(model.parameters(), lr=1e-2)


def run(model, manager, optimizer, indices: range, *, options: dict) -> None:
    """Micro-batches ``indices`` of CHECKPOINT_DATA, a step after each pair: plain
    (``manager`` None), compress, apply and step, or the clipped fused step."""
    device = next(model.parameters()).device
    for index in indices:
        tokens, targets = (t.to(device) for t in CHECKPOINT_DATA[index])
        loss_of(model, tokens, targets).backward()
        if manager is not None and not fused(options):
            manager.compress_and_free_gradients()
        if index % CHECKPOINT_MICRO_BATCHES != CHECKPOINT_MICRO_BATCHES - 1:
            continue
        if manager is None:
            if fused(options):
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
        elif fused(options):
            manager.step(optimizer, max_grad_norm=CLIP)
        else:
            manager.apply_gradients()
            optimizer.step()
        optimizer.zero_grad()


def assert_same_parameters(left, right) -> None:
    for (name, a), b in zip(left.named_parameters(), right.parameters(), strict=True):
        same = torch.equal(a.cpu(), b.cpu())
        assert same, f"{name} differs by {(a.cpu() - b.cpu()).abs().max().item()}"


def cpu_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in cpu_tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in cpu_tensors(v)]
    return []


def reference_and_saved_mid_accumulation(
    device: torch.device, options: dict, *, saved_on: torch.device | None = None
) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """The uninterrupted run's model on ``device``; a second run's model and its checkpoint
    (model, optimizer, cache) saved at `CUT` micro-batches on ``saved_on`` (``device``),
    its manager closed."""
    reference, reference_manager, reference_optimizer = build_anywhere(device, options)
    run(reference, reference_manager, reference_optimizer, range(MICRO_BATCHES), options=options)
    model, manager, optimizer = build_anywhere(saved_on or device, options)
    run(model, manager, optimizer, range(CUT), options=options)
    saved = save_and_load(model, manager, optimizer)
    manager.remove_hooks()
    return reference, model, saved


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_run_resumed_mid_accumulation_continues_bit_for_bit(
    device: torch.device, recipe: str
) -> None:
    options = RECIPES[recipe]
    reference, model, saved = reference_and_saved_mid_accumulation(device, options)
    cache = saved["cache"]
    assert cache["buckets"]  # the step's first micro-batch, cached
    assert all(t.device.type == "cpu" for t in cpu_tensors(cache))  # nothing of the device's
    if recipe == "default int8":
        assert cache["random_state"]  # the stochastic rounding's generators
    if recipe == "top-k error feedback":
        names = {name for name, _ in model.named_parameters()}
        assert set(cache["residuals"]) == names
    if recipe != "lossless" and recipe in LOSSLESS:
        state = saved["optimizer"]["state"]
        assert state and all(t.device.type == "cpu" for t in cpu_tensors(state))

    model, manager, optimizer = build(device, options)
    model.load_state_dict(saved["model"])
    if fused(options):
        manager.offload_state_of(optimizer)
    optimizer.load_state_dict(saved["optimizer"])
    manager.load_state_dict(cache)
    run(model, manager, optimizer, range(CUT, MICRO_BATCHES), options=options)
    assert_same_parameters(reference, model)
    assert manager.get_compression_summary()["steps"] == CHECKPOINT_STEPS

    plain = make_model().to(device)
    run(
        plain,
        None,
        torch.optim.Adam(plain.parameters(), lr=1e-2),
        range(MICRO_BATCHES),
        options=options,
    )
    if recipe in LOSSLESS:
        assert_same_parameters(plain, model)
    else:  # the codec acted: the check above compares more than plain runs
        assert any(
            not torch.equal(a, b)
            for a, b in zip(plain.parameters(), model.parameters(), strict=True)
        )


@pytest.mark.parametrize("saved_keep", [True, False], ids=["saved keeping", "saved not keeping"])
@pytest.mark.parametrize("loaded_keep", [True, False], ids=["loaded keeping", "loaded not"])
def test_a_mid_step_top_k_state_resumes_under_either_keep_previous_residual(
    device: torch.device, saved_keep: bool, loaded_keep: bool
) -> None:
    """The residuals in the pinned pool: a pending residual saved beside the current one,
    loaded into a manager with ``keep_previous_residual=False`` (no spare slot), was marked
    pending in the current slot, and the step's end swapped it with the missing spare.
    Each way now resumes as the uninterrupted run of the loading manager's option."""

    def options(keep: bool) -> dict:
        return dict(compression_ratio=100, codec="topk", keep_previous_residual=keep)

    reference, reference_manager, reference_optimizer = build(device, options(loaded_keep))
    run(reference, reference_manager, reference_optimizer, range(MICRO_BATCHES), options={})
    model, manager, optimizer = build(device, options(saved_keep))
    run(model, manager, optimizer, range(CUT), options={})
    saved = save_and_load(model, manager, optimizer)
    assert bool(saved["cache"]["pending_residuals"]) is saved_keep
    manager.remove_hooks()
    model, manager, optimizer = build(device, options(loaded_keep))
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    manager.load_state_dict(saved["cache"])
    run(model, manager, optimizer, range(CUT, MICRO_BATCHES), options={})
    assert_same_parameters(reference, model)


@pytest.mark.parametrize("trained_first", [False, True], ids=["fresh", "trained first"])
def test_a_load_leaves_exactly_the_states_residuals(
    device: torch.device, trained_first: bool
) -> None:
    """A state that lists no residual for a parameter (saved with the residuals on the
    device, an option a load may change, before any step) loaded into a manager keeping
    them in the pinned pool left that manager's own residuals in place where it had trained
    before the load (a probe: 0.026 off); the CPU backend replaced them all. Now the load
    leaves only the state's: the run is the uninterrupted one from the same start."""
    options = dict(compression_ratio=100, codec="topk")
    reference, reference_manager, reference_optimizer = build(device, options)
    run(reference, reference_manager, reference_optimizer, range(MICRO_BATCHES), options={})

    saver, saver_manager, _ = build(device, {**options, "residual_location": "device"})
    state = saver_manager.state_dict()
    assert not state["residuals"]
    start = {name: value.clone() for name, value in saver.state_dict().items()}
    saver_manager.remove_hooks()

    model, manager, optimizer = build(device, options)
    if trained_first:
        run(model, manager, optimizer, range(CUT - 1), options={})
        assert any(r.any() for r in manager.state_dict()["residuals"].values())
    model.load_state_dict(start)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager.load_state_dict(state)
    assert not any(r.any() for r in manager.state_dict()["residuals"].values())
    run(model, manager, optimizer, range(MICRO_BATCHES), options={})
    assert_same_parameters(reference, model)


def more_kept(payload: dict) -> None:
    """Four more (value, index) pairs than top-k keeps, each index in range and unique."""
    taken = set(payload["indices"].tolist())
    extra = [index for index in range(payload["numel"]) if index not in taken][:4]
    payload["values"] = torch.cat([payload["values"], torch.zeros(len(extra))])
    payload["indices"] = torch.cat(
        [payload["indices"], torch.tensor(extra, dtype=payload["indices"].dtype)]
    )


def more_codes(payload: dict) -> None:
    payload["packed"] = torch.cat([payload["packed"], torch.zeros(4, dtype=torch.uint8)])


@pytest.mark.parametrize(
    ("recipe", "damage", "excerpt"),
    [
        ("top-k error feedback", more_kept, "payload['indices'] is a cpu torch.int32 tensor"),
        ("default int8", more_codes, "payload['packed'] is a cpu torch.uint8 tensor"),
    ],
    ids=["top-k kept more", "int8 codes longer"],
)
def test_a_payload_larger_than_its_slot_is_refused_before_the_load_starts(
    device: torch.device, recipe: str, damage, excerpt: str
) -> None:
    """A payload longer than its codec makes would fail its copy into the pinned slot
    halfway through the load, a step left pending on a slot never written: it is refused
    by name first, and the same manager then resumes the intact state bit for bit."""
    options = RECIPES[recipe]
    reference, _, saved = reference_and_saved_mid_accumulation(device, options)
    damaged = copy.deepcopy(saved["cache"])
    damage(
        max((i for b in damaged["buckets"] for i in b), key=lambda i: i["payload"]["numel"])[
            "payload"
        ]
    )

    model, manager, optimizer = build(device, options)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    with pytest.raises(ValueError, match=re.escape(excerpt)):
        manager.load_state_dict(damaged)
    assert not manager.engine.step_pending
    manager.load_state_dict(saved["cache"])
    run(model, manager, optimizer, range(CUT, MICRO_BATCHES), options=options)
    assert_same_parameters(reference, model)


CROSS_DEVICE = {
    # The dither's draw counter: the same state on every device.
    "default int8": RECIPES["default int8"],
    # Exact selection (auto's is the threshold on a CPU) and an int8 residual rounded from a
    # generator: a CPU generator on the emulated device too, so its state fits either.
    "top-k exact, error feedback": dict(compression_ratio=100, codec="topk", selection="exact"),
}


@pytest.mark.parametrize("recipe", list(CROSS_DEVICE))
@pytest.mark.parametrize("saved_on", ["cpu", "device"])
def test_a_run_saved_on_another_kind_of_device_resumes_bit_for_bit(
    device: torch.device, recipe: str, saved_on: str
) -> None:
    """Saved mid-accumulation on the CPU and loaded on the device, or the reverse: the
    codecs' random state goes on where it was (a load on another kind of device restarted
    it from the seeds: 3.4e-3 off after two steps, silently)."""
    options = CROSS_DEVICE[recipe]
    cpu = torch.device("cpu")
    saving, loading = (cpu, device) if saved_on == "cpu" else (device, cpu)
    reference, _, saved = reference_and_saved_mid_accumulation(loading, options, saved_on=saving)
    assert saved["cache"]["random_state"] and saved["cache"]["buckets"]

    model, manager, optimizer = build_anywhere(loading, options)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing restarts: nothing to warn of
        manager.load_state_dict(saved["cache"])
    run(model, manager, optimizer, range(CUT, MICRO_BATCHES), options=options)
    assert_same_parameters(reference, model)
