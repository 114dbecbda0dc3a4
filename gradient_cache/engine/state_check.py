"""What a saved cache state must hold before the engine takes any of it.

Checkpoints are edited and truncated by other code: `check_contents` raises a ValueError
naming the first wrong key and what it expected, so a refused state changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree

from ..codecs import (
    BlockQuantized,
    Codec,
    Int8Values,
    TopKCodec,
    block_kernels,
    index_dtype,
    payload_from_state,
)
from ..codecs.int8_kernels import INT8_BLOCK, int8_blocks_bytes
from ..codecs.payloads import (
    NARROW_FLOATS,
    BlockCodesPayload,
    DensePayload,
    Payload,
    QuantizedPayload,
    SparsePayload,
)
from ..codecs.rotation import ROTATION_BLOCK
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
    tensors = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    elsewhere = sorted({str(t.device) for t in tensors if t.device.type != "cpu"})
    if elsewhere:
        raise ValueError(
            f"The state holds tensors on {', '.join(elsewhere)}; `state_dict()` saves CPU "
            "tensors: read the checkpoint with torch.load(path, map_location='cpu')."
        )
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
    same_kind = state["random_device"] == pipeline.backend.device.type
    _check_random_state(pipeline, state, "random_state", same_kind=same_kind)
    if state["random_state_at_step_start"] is not None:
        _check_random_state(pipeline, state, "random_state_at_step_start", same_kind=same_kind)
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
    cached = _check_buckets(state["buckets"], by_name, routes, pipeline.config.compute_dtype)
    _check_residuals_of_cached(state, by_name, routes, cached)
    _check_kept_gradients(state, by_name, cached)
    _check_pending_norms(state, by_name)
    _check_layouts(state, by_name, routes, cached)


def _check_residuals_of_cached(
    state: dict[str, Any], by_name: dict[str, Any], routes: dict[Any, Route], cached: set[str]
) -> None:
    """Each cached payload's encode wrote its parameter's residual, where its codec keeps
    one: a pending one beside the current where the saving manager kept the previous
    residual (it saved pending ones), else the current. The loading manager's own option
    may differ (`residuals.ResidualStore.load` takes either)."""
    key = "pending_residuals" if state["pending_residuals"] else "residuals"
    for name in sorted(cached):
        route = routes[by_name[name]]
        if route.codec.residual is not None and name not in state[key]:
            raise ValueError(
                f"state[{key!r}] has no entry for {name!r}, whose gradient is cached in "
                f"state['buckets']: the encode that cached it wrote its residual there. The "
                "file is damaged or edited: load an intact checkpoint."
            )


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


def _check_random_state(
    pipeline: Pipeline, state: dict[str, Any], key: str, *, same_kind: bool
) -> None:
    """Each saved state is a CPU tensor of a source this manager has, and fits it, but a
    generator's saved on another kind of device (its generator restarts: `load`)."""
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
        if problem is not None and (same_kind or sources[name].portable):
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
    buckets: Any,
    by_name: dict[str, Any],
    routes: dict[torch.nn.Parameter, Route],
    compute_dtype: torch.dtype | None,
) -> set[str]:
    """Each bucket's payloads as its route's codec makes them, each a cached parameter's;
    returns their names. ``compute_dtype``: the manager's (`EngineConfig.compute_dtype`)."""
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
            _check_payload(
                item["payload"], f"{where} ({name})", routes[by_name[name]], compute_dtype
            )
    return seen


def _check_payload(saved: Any, where: str, route: Route, compute_dtype: torch.dtype | None) -> None:
    """``saved`` is a payload of ``route``'s codec, every tensor checked before any of it
    is decoded: a compiled decode trusts their shapes and lengths (a wrong one crashes the
    process), and a host slot's copy fails halfway through a load."""
    try:
        payload = payload_from_state(saved)
        payload.tensors()
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise ValueError(
            f"{where}: the saved payload cannot be read ({type(error).__name__}: {error}); "
            "the file is damaged or edited."
        ) from error
    kind = _payload_kind(route.codec)
    if payload.kind != kind:
        raise ValueError(
            f"{where} payload['kind'] is {payload.kind!r}; this manager's codec "
            f"{route.codec.name!r} makes {kind!r} payloads of it: the file is damaged or edited."
        )
    for field, fits, expected in _payload_fields(payload, route, compute_dtype):
        if not fits:
            value = getattr(payload, field)
            shown = _describe(value) if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(
                f"{where} payload[{field!r}] is {shown:.80}; expected {expected} (a gradient of "
                f"{route.numel} {route.dtype} entries, codec {route.codec.name!r}): the file "
                "is damaged or edited."
            )


def _payload_kind(codec: Codec) -> str:
    """The `Payload.kind` ``codec`` encodes to."""
    if isinstance(codec, TopKCodec):
        return "sparse" if codec.quantizer is None else "quantized"
    if isinstance(codec, BlockQuantized):
        return "block_codes"
    return "quantized" if isinstance(codec, Int8Values) else "dense"


def _payload_fields(
    payload: Payload, route: Route, compute_dtype: torch.dtype | None
) -> Iterator[tuple[str, bool, str]]:
    """(field, whether it is as ``route`` makes it, what it must be) of each of ``payload``'s
    fields, in order: a tensor's length is checked only once the fields it follows from are."""
    numel, dtype = route.numel, route.dtype
    if isinstance(payload, DensePayload):
        # A compute dtype's gradient crosses as it came (`capture.Capture._carried`).
        narrow = (
            compute_dtype if dtype == torch.float32 and compute_dtype in NARROW_FLOATS else None
        )
        dtypes = (dtype,) if narrow is None else (dtype, narrow)
        yield "tensor", _flat(payload.tensor, numel, dtypes), _flat_text(numel, dtypes)
        if payload.earlier is not None:  # an earlier micro-batch's part: a carried one's
            same = (narrow,) if narrow is not None and payload.tensor.dtype == narrow else ()
            yield (
                "earlier",
                _flat(payload.earlier, numel, same),
                (
                    f"None, or {_flat_text(numel, same)} beside a {narrow} 'tensor'"
                    if same
                    else "None (only a compute dtype's gradient has an earlier part)"
                ),
            )
        return
    yield "numel", _whole(payload.numel) and payload.numel == numel, f"{numel}"
    if isinstance(payload, BlockCodesPayload):
        block_codec = cast(BlockQuantized, route.codec)
        yield "dtype", payload.dtype == dtype, f"{dtype}"
        yield (
            "bits",
            _whole(payload.bits) and payload.bits == block_codec.bits,
            f"{block_codec.bits}",
        )
        yield "rotated", payload.rotated is block_codec.rotate, f"{block_codec.rotate}"
        size = block_kernels.encoded_bytes(numel, block_codec.bits)
        yield (
            "packed",
            _flat(payload.packed, size, (torch.uint8,)),
            _flat_text(size, (torch.uint8,)),
        )
        blocks = block_kernels.padded_numel(numel) // ROTATION_BLOCK
        yield "packed", _scales_valid(payload.packed, blocks), _SCALES
        return
    if isinstance(payload, SparsePayload | QuantizedPayload):
        indices = payload.indices
        topk = route.codec if isinstance(route.codec, TopKCodec) else None
        yield (
            "indices",
            (indices is None) == (topk is None),
            "None (the int8 codec keeps every entry)" if topk is None else "the kept indices",
        )
        if indices is None or topk is None:  # the int8 codec's: every entry
            kept: Any = numel
        else:
            kept = indices.numel() if isinstance(indices, torch.Tensor) else None
            index = (index_dtype(numel),)
            yield (
                "indices",
                _flat(indices, kept, index) and _counted(topk, numel, dtype, kept),
                _flat_text(_kept_text(topk, numel, dtype), index),
            )
            yield "indices", _unique_within(indices, numel), f"unique indices below {numel}"
        if isinstance(payload, SparsePayload):
            yield "values", _flat(payload.values, kept, (dtype,)), _flat_text(kept, (dtype,))
            return
        yield "dtype", payload.dtype == dtype, f"{dtype}"
        yield "count", _whole(payload.count) and payload.count == kept, f"{kept}"
        size = int8_blocks_bytes(kept)
        yield (
            "packed",
            _flat(payload.packed, size, (torch.uint8,)),
            _flat_text(size, (torch.uint8,)),
        )
        yield "packed", _scales_valid(payload.packed, -(-kept // INT8_BLOCK)), _SCALES


_SCALES = "codes followed by block scales >= 0 (the encoder makes no negative one)"


def _flat(tensor: Any, numel: Any, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether ``tensor`` is a contiguous 1-D CPU tensor of ``numel`` entries, of ``dtypes``."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type == "cpu"
        and tensor.dtype in dtypes
        and tensor.dim() == 1
        and tensor.numel() == numel
        and tensor.is_contiguous()
    )


def _flat_text(numel: Any, dtypes: tuple[torch.dtype, ...]) -> str:
    kinds = " or ".join(str(dtype) for dtype in dtypes)
    return f"a contiguous 1-D CPU {kinds} tensor of {numel} entries"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _counted(codec: TopKCodec, numel: int, dtype: torch.dtype, kept: int) -> bool:
    """Whether top-k ``codec`` may keep ``kept`` entries: exactly its count with the exact
    selection; the threshold's count varies (all of a non-finite sample's entries, say)."""
    if codec.encoder.selector.method == "exact":
        return kept == codec.kept_for(numel, dtype)
    return kept <= numel


def _kept_text(codec: TopKCodec, numel: int, dtype: torch.dtype) -> str:
    """The entries `_counted` takes, in words."""
    if codec.encoder.selector.method == "exact":
        return f"{codec.kept_for(numel, dtype)} (what top-k keeps of {numel})"
    return f"at most {numel}"


def _unique_within(indices: torch.Tensor, numel: int) -> bool:
    """No index twice (a restore copies each value to its index: a second one would drop
    the first) and every one below ``numel``."""
    if indices.numel() == 0:
        return True
    within = bool(indices.min() >= 0 and indices.max() < numel)
    return within and torch.unique(indices).numel() == indices.numel()


def _scales_valid(packed: torch.Tensor, blocks: int) -> bool:
    """Whether the ``blocks`` fp32 scales ending ``packed`` are none negative (NaN is an
    overflowed gradient's, which a GradScaler skips)."""
    scales = packed[packed.numel() - 4 * blocks :].view(torch.float32)
    return not bool((scales < 0).any())


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.device.type} {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
