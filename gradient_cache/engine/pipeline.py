"""The engine: hooks → buckets → encode → host slots → restore.

Backward's post-accumulate-grad hook takes each gradient as soon as it is complete,
frees it from the parameter and adds it to the open bucket; a full bucket is encoded and
sent to host memory while backward goes on. `drain()` flushes the partial bucket and
waits; `apply()` and `fused_step.step()` restore, walking the same buckets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..compression import (
    DensePayload,
    DeviceGenerators,
    Int8Quantizer,
    Payload,
    ResidualCodec,
    TopKEncoder,
    add_into,
    entries_kept,
    moved,
)
from ..data_parallel import check_gradient_is_reduced
from . import sharding
from .backend import Backend, CpuBackend, Encoded
from .bucket import Bucket, BucketAssembler, Item
from .config import EngineConfig
from .cuda import CudaBackend, allocate_pinned
from .hostmem import check_host_budget
from .pool import HostPool, slot_spec


@dataclass
class LayerRecord:
    """What one parameter's gradient cost in the last completed step."""

    numel: int
    dense_bytes: int
    stored_bytes: int
    kept: int
    compressed: bool


@dataclass
class GroupArrivals:
    """Gradients of one group (`Pipeline`'s ``groups``) arrived in this backward so far."""

    size: int
    count: int = 0


@dataclass
class StepRecord:
    layers: dict[str, LayerRecord] = field(default_factory=dict)


# Parameters whose gradients a live pipeline's hooks take. A second pipeline on one of them
# would take gradients the first counts on; identity keys, since tensors compare by value.
_owned: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Pipeline:
    """Offloads the gradients of ``named_params`` to the host and restores them."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        ratio: float,
        config: EngineConfig,
        grad_scaler: torch.amp.GradScaler | None = None,
        groups: Sequence[Sequence[torch.nn.Parameter]] = (),
    ) -> None:
        """``groups``: parameters whose gradients arrive together and share one buffer
        (FSDP2's reduce-scatter output); a bucket closes when a group is complete."""
        self.config = config
        self.ratio = ratio
        self.names = {param: name for name, param in named_params}
        params = list(self.names)
        sharding.check_placements(named_params)
        # Entries of each gradient this rank caches: its shard's under FSDP2.
        self.numels = {param: sharding.local_numel(param) for param in params}
        self._gradient_checked = False
        self.group_of: dict[torch.nn.Parameter, GroupArrivals] = {}
        for group in groups:
            members = [p for p in group if p in self.names]
            arrivals = GroupArrivals(len(members))
            self.group_of.update(dict.fromkeys(members, arrivals))
        taken = [name for name, param in named_params if param in _owned]
        if taken:
            raise ValueError(
                f"{len(taken)} of these parameters ({', '.join(taken[:3])}"
                f"{', ...' if len(taken) > 3 else ''}) are already cached by another "
                "GradientCacheHookManager; one model takes one manager. Call remove_hooks() "
                "on the other one (or leave its with-block) before creating this one; a "
                "notebook cell run twice must reuse the first manager or rebuild the model."
            )
        # Checks the host budget before it allocates anything; no hook exists yet either.
        self.backend = create_backend(params, config, ratio=ratio)
        self.encoder = None  # top-k selection, with error feedback
        self.quantizer = Int8Quantizer() if config.value_dtype == "int8" else None
        if ratio > 1:
            selection = config.selection
            if selection == "auto":
                selection = self.backend.default_selection
            self.encoder = TopKEncoder(
                ratio=ratio,
                selection=selection,
                residual_dtype=config.residual_dtype,
            )
        # Each compressed parameter's error-feedback residual as of the last completed
        # step: a device tensor, or its host slot (`Backend.host_residuals`).
        self.residuals: dict[torch.nn.Parameter, torch.Tensor] = self.backend.host_residuals()
        self.host_residual_params = set(self.residuals)
        # Residuals this pending step made. They replace `residuals` when the step's
        # gradients are restored; a discarded step drops them, so it leaves no trace.
        # Cost: the old and the new residual both exist until then (on CUDA, a second
        # host slot per residual).
        self.pending_residuals: dict[torch.nn.Parameter, torch.Tensor] = {}
        # The engine's random generators (threshold sampling, stochastic rounding) as the
        # pending step found them, so that a discarded step leaves them as they were too.
        self.random_state_at_step_start: dict[str, torch.Tensor] | None = None
        self._warming_up = config.warmup_steps > 0 and (
            self.encoder is not None or self.quantizer is not None
        )
        self.assembler = BucketAssembler(config.bucket_size_bytes)
        self.buckets: list[Bucket] = []  # launched, in arrival order
        self.cached: dict[torch.nn.Parameter, Bucket] = {}  # where each payload is
        self.enabled = True
        # Error feedback keeps its residual unscaled by this GradScaler's current scale.
        self.grad_scaler = grad_scaler
        self.last_step = StepRecord()
        self.steps = 0
        # (total norm, clip scale) of a fused step that raised; its retry reuses them.
        self.interrupted_clip: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        for param in params:
            _owned[param] = True

    # --- capture (runs inside backward) -------------------------------------------

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if not self.enabled or grad is None or grad.is_sparse:
            return  # sparse (nn.Embedding(sparse=True)) gradients stay where they are
        if not self._gradient_checked:
            check_gradient_is_reduced(self.names[param], grad)
            self._gradient_checked = True
        param.grad = None
        group_complete = self._group_complete(param)
        items = self.assembler.add(param, sharding.local(grad))
        if items is None and group_complete:
            # The group's shared buffer is freed once its last gradient is offloaded: send
            # it now rather than when the next group's gradients fill the bucket.
            items = self.assembler.flush()
        if items is not None:
            self._launch(items)

    def _group_complete(self, param: torch.nn.Parameter) -> bool:
        """Count ``param``'s arrival; whether it completes its group's arrivals."""
        arrivals = self.group_of.get(param)
        if arrivals is None:
            return False
        arrivals.count += 1
        if arrivals.count < arrivals.size:
            return False
        arrivals.count = 0
        return True

    def _launch(self, items: list[Item]) -> None:
        """Encode ``items`` and send them to host memory, one parameter at a time.

        If encoding fails (out of memory, say), the parameters not yet encoded get their
        gradients back in ``param.grad`` and the error propagates: nothing is lost or
        counted twice, and the next restore adds the cached part to them.
        """
        if self.random_state_at_step_start is None:
            self.random_state_at_step_start = self.random_state()
        bucket = Bucket()
        reads_host = [p for p, _ in items if p in self.cached or p in self.host_residual_params]
        encoded: list[Encoded] = []
        try:
            with self.backend.encoding(reads_host):
                for param, grad in items:
                    encoded.append(self._encode(param, grad))
        except BaseException:
            for param, grad in items[len(encoded) :]:
                param.grad = sharding.as_grad_of(param, grad)
            raise
        finally:
            self.commit(bucket, encoded, [grad for _, grad in items[: len(encoded)]])

    def _encode(self, param: torch.nn.Parameter, grad: torch.Tensor) -> Encoded:
        """Runs where the backend's `encoding` puts it; reads but never changes cached state."""
        flat = grad.detach().reshape(-1)
        held = self.cached.get(param)
        if held is not None:  # gradient accumulation: the cached part joins this one
            flat = add_into(flat, moved(held.payloads[param], self.backend.to_device))
        if not self._compresses(param):
            return Encoded(param, DensePayload(flat), None)
        if self.encoder is None:  # every entry kept, quantized
            return Encoded(param, self.quantizer.quantize(DensePayload(flat)), None)
        residual = None
        if self.config.error_feedback:
            residual = self.pending_residuals.get(param, self.residuals.get(param))
            if residual is None:
                residual = self.encoder.residual_codec.zeros(flat.numel(), flat.device)
            elif param in self.host_residual_params:
                residual = self.backend.to_device(residual)
        payload, new_residual = self.encoder.encode(flat, residual, loss_scale=self._loss_scale())
        if self.quantizer is not None:
            payload = self.quantizer.quantize(payload)
        return Encoded(param, payload, new_residual)

    def _loss_scale(self) -> torch.Tensor | None:
        """The GradScaler's scale as a device tensor (no host sync), or None if unscaled."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        # GradScaler has no public sync-free getter; get_scale() would sync the host.
        return scaler._get_scale_async()

    def commit(self, bucket: Bucket, encoded: list[Encoded], grads: list[torch.Tensor]) -> None:
        """Make ``encoded`` the cached state: payloads in ``bucket``, new residuals kept."""
        if not encoded:
            return
        self.backend.store(bucket, encoded, grads)
        for item in encoded:
            previous = self.cached.get(item.param)
            if previous is not None:
                del previous.payloads[item.param]
            self.cached[item.param] = bucket
            if item.residual is None:
                continue
            if item.param in self.host_residual_params:  # where `store` wrote it
                new = self.backend.pending_host_residual(item.param)
            else:
                new = item.residual
            if self.config.keep_previous_residual:
                self.pending_residuals[item.param] = new
            else:  # no undo: the new residual is the current one at once
                self.residuals[item.param] = new
        self.drop_empty_buckets()
        self.buckets.append(bucket)

    def _compresses(self, param: torch.nn.Parameter) -> bool:
        """Whether this step sends ``param`` compressed: large enough, and past the warm-up."""
        return (
            (self.encoder is not None or self.quantizer is not None)
            and self.numels[param] >= self.config.min_compress_numel
            and self.steps >= self.config.warmup_steps
        )

    # --- drain and restore (runs between backward and the optimizer) --------------

    def drain(self) -> None:
        """Encode the partial bucket and wait until host memory holds every gradient."""
        items = self.assembler.flush()
        for arrivals in self.group_of.values():
            arrivals.count = 0  # a backward that stopped midway leaves partial counts
        if items is not None:
            self._launch(items)
        self.backend.wait()
        if self.encoder is not None:
            # Reused across one backward's tensors; between steps nothing stays behind.
            self.encoder.selector.release_scratch()

    def discard(self) -> None:
        """Wait for launched buckets, then drop every cached gradient and undo the step.

        The pending residuals are dropped and the random generators rewound, so the
        engine is as it was before the discarded backward.
        """
        self.drain()
        self.buckets = []
        self.cached = {}
        self.pending_residuals = {}
        self.interrupted_clip = None
        if self.random_state_at_step_start is not None:
            self.set_random_state(self.random_state_at_step_start)
            self.random_state_at_step_start = None

    def apply(self) -> None:
        """Drain, then put every cached gradient back into ``param.grad``."""
        self.drain()
        self.interrupted_clip = None
        self.record_step(self.cached)
        self.restore_into_grads(list(self.cached))
        self.end_warmup_when_done()

    def restore_into_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Put the cached gradients of ``params`` into ``param.grad`` (added to any there)."""
        wanted = set(params)
        for bucket in self.buckets:
            part = [p for p in bucket.payloads if p in wanted]
            if not part:
                continue
            restore = self.backend.start_restore(bucket.take(part), scale=None)
            for param, grad in self.backend.finish_restore(restore):
                grad = sharding.as_grad_of(param, grad)
                param.grad = grad if param.grad is None else param.grad.add_(grad)
                del self.cached[param]
        self.drop_empty_buckets()

    def end_warmup_when_done(self) -> None:
        """After the last warm-up step's restore, give back the host memory it needed.

        Runs after a restore, never in a backward hook (a new pinned pool is allocated).
        Payloads still cached (another optimizer's) keep the old slab alive until restored.
        """
        if self._warming_up and self.steps >= self.config.warmup_steps:
            self.backend.end_warmup()  # host residuals are still zero: nothing to carry over
            self.residuals.update(self.backend.host_residuals())
            self._warming_up = False

    def drop_empty_buckets(self) -> None:
        """Forget buckets whose payloads were all restored or moved on (accumulation)."""
        self.buckets = [b for b in self.buckets if len(b)]

    # --- bookkeeping --------------------------------------------------------------

    def record_step(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Keep the cached figures of ``params`` as those of the step being completed."""
        params = list(params)
        record = self.describe(params)
        if record.layers:
            self.last_step = record
            self.steps += 1
        for param in params:  # the step is delivered: its residuals are the current ones
            residual = self.pending_residuals.pop(param, None)
            if residual is None:
                continue
            if param in self.host_residual_params:
                residual = self.backend.commit_host_residual(param)
            self.residuals[param] = residual
        recorded = set(params)
        if all(param in recorded for param in self.cached):  # nothing left to discard
            self.random_state_at_step_start = None

    def _generators(self) -> dict[str, DeviceGenerators]:
        """The engine's own random generators, by the part that draws from them."""
        parts = {}
        if self.encoder is not None:
            parts["selection"] = self.encoder.selector.generators
            parts["residual"] = self.encoder.residual_codec.generators
        if self.quantizer is not None:
            parts["values"] = self.quantizer.generators
        return parts

    def random_state(self) -> dict[str, torch.Tensor]:
        """The engine's generators' states on its device (never the global RNG's)."""
        states = {
            name: generators.get_state(self.backend.device)
            for name, generators in self._generators().items()
        }
        return {name: state for name, state in states.items() if state is not None}

    def set_random_state(self, states: dict[str, torch.Tensor]) -> None:
        """Put back what `random_state` returned."""
        for name, generators in self._generators().items():
            generators.set_state(self.backend.device, states.get(name))

    def describe(self, params: Iterable[torch.nn.Parameter]) -> StepRecord:
        """The figures of the cached payloads of ``params`` (sizes only: no data is read)."""
        record = StepRecord()
        for param in params:
            payload: Payload = self.cached[param].payloads[param]
            record.layers[self.names[param]] = LayerRecord(
                numel=self.numels[param],
                dense_bytes=self.numels[param] * param.element_size(),
                stored_bytes=payload.nbytes,
                kept=entries_kept(payload),
                compressed=self._compresses(param),
            )
        return record

    def residual_bytes(self) -> int:
        """Bytes of the residuals held now: the current ones and a pending step's new ones
        (on CUDA both live in pinned slots, counted in the pool's capacity too)."""
        held = [*self.residuals.values(), *self.pending_residuals.values()]
        return sum(r.numel() * r.element_size() for r in held)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for param in self.names:
            _owned.pop(param, None)
        self.backend.close()


def parameter_device(params: Sequence[torch.nn.Parameter]) -> torch.device:
    """The one device all ``params`` live on, or a ValueError naming them all."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) != 1:
        raise ValueError(
            f"The cached parameters live on several devices {devices}; one manager serves "
            "one device. Create one manager per device, or list the other device's layers "
            "in exclude_layers."
        )
    device = torch.device(devices[0])
    if device.type == "meta":
        raise ValueError(
            "The model's parameters are on the meta device: they have no data, so backward "
            "cannot produce gradients to cache. Materialize the model first "
            "(model.to_empty(device=...) and initialize it, or load its state_dict with "
            "assign=True), then create the cache."
        )
    return device


def create_backend(
    params: Sequence[torch.nn.Parameter], config: EngineConfig, *, ratio: float
) -> Backend:
    """The backend for the parameters' device, after checking the host budget."""
    device = parameter_device(params)
    if config.backend != "auto" and config.backend != device.type:
        raise ValueError(
            f"backend={config.backend!r} does not match the parameters' device {device}; "
            f"use backend='auto' or move the model to {config.backend}."
        )
    if device.type == "cuda":
        return build_cuda_backend(params, config, device, ratio=ratio)
    # The CPU's payloads replace the gradients plain PyTorch would hold: only residuals add,
    # the current ones and (keep_previous_residual) a pending step's new ones.
    codec = ResidualCodec(config.residual_dtype)
    copies = 2 if config.keep_previous_residual else 1
    residual_bytes = copies * sum(
        codec.stored_bytes(numel)
        for numel in map(sharding.local_numel, params)
        if config.error_feedback and ratio > 1 and numel >= config.min_compress_numel
    )
    check_host_budget(
        residual_bytes,
        fraction=config.host_memory_fraction,
        what="error-feedback residuals",
    )
    return CpuBackend(device)


def build_cuda_backend(
    params: Sequence[torch.nn.Parameter],
    config: EngineConfig,
    device: torch.device,
    *,
    ratio: float,
    cuda: object = torch.cuda,
    allocate: object = allocate_pinned,
) -> CudaBackend:
    """A `CudaBackend` whose pinned pool has a slot for every parameter.

    ``cuda`` and ``allocate`` stand in for `torch.cuda` and pinned allocation in tests.
    """
    if config.selection == "threshold":
        raise ValueError(
            "selection='threshold' is not supported on CUDA: counting the entries above the "
            "threshold needs a host sync inside backward. Use selection='auto' or 'exact'."
        )
    host_residual = config.error_feedback and config.residual_location == "host"
    layout = {
        p: slot_spec(
            p,
            ratio=ratio,
            min_compress_numel=config.min_compress_numel,
            residual_codec=ResidualCodec(config.residual_dtype) if host_residual else None,
            spare_residual=config.keep_previous_residual,
            warmup=config.warmup_steps > 0,
            quantized=config.value_dtype == "int8",
        )
        for p in params
    }
    needed = sum(spec.nbytes for spec in layout.values())
    if config.host_pool_mb is not None and needed > config.host_pool_mb * 2**20:
        raise ValueError(
            f"host_pool_mb={config.host_pool_mb} is below the {needed / 2**20:.1f} MiB the "
            "pool needs (one slot per parameter, sized for its largest payload). Raise "
            "host_pool_mb, raise compression_ratio, or leave host_pool_mb=None."
        )
    check_host_budget(
        needed, fraction=config.host_memory_fraction, what="the host pool of payload slots"
    )
    pool = HostPool(layout, allocate_pinned=allocate if config.pin_memory else None)
    return CudaBackend(
        device,
        pool,
        staging_depth=config.staging_depth,
        cuda=cuda,
        record_gradients=any(map(sharding.is_dtensor, params)),
    )
