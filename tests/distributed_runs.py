"""What each process of a 2-process gloo pair runs for tests/test_distributed.py.

A pair is expensive to start (two interpreters importing torch), so one pair runs many
scenarios: each is a function of the rank returning a value that can be pickled, and
every rank writes ``{scenario: value or the error's text}`` to ``results_<rank>.pt``.
Each training run is compared with plain FSDP2 on the same seed and the same data.
"""

from __future__ import annotations

import io
import os
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

import gradient_cache

WORLD = 2
STEPS = 4
CLIP = 0.05  # below the gradients' norm (about 0.3), so clipping changes the step


class Net(nn.Module):
    """Two blocks sharded on their own, and an input layer and a head in the root group.

    The head's 5 rows split 3 + 2 across two ranks: uneven shards.
    """

    def __init__(self, depth: int = 2, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 128)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(depth)]
        )
        self.head = nn.Linear(128, 5)
        self.checkpointed = checkpointed
        self.exit_after = depth  # the blocks a forward runs (fewer: an early exit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks[: self.exit_after]:  # checkpointed: reruns in backward
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def plain_net(seed: int = 0, **shape: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**shape)


def sharded(model: nn.Module, **fsdp: Any) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, **fsdp)
    fully_shard(model, **fsdp)
    return model


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's data: different on each rank, the same in every run."""
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + micro)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 5, generator=generator)


def train(
    model: nn.Module,
    *,
    cache: gradient_cache.GradientCacheHookManager | None = None,
    fused: bool = False,
    clip: float | None = None,
    micro_batches: int = 1,
    no_sync: bool = False,
    steps: int = STEPS,
    optimizer: torch.optim.Optimizer | None = None,
    first_step: int = 0,
) -> dict[str, Any]:
    """The user's loop; with ``cache``, its calls (``fused``: ``cache.step``)."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        for micro in range(micro_batches):
            if no_sync:  # FSDP2's own accumulation: reduce only on the last micro-batch
                model.set_requires_gradient_sync(micro == micro_batches - 1)
            x, y = batch(step, micro)
            loss = nn.functional.mse_loss(model(x).float(), y) / micro_batches
            loss.backward()
            losses.append(loss.item())
        if cache is not None and fused:
            norms.append(cache.step(optimizer, max_grad_norm=clip))
        else:
            if cache is not None:
                cache.apply_gradients()
            if clip is not None:
                norms.append(nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor())
            optimizer.step()
        optimizer.zero_grad()
    return {"weights": full_weights(model), "losses": losses, "norms": norms}


def full_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def max_difference(left: list[torch.Tensor], right: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(left, right, strict=True))


def cached_run(make_model: Callable[[], nn.Module], ratio: float = 1, **loop: Any) -> dict:
    model = make_model()
    with gradient_cache.create_gradient_cache(model, compression_ratio=ratio) as cache:
        return train(model, cache=cache, **loop)


def against_plain(make_model: Callable[[], nn.Module], **loop: Any) -> float:
    """Max weight difference between plain FSDP2 and the cache at ratio 1, same loop."""
    fused = loop.pop("fused", False)
    plain = train(make_model(), **loop)
    return max_difference(plain["weights"], cached_run(make_model, fused=fused, **loop)["weights"])


def fsdp() -> nn.Module:
    return sharded(plain_net())


# --- the scenarios --------------------------------------------------------------


def apply_matches_plain() -> float:
    return against_plain(fsdp)


def fused_matches_plain() -> float:
    return against_plain(fsdp, fused=True)


def accumulation_matches_plain() -> float:
    return against_plain(fsdp, micro_batches=2)


def no_sync_accumulation_matches_plain() -> float:
    return against_plain(fsdp, micro_batches=2, no_sync=True)


def mixed_precision_matches_plain() -> float:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return against_plain(lambda: sharded(plain_net(), mp_policy=policy))


def eval_between_steps_matches_plain() -> float:
    """A forward without gradients between steps, no ``reshard()``: FSDP2's root keeps its
    all-gathered parameters, which the next forward's parameter check meets."""

    def loop(cache: gradient_cache.GradientCacheHookManager | None, model: nn.Module) -> dict:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train(model, cache=cache, fused=cache is not None, optimizer=optimizer, steps=1)
        with torch.no_grad():
            model(batch(0)[0])
        return train(model, cache=cache, fused=cache is not None, optimizer=optimizer, first_step=1)

    plain = loop(None, fsdp())
    model = fsdp()
    with gradient_cache.create_gradient_cache(model, compression_ratio=1) as cache:
        cached = loop(cache, model)
    return max_difference(plain["weights"], cached["weights"])


def apply_then_clip_matches_plain() -> float:
    return against_plain(fsdp, clip=CLIP)


def state_on_host_matches_plain() -> dict[str, Any]:
    """offload_optimizer_state: each rank's AdamW state shards in host memory between
    steps (DTensors around host tensors), brought a bucket at a time; two micro-batches,
    bit for bit with plain FSDP2."""
    plain = train(fsdp(), micro_batches=2)
    model = fsdp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradient_cache.create_gradient_cache(
        model, compression_ratio=1, offload_optimizer_state=True
    ) as cache:
        cached = train(model, cache=cache, fused=True, micro_batches=2, optimizer=optimizer)
        host = cache.engine.optimizer_state.copies_of(optimizer)
        on_host = [
            value is host[param][key]
            for param, state in optimizer.state.items()
            for key, value in state.items()
            if value.dim() > 0
        ]
        # state_dict(): each shard's compact copy (a tensor of its own, not its slab).
        saved = optimizer.state_dict()["state"]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        compact = [
            saved[i][key].to_local().untyped_storage().nbytes() == value.to_local().nbytes
            and torch.equal(saved[i][key].to_local(), value.to_local())
            for i, param in enumerate(params)
            for key, value in optimizer.state[param].items()
            if value.dim() > 0
        ]
    return {
        "difference": max_difference(plain["weights"], cached["weights"]),
        "on host": bool(on_host) and all(on_host),
        "compact state_dict": bool(compact) and all(compact),
    }


def fused_clip_against_clip_grad_norm() -> dict[str, float]:
    plain = train(fsdp(), clip=CLIP)
    cached = cached_run(fsdp, fused=True, clip=CLIP)
    return {
        "weights": max_difference(plain["weights"], cached["weights"]),
        "norms": max(
            abs(a.item() - b.item()) for a, b in zip(plain["norms"], cached["norms"], strict=True)
        ),
        "clipped": min(n.item() for n in plain["norms"]) > CLIP,
    }


def fused_inf_norm_against_clip_grad_norm() -> float:
    """The largest entry over every rank's shards (a MAX all-reduce)."""
    model = fsdp()
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    reference = nn.utils.get_total_norm(grads, norm_type=float("inf")).full_tensor()
    cached = fsdp()
    with gradient_cache.create_gradient_cache(cached, compression_ratio=1) as cache:
        nn.functional.mse_loss(cached(x), y).backward()
        optimizer = torch.optim.SGD(cached.parameters())
        norm = cache.step(optimizer, max_grad_norm=1.0, norm_type=float("inf"))
    return abs(norm.item() - reference.item())


def ratio_100_trains() -> dict[str, float]:
    """Loss over the first and the last 5 steps of 40, on one repeated batch per rank."""
    model = fsdp()
    cache = gradient_cache.create_gradient_cache(
        model, compression_ratio=100, codec="topk", min_compress_numel=1024
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(0)
    losses = []
    for _ in range(40):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        cache.step(optimizer, max_grad_norm=1.0)
    summary = cache.get_compression_summary()
    cache.remove_hooks()
    return {
        "first": sum(losses[:5]) / 5,
        "last": sum(losses[-5:]) / 5,
        "kept_fraction": summary["kept_fraction"],
        "head_numel": summary["layers"]["head.weight"]["numel"],
    }


def decorator_matches_plain() -> float:
    plain = train(fsdp())

    @gradient_cache.optimize(compression_ratio=1)
    def decorated() -> dict:
        return train(fsdp())

    return max_difference(plain["weights"], decorated()["weights"])


def buckets_follow_groups() -> list[list[str]]:
    """Cached gradients by bucket, with buckets large enough to hold every group at once."""
    model = fsdp()
    with gradient_cache.create_gradient_cache(model, compression_ratio=1, bucket_size_mb=64) as c:
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        c.compress_and_free_gradients()
        engine = c.engine
        return [
            sorted(engine.records[p].name for p, _ in bucket) for bucket in engine.store.buckets()
        ]


def split_group_warns() -> list[str]:
    """exclude_layers=["head"] splits the root group (embed and head)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradient_cache.create_gradient_cache(fsdp(), exclude_layers=["head"]).remove_hooks()
        gradient_cache.create_gradient_cache(fsdp(), exclude_layers=["blocks.0"]).remove_hooks()
    return [str(w.message) for w in caught]


def resumed_from(
    saved: io.BytesIO, options: dict[str, Any]
) -> tuple[nn.Module, torch.optim.Optimizer, gradient_cache.GradientCacheHookManager, dict]:
    """A new sharded model, its AdamW and its cache (``options``), each loaded from the
    checkpoint in ``saved``; and the checkpoint."""
    saved.seek(0)
    state = torch.load(saved, weights_only=False)  # the DTensors of the model and optimizer
    model = fsdp()
    model.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.load_state_dict(state["optim"])
    cache = gradient_cache.create_gradient_cache(model, **options)
    cache.load_state_dict(state["cache"])
    return model, optimizer, cache, state


def checkpoint_resumes_bit_for_bit() -> dict[str, Any]:
    """Save after 2 steps at ratio 100 with error feedback; resume in a new model."""
    options = {"compression_ratio": 100, "codec": "topk", "min_compress_numel": 1024}
    model = fsdp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cache = gradient_cache.create_gradient_cache(model, **options)
    train(model, cache=cache, optimizer=optimizer, steps=2)
    saved = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optim": optimizer.state_dict(), "cache": cache.state_dict()},
        saved,
    )
    uninterrupted = train(model, cache=cache, optimizer=optimizer, steps=2, first_step=2)
    cache.remove_hooks()

    resumed_model, resumed_optimizer, resumed_cache, state = resumed_from(saved, options)
    resumed = train(
        resumed_model, cache=resumed_cache, optimizer=resumed_optimizer, steps=2, first_step=2
    )
    other_world = dict(state["cache"], shards=(dist.get_rank(), 4))
    try:
        resumed_cache.load_state_dict(other_world)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    resumed_cache.remove_hooks()
    return {
        "difference": max_difference(uninterrupted["weights"], resumed["weights"]),
        "residuals": len(state["cache"]["residuals"]),
        "world_size_refusal": refusal,
    }


def clipped_checkpoint_mid_accumulation_resumes() -> float:
    """int8 at ratio 4, clipping, two micro-batches: a checkpoint after the third step's
    first micro-batch, resumed into a new model, goes on as the run that saved it."""
    options = {"compression_ratio": 4, "codec": "int8"}

    def step(model, cache, optimizer, index: int, micro: tuple[int, ...] = (0, 1)) -> None:
        for each in micro:
            x, y = batch(index, each)
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        if 1 in micro:
            cache.step(optimizer, max_grad_norm=CLIP)
            optimizer.zero_grad()

    model = fsdp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cache = gradient_cache.create_gradient_cache(model, **options)
    for index in range(2):
        step(model, cache, optimizer, index)
    step(model, cache, optimizer, 2, micro=(0,))
    saved = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optim": optimizer.state_dict(), "cache": cache.state_dict()},
        saved,
    )
    step(model, cache, optimizer, 2, micro=(1,))
    step(model, cache, optimizer, 3)
    cache.remove_hooks()
    resumed, resumed_optimizer, resumed_cache, _ = resumed_from(saved, options)
    step(resumed, resumed_cache, resumed_optimizer, 2, micro=(1,))
    step(resumed, resumed_cache, resumed_optimizer, 3)
    resumed_cache.remove_hooks()
    return max_difference(full_weights(model), full_weights(resumed))


def refused_forward_leaves_the_model_sharded() -> dict[str, Any]:
    """Parameters replaced after the cache was created (``load_state_dict(..., assign=True)``):
    the forward is refused before FSDP2's pre-hook gathers, so the model stays sharded and
    the recovery the refusal names (``remove_hooks()``, a new cache, a new optimizer) trains
    as plain FSDP2 does after the same load."""
    source = {k: v.detach().clone() for k, v in sharded(plain_net(seed=1)).state_dict().items()}

    def run(cached: bool) -> dict[str, Any]:
        model = fsdp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cache = gradient_cache.create_gradient_cache(model, compression_ratio=1) if cached else None
        train(model, cache=cache, optimizer=optimizer, steps=1)
        model.load_state_dict({k: v.clone() for k, v in source.items()}, assign=True)
        refusal = _error_of(lambda: model(batch(1)[0])) if cached else ""
        if cache is not None:
            cache.remove_hooks()
            cache = gradient_cache.create_gradient_cache(model, compression_ratio=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trained = train(model, cache=cache, optimizer=optimizer, steps=1, first_step=1)
        if cache is not None:
            cache.remove_hooks()
        return {"refusal": refusal, "weights": trained["weights"]}

    plain, cached = run(cached=False), run(cached=True)
    return {
        "refusal": cached["refusal"],
        "difference": max_difference(plain["weights"], cached["weights"]),
    }


def created_after_an_eval() -> dict[str, str]:
    """A cache created after a forward without gradients, where FSDP2's root holds its
    all-gathered parameters: the refusal names model.reshard(), after which it is made."""
    model = fsdp()
    with torch.no_grad():
        model(batch(0)[0])
    refusal = _error_of(lambda: gradient_cache.create_gradient_cache(model))
    model.reshard()
    after = _error_of(lambda: gradient_cache.create_gradient_cache(model).remove_hooks())
    return {"refusal": refusal, "after reshard": after}


def ddp_refused() -> str:
    ddp = nn.parallel.DistributedDataParallel(plain_net())
    return _error_of(lambda: gradient_cache.create_gradient_cache(ddp))


def ddp_inner_module_refused_at_first_hook() -> str:
    ddp = nn.parallel.DistributedDataParallel(plain_net())
    cache = gradient_cache.create_gradient_cache(ddp.module, compression_ratio=1)
    x, y = batch(0)
    try:
        return _error_of(lambda: nn.functional.mse_loss(ddp(x), y).backward())
    finally:
        cache.remove_hooks()


def decorator_refuses_ddp() -> str:
    ddp = nn.parallel.DistributedDataParallel(plain_net())

    @gradient_cache.optimize(compression_ratio=1)
    def step() -> None:
        x, y = batch(0)
        nn.functional.mse_loss(ddp(x), y).backward()

    return _error_of(step)


def ddp_replicate_refused() -> str:
    from torch.distributed._composable.replicate import replicate

    return _error_of(lambda: gradient_cache.create_gradient_cache(replicate(plain_net())))


def cpu_offload_refused() -> str:
    model = sharded(plain_net(), offload_policy=CPUOffloadPolicy(pin_memory=False))
    return _error_of(lambda: gradient_cache.create_gradient_cache(model))


def partly_sharded_refused() -> str:
    """Blocks sharded, the root not: embed and head would keep each rank's own gradients."""
    model = plain_net()
    for block in model.blocks:
        fully_shard(block)
    return _error_of(lambda: gradient_cache.create_gradient_cache(model))


def tensor_parallel_placement_refused() -> str:
    """A weight sharded along its columns, as tensor parallelism shards it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    layer = nn.Linear(16, 16)
    mesh = init_device_mesh("cpu", (WORLD,))
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(1)]))
    layer.bias.requires_grad_(False)
    return _error_of(lambda: gradient_cache.create_gradient_cache(layer))


def two_meshes_refused() -> str:
    """The blocks on one mesh, the root on another: one clip norm is reduced over one mesh."""
    model = plain_net()
    blocks_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("blocks",))
    for block in model.blocks:
        fully_shard(block, mesh=blocks_mesh)
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,), mesh_dim_names=("root",)))
    return _error_of(lambda: gradient_cache.create_gradient_cache(model))


def hsdp_matches_plain() -> dict[str, Any]:
    """2 replicas of 1 shard each: placements (Replicate(), Shard(0)); replicas end equal."""
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))

    def hsdp() -> nn.Module:
        return sharded(plain_net(), mesh=mesh)

    cached = cached_run(hsdp, fused=True, clip=CLIP)
    plain = train(hsdp(), clip=CLIP)
    local = [p.to_local() for p in hsdp().parameters()]  # placements to report
    return {
        "difference": max_difference(plain["weights"], cached["weights"]),
        "replica_gap": _gap_between_ranks(cached["weights"]),
        "placements": str(next(hsdp().parameters()).placements),
        "local_numel": sum(t.numel() for t in local),
    }


def replicate_with_fsdp_matches_plain() -> dict[str, Any]:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    def replicated() -> nn.Module:
        return replicate(plain_net())

    cached = cached_run(replicated, fused=True, clip=CLIP)
    plain = train(replicated(), clip=CLIP)
    return {
        "difference": max_difference(plain["weights"], cached["weights"]),
        "replica_gap": _gap_between_ranks(cached["weights"]),
    }


# --- offload_parameters: each rank's shards on the host ----------------------------


def deep() -> nn.Module:
    """Four blocks: the device holding two modules' shards at most is a real bound."""
    return sharded(plain_net(depth=4))


def offloaded(model: nn.Module) -> gradient_cache.GradientCacheHookManager:
    return gradient_cache.create_gradient_cache(
        model, compression_ratio=1, offload_optimizer_state=True, offload_parameters=True
    )


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with the biases in a second group, without weight decay."""
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if not n.endswith("bias")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def shards_on_device(model: nn.Module) -> list[int]:
    """The ``fully_shard`` modules (by their place in ``model.modules()``) whose shards
    hold device memory now (FSDP2's padded shard, which its all-gather reads)."""
    from gradient_cache.engine.fsdp_privates import sharded_modules

    return [
        index
        for index, sharded in enumerate(sharded_modules(model))
        for group in sharded.groups
        if any(fp._sharded_param_data.untyped_storage().nbytes() for fp in group.fsdp_params)
    ]


def shard_bytes(model: nn.Module) -> list[int]:
    """Each ``fully_shard`` module's padded shards' bytes on this rank."""
    from gradient_cache.engine.fsdp_privates import sharded_modules

    return [
        sum(fp._sharded_param_data.nbytes for g in sharded.groups for fp in g.fsdp_params)
        for sharded in sharded_modules(model)
    ]


def record_orderings(backend: Any) -> dict[str, list[int]]:
    """The FSDP2 streams the backend is asked to order after the compute stream
    (``let_read``) and the compute stream after (``join``), by identity: no-ops on the CPU,
    recorded here. The instance attributes shadow the backend's methods."""
    seen: dict[str, list[int]] = {"let_read": [], "join": []}
    for name, calls in seen.items():
        method = getattr(backend, name)

        def recorded(
            stream: Any, *args: Any, method: Any = method, calls: list[int] = calls
        ) -> None:
            calls.append(id(stream))
            method(stream, *args)

        setattr(backend, name, recorded)
    return seen


def count_shards_in_use(model: nn.Module, seen: list[int]) -> None:
    """Record, as each block begins its forward and its backward, how many modules' shards
    are on the device."""
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: seen.append(len(shards_on_device(model))))
        block.register_full_backward_pre_hook(lambda *_: seen.append(len(shards_on_device(model))))


def weights_on_host_match_plain() -> dict[str, Any]:
    """AdamW with two param groups, two micro-batches, clipping: bit for bit with plain
    FSDP2, each rank's shards on the device only around their all-gathers and steps."""
    plain_model = deep()
    plain = train(plain_model, micro_batches=2, clip=CLIP, optimizer=two_groups(plain_model))
    model = deep()
    optimizer = two_groups(model)
    in_use: list[int] = []
    with offloaded(model) as cache, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count_shards_in_use(model, in_use)
        orderings = record_orderings(cache.engine.backend)
        cached = train(
            model, cache=cache, fused=True, micro_batches=2, clip=CLIP, optimizer=optimizer
        )
        at_rest = shards_on_device(model)
        x, y = batch(STEPS)  # one step more, of one micro-batch, looked into
        nn.functional.mse_loss(model(x), y).backward()
        after_backward = shards_on_device(model)
        cache.step(optimizer)
        optimizer.zero_grad()
        summary = cache.summary()
        with torch.no_grad():
            model(x)
        after_eval = shards_on_device(model)
        model.reshard()  # FSDP2's root keeps its all-gathered weights after a forward
        before_close = full_weights(model)
    return {
        "weights": max_difference(plain["weights"], cached["weights"]),
        "losses": plain["losses"] == cached["losses"],
        "norms": [n.item() for n in plain["norms"]] == [n.item() for n in cached["norms"]],
        "modules": len(list(model.modules())),
        "in use": in_use,
        "at rest": at_rest,
        "after backward": after_backward,
        "after eval": after_eval,
        "host MiB": summary.parameters_host_mb,
        "moved MiB": summary.parameters_moved_mb,
        "warnings": [str(w.message) for w in caught],
        "closed": len(shards_on_device(model)),
        "shard bytes": shard_bytes(model),
        "closed weights": max_difference(before_close, full_weights(model)),
        "let_read": orderings["let_read"],
        "join": orderings["join"],
    }


def weights_on_host_sgd_checkpointed() -> dict[bool, dict[str, Any]]:
    """SGD with momentum, each block's forward rerun in backward (activation
    checkpointing), the blocks resharded after forward or not: bit for bit with plain
    FSDP2, and what each step moves."""

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)

    results = {}
    for reshard in (True, False):

        def model() -> nn.Module:
            net = plain_net(depth=4, checkpointed=True)
            for block in net.blocks:
                fully_shard(block, reshard_after_forward=reshard)  # noqa: B023 - called here
            return fully_shard(net)

        plain_model = model()
        plain = train(plain_model, optimizer=sgd(plain_model))
        cached_model = model()
        with offloaded(cached_model) as cache:
            cached = train(cached_model, cache=cache, fused=True, optimizer=sgd(cached_model))
            moved = cache.summary().parameters_moved_mb
            sizes = shard_bytes(cached_model)
        results[reshard] = {
            "difference": max_difference(plain["weights"], cached["weights"]),
            "moved MiB": moved,
            "shard bytes": sizes,
        }
    return results


def weights_on_host_mixed_precision() -> dict[str, float]:
    """FSDP2's MixedPrecisionPolicy (bf16 all-gathers from the fp32 shards) with the
    shards on the host: bit for bit with plain FSDP2 under the same policy, each shard
    filled from its master's bf16 cast (widened on the device: FSDP2's cast of it gives the
    same bits) for forward and backward, so they move half the bytes fp32's do."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def model(mp_policy: MixedPrecisionPolicy | None) -> nn.Module:
        net = plain_net(depth=4)
        return sharded(net, mp_policy=mp_policy) if mp_policy else sharded(net)

    plain = train(model(policy))
    cached_model = model(policy)
    with offloaded(cached_model) as cache:
        cached = train(cached_model, cache=cache, fused=True)
        moved = cache.summary().parameters_moved_mb
        # A load writes the shards on the device, which must hold the masters then, not
        # their casts: halved at rest, the saved weights loaded back are the trained ones.
        saved = {k: v.detach().clone() for k, v in cached_model.state_dict().items()}
        with torch.no_grad():
            for param in cached_model.parameters():
                param.mul_(0.5)
        cache.engine.weights.ensure(list(cached_model.parameters()))  # in use, their casts
        cached_model.load_state_dict(saved)
        loaded = [v.full_tensor() for v in cached_model.state_dict().values()]  # the masters
    closed = full_weights(cached_model)  # the close fills the shards from the masters
    fp32_model = model(None)
    with offloaded(fp32_model) as cache:
        train(fp32_model, cache=cache, fused=True)
        moved_fp32 = cache.summary().parameters_moved_mb
    return {
        "difference": max_difference(plain["weights"], cached["weights"]),
        "loaded": max_difference(cached["weights"], loaded),
        "closed": max_difference(cached["weights"], closed),
        "moved": moved,
        "moved fp32": moved_fp32,
    }


def weights_on_host_one_rank_mesh() -> float:
    """Each rank's own model sharded over a mesh of itself alone: FSDP2's one-process path
    (it copies the shard on the compute stream in its pre-hook, with no all-gather), bit
    for bit with plain FSDP2 on the same mesh."""
    mesh = DeviceMesh.from_group(dist.new_group([dist.get_rank()]), "cpu")

    def model() -> nn.Module:
        net = plain_net(depth=4)
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(net, mesh=mesh)

    plain = train(model(), micro_batches=2)
    cached_model = model()
    with offloaded(cached_model) as cache:
        cached = train(cached_model, cache=cache, fused=True, micro_batches=2)
    return max_difference(plain["weights"], cached["weights"])


def weights_on_host_beside_the_loop() -> dict[str, Any]:
    """What a user does beside the loop, done to plain FSDP2 too: submodules' state_dict
    loaded back (the head, whose shard is uneven on rank 1, and a block), FSDP2's own
    unshard() (waited, and async), an eval through a submodule and one through the model.
    Bit for bit with plain FSDP2, and no shard left on the device after the evals."""

    def run(cached: bool) -> dict[str, Any]:
        model = deep()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cache = offloaded(model) if cached else None
        seen: dict[str, Any] = {}

        def step(index: int) -> None:
            train(model, cache=cache, fused=cached, optimizer=optimizer, steps=1, first_step=index)

        step(0)
        model.head.load_state_dict(model.head.state_dict())
        model.blocks[0].load_state_dict(model.blocks[0].state_dict())
        step(1)
        model.blocks[1].unshard()
        model.blocks[1].reshard()
        handle = model.blocks[2].unshard(async_op=True)
        assert handle is not None
        handle.wait()
        model.blocks[2].reshard()
        saved = model.state_dict()  # block 2's shards on the device now
        before = full_weights(model)
        step(2)
        torch.save(saved, io.BytesIO())  # after the step gave the shards up
        seen["saved"] = max_difference(before, [v.full_tensor() for v in saved.values()])
        hidden = torch.randn(8, 128, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            model.blocks[0](hidden)
            seen["after a block's eval"] = shards_on_device(model)
            model(batch(0)[0])
            model.reshard()
            seen["after the model's eval"] = shards_on_device(model)
            model.exit_after = 2  # the third block, brought ahead, does not run
            model(batch(0)[0])
            model.reshard()
            model.exit_after = 4
            seen["after an early exit"] = shards_on_device(model)
        step(3)
        weights = full_weights(model)
        if cache is not None:
            cache.remove_hooks()
        return {"weights": weights, **seen}

    plain, cached = run(cached=False), run(cached=True)
    return {
        "difference": max_difference(plain["weights"], cached["weights"]),
        "after a block's eval": cached["after a block's eval"],
        "after the model's eval": cached["after the model's eval"],
        "after an early exit": cached["after an early exit"],
        "saved": cached["saved"],
    }


def weights_on_host_named_prefetch() -> float:
    """The user's own prefetch plan, other than the order the cache learns: forward two
    blocks ahead, backward two blocks back. Bit for bit with plain FSDP2."""

    def model() -> nn.Module:
        net = deep()
        net.blocks[0].set_modules_to_forward_prefetch([net.blocks[2]])
        net.blocks[3].set_modules_to_backward_prefetch([net.blocks[1]])
        return net

    plain = train(model(), micro_batches=2)
    cached_model = model()
    with offloaded(cached_model) as cache:
        cached = train(cached_model, cache=cache, fused=True, micro_batches=2)
    return max_difference(plain["weights"], cached["weights"])


class TwoRoots(nn.Module):
    """Two FSDP2 roots under a wrapper of no parameters of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = deep()
        self.aux = sharded(plain_net(seed=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.aux(x)


def weights_on_host_two_roots_through_a_framework() -> dict[str, Any]:
    """The cache on a wrapper of two FSDP2 roots; the first step calls one root directly,
    as Lightning's training_step calls the inner model (the other root's first forward
    comes a step later); then the wrapper. Bit for bit with plain FSDP2; the blocks still
    arrive a block ahead through the root called directly."""

    def run(cached: bool) -> dict[str, Any]:
        model = TwoRoots()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cache = offloaded(model) if cached else None
        in_use: list[int] = []
        for step in range(STEPS):
            x, y = batch(step)
            if step == 0 and cached:
                count_shards_in_use(model.inner, in_use)
            output = model.inner(x) if step == 0 else model(x)
            nn.functional.mse_loss(output, y).backward()
            if cache is not None:
                cache.step(optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad()
        weights = full_weights(model)
        if cache is not None:
            cache.remove_hooks()
        return {"weights": weights, "in use": in_use}

    plain, cached = run(cached=False), run(cached=True)
    return {
        "difference": max_difference(plain["weights"], cached["weights"]),
        "in use": cached["in use"],
    }


def weights_on_host_decorated() -> float:
    """``@gradient_cache.optimize`` with the shards on the host, called once an epoch on a
    model that already ran a forward (an eval first): the cache is created inside the
    model's first forward of each call. Bit for bit with plain FSDP2."""
    plain = train(deep())
    model = deep()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.no_grad():
        model(batch(0)[0])
    model.reshard()

    @gradient_cache.optimize(
        compression_ratio=1, offload_optimizer_state=True, offload_parameters=True
    )
    def epoch(first_step: int) -> dict:
        return train(model, optimizer=optimizer, steps=STEPS // 2, first_step=first_step)

    epoch(0)
    return max_difference(plain["weights"], epoch(STEPS // 2)["weights"])


def weights_on_host_close_without_room() -> dict[str, Any]:
    """remove_hooks() where the shards do not fit back on the device: a clear error, the
    cache still attached; training goes on bit for bit, and a later close succeeds."""
    plain = train(deep(), steps=2)
    model = deep()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cache = offloaded(model)
    train(model, cache=cache, fused=True, optimizer=optimizer, steps=1)
    backend = cache.engine.backend

    def no_room(tensor: torch.Tensor, nbytes: int) -> None:
        if nbytes:
            raise torch.OutOfMemoryError("no room (a test)")
        type(backend).resize_storage(backend, tensor, nbytes)

    backend.resize_storage = no_room
    error = _error_of(cache.remove_hooks)
    del backend.resize_storage  # the backend's own again
    train(model, cache=cache, fused=True, optimizer=optimizer, steps=1, first_step=1)
    cache.remove_hooks()
    return {
        "refusal": error,
        "difference": max_difference(plain["weights"], full_weights(model)),
        "closed": len(shards_on_device(model)),
    }


def weights_on_host_resume() -> dict[str, Any]:
    """Two steps, a checkpoint (model and optimizer), two more; the checkpoint loaded
    into a new sharded model with its cache attached resumes bit for bit."""
    model = deep()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cache = offloaded(model)
    train(model, cache=cache, fused=True, optimizer=optimizer, steps=2)
    state = model.state_dict()
    compact = [
        value.to_local().untyped_storage().nbytes() == value.to_local().nbytes
        for value in state.values()
    ]
    saved = io.BytesIO()
    torch.save({"model": state, "optim": optimizer.state_dict()}, saved)
    uninterrupted = train(
        model, cache=cache, fused=True, optimizer=optimizer, steps=2, first_step=2
    )
    cache.remove_hooks()

    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    resumed_model = deep()
    resumed_cache = offloaded(resumed_model)
    resumed_model.load_state_dict(loaded["model"])
    resumed_optimizer = torch.optim.AdamW(resumed_model.parameters(), lr=1e-2)
    resumed_optimizer.load_state_dict(loaded["optim"])
    loaded_at_rest = shards_on_device(resumed_model)
    resumed = train(
        resumed_model,
        cache=resumed_cache,
        fused=True,
        optimizer=resumed_optimizer,
        steps=2,
        first_step=2,
    )
    resumed_cache.remove_hooks()
    return {
        "difference": max_difference(uninterrupted["weights"], resumed["weights"]),
        "compact": bool(compact) and all(compact),
        "loaded at rest": loaded_at_rest,
    }


def weights_on_host_refusals() -> list[str]:
    """What cannot be combined with the shards on the host, each refused with its fix."""
    options = {"offload_optimizer_state": True, "offload_parameters": True}
    return [
        _error_of(
            lambda: gradient_cache.create_gradient_cache(
                deep(), compute_dtype=torch.bfloat16, **options
            )
        ),
        _error_of(
            lambda: gradient_cache.create_gradient_cache(
                deep(), parameter_blocks="blocks", **options
            )
        ),
        _error_of(lambda: gradient_cache.create_gradient_cache(grouped(), **options)),
        _error_of(lambda: gradient_cache.create_gradient_cache(frozen_root(), **options)),
        shard_taken_at_rest(),
        cache_on_the_blocks_of_a_sharded_model(),
    ]


def cache_on_the_blocks_of_a_sharded_model() -> str:
    """The cache on ``model.blocks`` of a fully_shard model: refused (it made the blocks
    roots of their own, which FSDP2's root then refused, or after a forward crashed)."""
    model = deep()
    options = {"offload_optimizer_state": True, "offload_parameters": True}
    return _error_of(lambda: gradient_cache.create_gradient_cache(model.blocks, **options))


def shard_taken_at_rest() -> str:
    """FSDP2 re-reading a shard at rest (its reset_sharded_param, as its lazy init or a
    load runs it) takes the master's memory for it: refused at the next forward."""
    model = deep()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cache = offloaded(model)
    train(model, cache=cache, fused=True, optimizer=optimizer, steps=1)
    model.blocks[0]._get_fsdp_state()._fsdp_param_groups[0].fsdp_params[0].reset_sharded_param()
    error = _error_of(lambda: model(batch(0)[0]))
    cache.remove_hooks()
    return error


def frozen_root() -> nn.Module:
    """The blocks sharded; the root not, its parameters frozen (no cached gradient)."""
    model = plain_net(depth=4)
    for block in model.blocks:
        fully_shard(block)
    model.embed.requires_grad_(False)
    model.head.requires_grad_(False)
    return model


def grouped() -> nn.Module:
    """Two blocks sharded in one ``fully_shard([a, b])`` call."""
    model = plain_net(depth=4)
    fully_shard([model.blocks[0], model.blocks[1]])
    for block in model.blocks[2:]:
        fully_shard(block)
    return fully_shard(model)


def _gap_between_ranks(weights: list[torch.Tensor]) -> float:
    """Largest difference between this rank's weights and rank 0's."""
    flat = torch.cat([w.reshape(-1) for w in weights])
    first = flat.clone()
    dist.broadcast(first, src=0)
    return (flat - first).abs().max().item()


def _error_of(action: Callable[[], Any]) -> str:
    try:
        action()
    except (TypeError, ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


PAIRS = {
    "fsdp": [
        apply_matches_plain,
        fused_matches_plain,
        accumulation_matches_plain,
        no_sync_accumulation_matches_plain,
        mixed_precision_matches_plain,
        apply_then_clip_matches_plain,
        eval_between_steps_matches_plain,
        state_on_host_matches_plain,
        fused_clip_against_clip_grad_norm,
        fused_inf_norm_against_clip_grad_norm,
        ratio_100_trains,
        decorator_matches_plain,
        checkpoint_resumes_bit_for_bit,
        refused_forward_leaves_the_model_sharded,
        clipped_checkpoint_mid_accumulation_resumes,
        buckets_follow_groups,
        split_group_warns,
    ],
    "weights": [
        weights_on_host_match_plain,
        weights_on_host_sgd_checkpointed,
        weights_on_host_mixed_precision,
        weights_on_host_one_rank_mesh,
        weights_on_host_beside_the_loop,
        weights_on_host_named_prefetch,
        weights_on_host_two_roots_through_a_framework,
        weights_on_host_decorated,
        weights_on_host_close_without_room,
        weights_on_host_resume,
        weights_on_host_refusals,
    ],
    "replicas_and_refusals": [
        hsdp_matches_plain,
        replicate_with_fsdp_matches_plain,
        ddp_refused,
        ddp_inner_module_refused_at_first_hook,
        ddp_replicate_refused,
        decorator_refuses_ddp,
        cpu_offload_refused,
        tensor_parallel_placement_refused,
        partly_sharded_refused,
        two_meshes_refused,
        created_after_an_eval,
    ],
}


def run_pair(rank: int, pairs: list[str], port: int, out_dir: str) -> None:
    """One process of the pair: every scenario of ``pairs``, results to ``out_dir``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # two processes on the machine's cores; and one bit pattern
    # A timeout: a scenario that hangs on one rank fails the pair instead of CI.
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    results: dict[str, Any] = {}
    try:
        for scenario in (scenario for pair in pairs for scenario in PAIRS[pair]):
            try:
                results[scenario.__name__] = scenario()
            except Exception:  # recorded: the test of this scenario fails with it
                results[scenario.__name__] = {"error": traceback.format_exc()}
            dist.barrier()  # a scenario that failed on one rank must not desync the next
    finally:
        torch.save(results, Path(out_dir) / f"results_{rank}.pt")
        dist.destroy_process_group()
