"""The engine: hooks → buckets → encode → host store → restore.

Backward's post-accumulate-grad hook takes each gradient as soon as it is complete,
frees it from the parameter and adds it to the open bucket; a full bucket is handed to
the backend to encode and move to the host while backward goes on. `drain()` flushes
the partial bucket and waits; `apply()` and `step()` restore from the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..compression import DensePayload, Payload, SparsePayload, TopKEncoder
from .backend import Delivery, Restoring, create_backend
from .buckets import BucketAssembler, Item, chunk_by_bytes
from .config import EngineConfig
from .pool import check_host_budget, estimate_host_bytes
from .store import HostStore


@dataclass
class LayerRecord:
    """What one parameter's gradient cost in the last completed step."""

    numel: int
    dense_bytes: int
    stored_bytes: int
    kept: int
    compressed: bool


@dataclass
class StepRecord:
    layers: dict[str, LayerRecord] = field(default_factory=dict)


class Pipeline:
    """Offloads the gradients of ``named_params`` to the host and restores them."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        ratio: float,
        config: EngineConfig,
    ) -> None:
        self.config = config
        self.ratio = ratio
        self.names = {param: name for name, param in named_params}
        params = list(self.names)
        self.store = HostStore()
        # The backend delivers straight into the store: no reference back to the pipeline,
        # so a closed manager's model is freed at once, not at the next full gc.
        self.backend = create_backend(params, config, self.store.add, ratio=ratio)
        check_host_budget(
            estimate_host_bytes(
                params,
                ratio=ratio,
                config=config,
                count_payloads=self.backend.device.type != "cpu",
            ),
            config,
        )
        self.encoder = None
        if ratio > 1:
            selection = config.selection_for(self.backend.device)
            self.encoder = TopKEncoder(ratio=ratio, selection=selection)
        self.residuals: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.buckets = BucketAssembler(config.bucket_size_bytes)
        self.enabled = True
        self.last_step = StepRecord()
        self.steps = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    # --- capture (runs inside backward) -------------------------------------------

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if not self.enabled or grad is None or grad.is_sparse:
            return  # sparse (nn.Embedding(sparse=True)) gradients stay where they are
        param.grad = None
        bucket = self.buckets.add(param, grad)
        if bucket is not None:
            self._launch(bucket)

    def _launch(self, bucket: list[Item]) -> None:
        self.backend.launch([grad for _, grad in bucket], lambda: self._encode_bucket(bucket))

    def _encode_bucket(self, bucket: list[Item]) -> Delivery:
        """Runs where the backend runs it; reads each gradient once and drops it."""
        return [(param, self._encode(param, grad)) for param, grad in bucket]

    def _encode(self, param: torch.nn.Parameter, grad: torch.Tensor) -> Payload:
        flat = grad.detach().reshape(-1)
        if not self._compresses(param):
            return DensePayload(flat)
        residual = None
        if self.config.error_feedback:
            residual = self.residuals.get(param)
            if residual is None:
                residual = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
                self.residuals[param] = residual
        return self.encoder.encode(flat, residual)

    def _compresses(self, param: torch.nn.Parameter) -> bool:
        return self.encoder is not None and param.numel() >= self.config.min_compress_numel

    # --- drain and restore (runs between backward and the optimizer) --------------

    def drain(self) -> None:
        """Encode the partial bucket and wait until the store holds every gradient."""
        bucket = self.buckets.flush()
        if bucket is not None:
            self._launch(bucket)
        self.backend.wait()
        if self.encoder is not None:
            # Reused across one backward's tensors; between steps nothing stays behind.
            self.encoder.selector.release_scratch()

    def discard(self) -> None:
        """Wait for launched buckets, then drop every stored gradient."""
        self.drain()
        if len(self.store):
            self.store.clear()
            self.backend.restored()  # nothing will read the host payloads any more

    def apply(self) -> None:
        """Drain, then put every stored gradient back into ``param.grad``."""
        self.drain()
        self._record_step()
        self.restore_all()

    def restore_all(self) -> None:
        """Put every stored gradient back into ``param.grad`` (added to any already there)."""
        for param, _ in self.store.items():
            self._restore(param)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
    ) -> torch.Tensor | None:
        """Restore and step bucket by bucket; see GradientCacheHookManager.step."""
        self.drain()
        self._record_step()
        in_optimizer = {p for group in optimizer.param_groups for p in group["params"]}
        # A stored gradient that also has a device part, or that the optimizer does not
        # own, is restored in full first: it then behaves like any device gradient.
        for param, _ in self.store.items():
            if param.grad is not None or param not in in_optimizer:
                self._restore(param)
        held = {p: p.grad for p in in_optimizer if p.grad is not None}
        total_norm = None
        scale = None
        if max_grad_norm is not None:
            total_norm = self._total_norm(list(held.values()), norm_type)
            scale = torch.clamp(max_grad_norm / (total_norm + 1e-6), max=1.0)
            scale = scale.to(self.backend.device)
        for param in held:
            param.grad = None  # hidden from the bucket steps, stepped once at the end
        stored = [param for param, _ in self.store.items()]
        size_of = lambda p: p.numel() * p.element_size()  # noqa: E731
        chunks = list(chunk_by_bytes(stored, self.config.bucket_size_bytes, size_of))
        ahead = self._restore_ahead(chunks[0], scale) if chunks else None
        for i, chunk in enumerate(chunks):
            current = ahead
            if i + 1 < len(chunks):
                ahead = self._restore_ahead(chunks[i + 1], scale)  # overlaps this step
            for param, grad in self.backend.ready(current):
                param.grad = grad
            optimizer.step()
            for param in chunk:
                param.grad = None  # only this bucket's dense gradients were on the device
        if chunks:
            self.backend.restored()  # after the last bucket's ready(): every copy is queued
        if held:
            for param, grad in held.items():
                param.grad = grad if scale is None else grad.mul_(scale.to(grad.device))
            optimizer.step()
        return total_norm

    def _restore_ahead(
        self, params: list[torch.nn.Parameter], scale: torch.Tensor | None
    ) -> Restoring:
        items = [(param, self.store.pop(param)) for param in params]
        return self.backend.restore_ahead(items, scale=scale)

    def _total_norm(self, device_grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The global gradient norm, from the host copies plus any device gradients.

        A sparse payload's norm is the norm of its values: the zeros add nothing.
        """
        norms = []
        for _, payload in self.store.items():
            kept = payload.tensor if isinstance(payload, DensePayload) else payload.values
            norms.append(torch.linalg.vector_norm(kept, norm_type, dtype=torch.float32))
        norms += [
            torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).cpu() for g in device_grads
        ]
        if not norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)

    def _restore(self, param: torch.nn.Parameter) -> None:
        payload = self.store.pop(param)
        dense = self.backend.restore(payload, param)
        if not len(self.store):
            self.backend.restored()
        if param.grad is None:
            param.grad = dense
        else:
            param.grad.add_(dense)

    # --- bookkeeping --------------------------------------------------------------

    def _record_step(self) -> None:
        """Keep what the store holds now as the figures of the step being completed."""
        if not len(self.store):
            return
        record = StepRecord()
        for param, payload in self.store.items():
            record.layers[self.names[param]] = LayerRecord(
                numel=param.numel(),
                dense_bytes=param.numel() * param.element_size(),
                stored_bytes=payload.nbytes,
                kept=(
                    payload.values.numel() if isinstance(payload, SparsePayload) else param.numel()
                ),
                compressed=self._compresses(param),
            )
        self.last_step = record
        self.steps += 1

    def residual_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.backend.close()
