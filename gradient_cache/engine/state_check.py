"""What a saved cache state must hold before the engine takes any of it.

Checkpoints are edited and truncated by other code: `check_contents` raises a ValueError
naming the first wrong key and what it expected, so a refused state changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..codecs import payload_from_state
from ..codecs.payloads import NARROW_FLOATS
from .layout import contiguous_strides
from .pipeline import Pipeline
from .route import Route

STATE_KEYS = frozenset(
    {
        "format_version",
        "recipe",
        "parameters",
        "shards",
        "steps",
        "random_device",
        "random_state",
        "random_state_at_step_start",
        "residuals",
        "pending_residuals",
        "buckets",
    }
)
# Keys a state may lack (saved before they existed), with what their absence means.
OPTIONAL_KEYS = frozenset(
    {
        "layouts",  # none: every parameter's layout was contiguous
        "clip_norm_type",  # none: the encodes computed no norms
        "kept_gradients",  # none: no gradient kept on the device by a memory budget
        "pending_norms",  # none: a resumed clipped step reads its payloads' norms
    }
)


def check_keys(state: dict[str, Any]) -> None:
    missing = sorted(STATE_KEYS - state.keys())
    extra = sorted(state.keys() - STATE_KEYS - OPTIONAL_KEYS)
    if missing or extra:
        raise ValueError(
            f"The gradient-cache state has missing keys {missing} and unknown keys {extra}; "
            f"expected exactly {sorted(STATE_KEYS)}, as state_dict() returns them. The file "
            "may be truncated or edited: load an intact checkpoint."
        )
    shards = state["shards"]
    pair = isinstance(shards, tuple | list) and len(shards) == 2 and _all(shards, int)
    for key, fits, expected in (
        ("recipe", isinstance(state["recipe"], dict), "a dict of settings"),
        ("parameters", _all(state["parameters"], str), "a list of parameter names"),
        ("shards", pair, "(rank, world size)"),
    ):
        if not fits:
            raise ValueError(f"state[{key!r}] is {state[key]!r:.80}; expected {expected}.")


def _all(values: Any, kind: type) -> bool:
    return isinstance(values, list | tuple) and all(isinstance(v, kind) for v in values)


def check_contents(pipeline: Pipeline, state: dict[str, Any]) -> None:
    """Raise ValueError at the first part of ``state`` `checkpoint.load` could not take
    as it is (settings and parameter names are checked before this)."""
    steps = state["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"state['steps'] is {steps!r}; expected a whole number >= 0.")
    norm_type = state.get("clip_norm_type")
    if norm_type is not None and (
        isinstance(norm_type, bool) or not isinstance(norm_type, int | float) or not norm_type > 0
    ):
        raise ValueError(f"state['clip_norm_type'] is {norm_type!r}; expected None or a norm > 0.")
    if not isinstance(state["random_device"], str):
        raise ValueError(
            f"state['random_device'] is {state['random_device']!r}; expected a device type "
            "such as 'cpu' or 'cuda'."
        )
    by_name = pipeline.params_by_name()
    if state["random_device"] == pipeline.backend.device.type:  # else they are not used
        _check_random_state(pipeline, state, "random_state")
        if state["random_state_at_step_start"] is not None:
            _check_random_state(pipeline, state, "random_state_at_step_start")
    # The routes the saved step had (the warm-up may have ended since): what its parts hold.
    routes = pipeline.plan.at(steps)
    for key in ("residuals", "pending_residuals"):
        for name, stored in _named_tensors(state[key], key, by_name):
            route = routes[by_name[name]]
            if route.residual is None:
                raise ValueError(
                    f"state[{key!r}][{name!r}]: this manager keeps no residual for {name} "
                    "(its codec has no error feedback); expected no entry for it."
                )
            numel, dtype = route.residual.stored_shape(route.numel)
            _check_tensor(stored, f"state[{key!r}][{name!r}]", shape=(numel,), dtype=dtype)
            if not torch.isfinite(route.residual.decode(stored, route.numel)).all():
                raise ValueError(
                    f"state[{key!r}][{name!r}] holds non-finite values; a residual is always "
                    "finite (a step with inf or NaN restarts it from zero): the file is damaged."
                )
    cached = _check_buckets(state["buckets"], by_name, routes)
    _check_kept_gradients(state, by_name, cached)
    _check_pending_norms(state, by_name)
    _check_layouts(state, by_name, routes, cached)


def _check_pending_norms(state: dict[str, Any], by_name: dict[str, Any]) -> None:
    """Each saved norm a real number >= 0 on the CPU, of a parameter cached: inf or NaN
    where the gradients overflowed (a GradScaler's step to skip)."""
    for name, norm in _named_tensors(state.get("pending_norms", {}), "pending_norms", by_name):
        if (
            not isinstance(norm, torch.Tensor)
            or norm.device.type != "cpu"
            or norm.numel() != 1
            or norm.is_complex()
            or bool(norm < 0)
        ):
            raise ValueError(
                f"state['pending_norms'][{name!r}] is {_describe(norm)}; expected a norm "
                ">= 0 (inf or NaN after an overflow), a one-element CPU tensor."
            )


def _check_kept_gradients(state: dict[str, Any], by_name: dict[str, Any], cached: set[str]) -> None:
    """Each kept gradient whole, in its parameter's shape and dtype, in no bucket too."""
    for name, grad in _named_tensors(state.get("kept_gradients", {}), "kept_gradients", by_name):
        param = by_name[name]
        where = f"state['kept_gradients'][{name!r}]"
        if name in cached:
            raise ValueError(f"{where}: {name} is in state['buckets'] too; expected one of them.")
        _check_tensor(grad, where, shape=tuple(param.shape), dtype=param.dtype)


def _check_layouts(
    state: dict[str, Any], by_name: dict[str, Any], routes: dict[Any, Route], cached: set[str]
) -> None:
    """Saved gradients and residuals are in their parameter's memory order (`layout`): they
    mean the same here only where the parameter has the layout it had when saved."""
    layouts = state.get("layouts", {})
    if not isinstance(layouts, dict) or not all(
        name in by_name and _all(stride, int) for name, stride in layouts.items()
    ):
        raise ValueError(
            f"state['layouts'] is {layouts!r:.80}; expected a dict of cached parameter names "
            "to strides."
        )
    for name in sorted({*state["residuals"], *state["pending_residuals"], *cached}):
        route = routes[by_name[name]]
        stride = tuple(layouts.get(name, contiguous_strides(route.shape)))
        if stride != route.stride:
            raise ValueError(
                f"state['layouts'][{name!r}]: {name}'s cached gradient or residual was saved "
                f"in the memory layout of strides {stride}; here {name} has strides "
                f"{route.stride}, so its entries would be read in another order. Give the "
                "model the memory format it had when saved (model.to(memory_format=...)) "
                "before creating the cache."
            )


def _check_random_state(pipeline: Pipeline, state: dict[str, Any], key: str) -> None:
    sources = pipeline.codecs.random_sources()
    states = state[key]
    if not isinstance(states, dict):
        raise ValueError(f"state[{key!r}] is a {type(states).__name__}; expected a dict.")
    for name, saved in states.items():
        if name not in sources:
            raise ValueError(
                f"state[{key!r}] has a generator {name!r} this manager does not have; "
                f"expected some of {sorted(sources)}."
            )
        if not isinstance(saved, torch.Tensor) or saved.device.type != "cpu":
            raise ValueError(
                f"state[{key!r}][{name!r}] is {_describe(saved)}; expected a CPU tensor."
            )
        problem = sources[name].state_problem(pipeline.backend.device, saved)
        if problem is not None:
            raise ValueError(f"state[{key!r}][{name!r}]: {problem}.")


def _named_tensors(entries: Any, key: str, by_name: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    if not isinstance(entries, dict):
        raise ValueError(f"state[{key!r}] is a {type(entries).__name__}; expected a dict.")
    for name, tensor in entries.items():
        if name not in by_name:
            raise ValueError(
                f"state[{key!r}] names {name!r}, which this manager does not cache; expected "
                "names from state['parameters']."
            )
        yield name, tensor


def _check_tensor(tensor: Any, where: str, *, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.device.type != "cpu"
        or tensor.dtype != dtype
        or tuple(tensor.shape) != shape
    ):
        raise ValueError(
            f"{where} is {_describe(tensor)}; expected a CPU {dtype} tensor of shape {shape}."
        )


def _check_buckets(
    buckets: Any, by_name: dict[str, Any], routes: dict[torch.nn.Parameter, Route]
) -> set[str]:
    """Each bucket's payloads readable, each a cached parameter's; returns their names."""
    if not isinstance(buckets, list):
        raise ValueError(f"state['buckets'] is a {type(buckets).__name__}; expected a list.")
    seen: set[str] = set()
    for number, bucket in enumerate(buckets):
        if not isinstance(bucket, list):
            raise ValueError(f"state['buckets'][{number}] is not a list of cached gradients.")
        for item in bucket:
            where = f"state['buckets'][{number}]"
            if not isinstance(item, dict) or set(item) != {"name", "payload"}:
                raise ValueError(f"{where} holds {item!r:.80}; expected {{'name', 'payload'}}.")
            name = item["name"]
            if name not in by_name or name in seen:
                raise ValueError(
                    f"{where} caches {name!r}, which this manager does not cache or which "
                    "another bucket caches too."
                )
            seen.add(name)
            _check_payload(item["payload"], f"{where} ({name})", routes[by_name[name]])
    return seen


def _check_payload(saved: Any, where: str, route: Any) -> None:
    try:
        payload = payload_from_state(saved)
        tensors = payload.tensors()
        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError("a tensor is not on the CPU")
        if payload.kind == "dense" and len({t.dtype for t in tensors}) > 1:
            raise ValueError("a dense payload's two micro-batches differ in dtype")
        values = payload.kept_values()
        indices = payload.kept_indices()
    except (KeyError, TypeError, AttributeError, ValueError, RuntimeError, IndexError) as error:
        raise ValueError(
            f"{where}: the saved payload cannot be read ({type(error).__name__}: {error}); "
            "the file is damaged or edited."
        ) from error
    expected_kept = route.numel if indices is None else indices.numel()
    if (
        payload.numel != route.numel
        or not _carries(values.dtype, payload.kind, route.dtype)
        or values.numel() != expected_kept
        or (indices is not None and not _within(indices, route.numel))
    ):
        raise ValueError(
            f"{where}: the payload holds {values.numel()} {values.dtype} values of a "
            f"{payload.numel}-entry gradient; expected a gradient of {route.numel} "
            f"{route.dtype} entries, every index below {route.numel}."
        )


def _carries(dtype: torch.dtype, kind: str, route_dtype: torch.dtype) -> bool:
    """Whether a payload's values in ``dtype`` are a gradient of ``route_dtype``: its own,
    or a compute dtype's lossless one, carried as it came (`capture.Capture._carried`)."""
    carried = kind == "dense" and dtype in NARROW_FLOATS and route_dtype == torch.float32
    return dtype == route_dtype or carried


def _within(indices: torch.Tensor, numel: int) -> bool:
    return indices.numel() == 0 or bool(indices.min() >= 0 and indices.max() < numel)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.device.type} {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
