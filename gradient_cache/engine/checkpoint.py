"""The engine's state as plain tensors and numbers, and back: what a resumed run needs.

Every tensor is a CPU copy (a view of the pinned pool would save the whole slab), keyed
by parameter name, so ``torch.load(weights_only=True)`` reads it; each entry: `save`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..codecs import TopK, payload_from_state
from . import sharding, state_check
from .backend import Encoded
from .layout import contiguous_strides
from .pipeline import Pipeline
from .records import GradientAt
from .step_state import ADVICE, INTERRUPTED
from .users_line import outside_the_package

# 2: generators named by codec ("topk.selection"); the codec among the recipe fields.
# 3: int8 values draw their rounding noise from a dither (a draw counter, not a generator).
FORMAT_VERSION = 3
# The recipe's top-k options: the top-k codec's, or its defaults (`recipe`).
TOPK_FIELDS = ("error_feedback", "residual_dtype", "value_dtype")


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def recipe(pipeline: Pipeline) -> dict[str, Any]:
    """What must match between the saving and the loading manager: the options that change
    what a step computes, so what a saved residual or payload means (others, such as the
    bucket size, may differ). The top-k ones are the top-k codec's, or its defaults: what
    `EngineConfig` held when they were its fields, so old checkpoints load."""
    config = pipeline.config
    return {
        "compression_ratio": pipeline.ratio,
        "codec": config.codec_name,
        **{name: getattr(config.residual_options, name) for name in TOPK_FIELDS},
        "min_compress_numel": config.min_compress_numel,
        "warmup_steps": config.warmup_steps,
    }


def _as_today(saved: dict[str, Any]) -> dict[str, Any]:
    """A recipe saved before the codec options moved onto the codec, as said today: its
    top-k options never acted with ``codec=None``, but at ratio 1 ``value_dtype="int8"``
    chose the int8 codec, ``codec="int8"`` now."""
    if saved.get("codec") is not None:
        return saved
    today = saved | {name: getattr(TopK(), name) for name in TOPK_FIELDS}
    if saved.get("compression_ratio") == 1 and saved.get("value_dtype") == "int8":
        today["codec"] = "int8"
    return today


def save(pipeline: Pipeline) -> dict[str, Any]:
    """The pipeline's state; drains first, so every cached gradient is in host memory."""
    if pipeline.interrupted:
        raise RuntimeError(f"state_dict() cannot save the pending step: {ADVICE[INTERRUPTED]}.")
    # A step the GradScaler skipped is not saved as taken. Before its verdict is known (no
    # optimizer stepped, no `scaler.update()` yet), settling would guess "taken" and change
    # the saving run too: refused, with nothing changed.
    pipeline.settle_scaled_step(known_only=True)
    if pipeline.skips is not None and pipeline.skips.unsettled is not None:
        raise RuntimeError(
            "state_dict() was called after a restored step that stepped no optimizer (the "
            "GradScaler may have skipped it) and before scaler.update() told: call "
            "state_dict() after scaler.update(), as a plain checkpoint of the scaler needs."
        )
    pipeline.drain()
    pending = pipeline.pending
    norms = {} if pending is None or pending.norms is None else pending.norms.written()
    names = {param: record.name for param, record in pipeline.records.items()}
    residuals = pipeline.backend.residuals
    return {
        "format_version": FORMAT_VERSION,
        "recipe": recipe(pipeline),
        "parameters": list(names.values()),
        "shards": sharding.rank_and_world_size(),
        "steps": pipeline.steps,
        # The norm type the encodes compute: a resumed step clips by the norms the
        # uninterrupted one would, not the payloads' (with a lossy codec they differ).
        "clip_norm_type": pipeline.clip_norm_type,
        # The pending step's norms its encodes took (of that type), for the same reason.
        "pending_norms": {names[p]: _cpu(n) for p, n in norms.items()},
        "random_device": pipeline.backend.device.type,
        "random_state": pipeline.codecs.random_state(pipeline.backend.device),
        "random_state_at_step_start": None if pending is None else pending.random_state,
        "residuals": {names[p]: _cpu(r) for p, r in residuals.current().items()},
        "pending_residuals": {names[p]: _cpu(r) for p, r in residuals.pending().items()},
        "buckets": [
            [{"name": names[p], "payload": payload.state()} for p, payload in bucket]
            for bucket in pipeline.store.buckets()
        ],
        # Gradients a memory budget keeps on the device live only in `.grad` (no model or
        # optimizer checkpoint holds them): those of the pending step, whole, by name.
        "kept_gradients": {
            names[p]: _cpu(p.grad)
            for p, record in pipeline.records.items()
            if record.gradient is GradientAt.KEPT_ON_DEVICE and p.grad is not None
        },
        # Payloads and residuals are in memory order (`layout`): the layouts not contiguous.
        "layouts": {
            names[p]: list(route.stride)
            for p, route in pipeline.routes.items()
            if route.stride != contiguous_strides(route.shape)
        },
    }


def load(pipeline: Pipeline, state: Any) -> None:
    """Make ``pipeline`` continue from ``state``, or raise naming what does not match."""
    _check(pipeline, state)
    by_name = pipeline.params_by_name()
    device = pipeline.backend.device
    pipeline.restart_at(state["steps"])  # the routes (and pool) the saved step had
    pipeline.compute_norms(state.get("clip_norm_type"))  # absent: saved before it was kept
    random_state = _continuable(pipeline, state, "random_state")
    pipeline.codecs.set_random_state(device, random_state)
    pipeline.backend.residuals.load(
        {by_name[name]: saved for name, saved in state["residuals"].items()},
        {by_name[name]: saved for name, saved in state["pending_residuals"].items()},
    )

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        # A copy on the CPU too: the payload is the engine's own, not a view of the caller's
        # loaded dict (loaded again elsewhere, or edited), and written where it is ordered.
        return tensor.to(device, copy=True)

    kept = state.get("kept_gradients", {})  # absent: saved before they were carried
    if state["buckets"] or kept:
        at_start = "random_state_at_step_start"
        pipeline.resume(state[at_start] and _continuable(pipeline, state, at_start))
    found_inf = None if pipeline.pending is None else pipeline.pending.found_inf
    for saved_bucket in state["buckets"]:
        # Stored as backward stores any encoded gradient: moved to the device where its
        # encode would have left them, then copied into their host slots.
        params = [by_name[item["name"]] for item in saved_bucket]
        with pipeline.backend.encoding(params):
            encoded = [
                Encoded(param, payload_from_state(item["payload"]).moved(to_device), None)
                for param, item in zip(params, saved_bucket, strict=True)
            ]
            if found_inf is not None:  # the flag their encodes raised (a scaler skips on it)
                for item in encoded:
                    finite = torch.isfinite(item.payload.kept_values()).all()
                    torch.logical_or(found_inf, ~finite, out=found_inf)
        pipeline.launching()  # stored as a launch stores a bucket
        pipeline.capture.store_encoded(encoded, [])
    norms = None if pipeline.pending is None else pipeline.pending.norms
    if norms is not None:
        for name, norm in state.get("pending_norms", {}).items():  # absent: saved before kept
            norms.put(by_name[name], norm.to(device))
    # This manager's budget has not decided yet (it measures its own first steps), so it
    # offloads everything: the kept gradients too, cached as backward hands them over.
    for name, grad in kept.items():
        pipeline.capture.add(by_name[name], to_device(grad))
    pipeline.drain()


def _continuable(pipeline: Pipeline, state: dict[str, Any], key: str) -> dict[str, torch.Tensor]:
    """The generator states of ``state[key]`` the loading device continues from: every one
    where it was saved on this kind of device; else `Codecs.continuable`'s (a dither's
    counter; a CPU generator's on the emulated device), the others restarting from their
    seeds, said once: a CPU and a CUDA generator's states differ in kind."""
    saved: dict[str, torch.Tensor] = state[key]
    device = pipeline.backend.device
    if state["random_device"] == device.type:
        return saved
    kept = pipeline.codecs.continuable(device, saved)
    restarted = sorted(set(saved) - set(kept))
    if restarted and key == "random_state":
        warnings.warn(
            f"The gradient cache's state was saved on a {state['random_device']!r} device and "
            f"is loaded on {device.type!r}, whose generators cannot take the saved states of "
            f"{restarted}: they restart from their seeds, so the resumed run rounds "
            "randomly otherwise than the run that saved it would have. Load it on a "
            f"{state['random_device']!r} device to continue bit for bit.",
            UserWarning,
            stacklevel=outside_the_package(),
        )
    return kept


def _check(pipeline: Pipeline, state: Any) -> None:
    if not isinstance(state, dict) or "format_version" not in state:
        raise TypeError(
            "load_state_dict() expects the dict that GradientCacheHookManager.state_dict() "
            f"returned, got {type(state).__name__}."
        )
    version = state["format_version"]
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise ValueError(
            f"This checkpoint's gradient-cache state has format_version {version!r}; this "
            f"version reads {FORMAT_VERSION}"
            + (": it was saved by a newer gradient-cache, upgrade to load it." if newer else ".")
        )
    state_check.check_keys(state)
    if pipeline.step_pending:
        raise RuntimeError(
            "load_state_dict() needs a manager with no step pending: call it before the first "
            "backward, or after a restore (apply_gradients() or step())."
        )
    ours, saved = recipe(pipeline), _as_today(state["recipe"])
    differences = [
        f"{name}: checkpoint {saved.get(name)!r}, this manager {value!r}"
        for name, value in ours.items()
        if saved.get(name) != value
    ]
    if differences:
        raise ValueError(
            "The checkpoint's gradient cache was made with other settings ("
            + "; ".join(differences)
            + "). Create the manager with the checkpoint's settings to resume it."
        )
    if any(record.sharded for record in pipeline.records.values()):
        # Under FSDP2 each rank saves its own shards, whose sizes follow the world size.
        saved_shards = state["shards"]  # a pair of ints (`check_keys`)
        here_shards = sharding.rank_and_world_size()
        if tuple(saved_shards) != here_shards:
            raise ValueError(
                f"This gradient-cache state was saved by rank {saved_shards[0]} of "
                f"{saved_shards[1]} processes; this is rank {here_shards[0]} of "
                f"{here_shards[1]}. Each rank holds the state of its own shards: load each "
                "rank's own file, with the world size it was saved with."
            )
    saved_names, here_names = set(state["parameters"]), set(pipeline.params_by_name())
    if saved_names != here_names:
        missing, extra = sorted(saved_names - here_names), sorted(here_names - saved_names)
        compiled = ""
        if any("_orig_mod" in name.split(".") for name in (*missing, *extra)):
            # A whole compiled model is named as the model; a compiled submodule is not.
            compiled = (
                " Names with '_orig_mod' come from a submodule wrapped by torch.compile: "
                "to load this state, compile the same submodules as when it was saved. "
                "Runs that compile the whole model instead save plain names (the cache "
                "names a compiled model's parameters as the model's own)."
            )
        raise ValueError(
            "The checkpoint's gradient cache covers other parameters: "
            f"{len(missing)} saved but not cached here {missing[:3]}, {len(extra)} cached here "
            f"but not saved {extra[:3]}. Build the same model with the same exclude_layers "
            f"(and the same trainable parameters) as when it was saved.{compiled}"
        )
    state_check.check_contents(pipeline, state)
