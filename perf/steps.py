"""Training-step variants timed and measured by the perf runs, the naive reference included.

Every variant trains its own copy of the same TinyGPT with Adam; ``build`` returns its
`Trainer`, whose step is the shared one (`gradient_cache.demo.training.train_step`). The
naive reference is the straightforward synchronous way to top-k gradients, written here
and not in the library: after backward, copy each dense gradient to the host, run
torch.topk there, and send the kept entries back.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradient_cache import GradientCacheHookManager, create_gradient_cache
from gradient_cache.codecs import keep_count
from gradient_cache.demo.models import GPT_SIZES, TinyGPT, make_batches
from gradient_cache.demo.training import Batch, PhaseScope, no_phase, train_step
from gradient_cache.engine.config import DEFAULT_COMPRESSION_RATIO


@dataclass(frozen=True, kw_only=True)
class StepVariant:
    """One way of training. ``ratio=None`` without ``naive`` is plain PyTorch."""

    name: str
    ratio: float | None = None
    fused_step: bool = False  # the cache's step(optimizer) instead of apply + step
    naive: bool = False  # the synchronous host top-k reference at ``ratio``
    fused_adam: bool = False  # torch.optim.Adam(fused=True), for plain and variant alike
    codec: str | None = None  # EngineConfig.codec; None: the ladder picks by ``ratio``
    state_on_host: bool = False  # offload_optimizer_state (with the fused step)

    @property
    def baseline(self) -> StepVariant:
        """Plain PyTorch with the same optimizer: what this variant is compared with."""
        return StepVariant(name="plain", fused_adam=self.fused_adam)


DEFAULT_NAME = f"cache default r={DEFAULT_COMPRESSION_RATIO:g}"
STEP_VARIANTS = (
    StepVariant(name="plain"),
    StepVariant(name="cache r=1", ratio=1),
    StepVariant(name="cache r=1, fused step", ratio=1, fused_step=True),
    StepVariant(
        name=f"cache default r={DEFAULT_COMPRESSION_RATIO:g}", ratio=DEFAULT_COMPRESSION_RATIO
    ),
    StepVariant(
        name=f"{DEFAULT_NAME}, fused step",
        ratio=DEFAULT_COMPRESSION_RATIO,
        fused_step=True,
    ),
    StepVariant(name="cache top-k r=100", ratio=100, codec="topk"),
    StepVariant(name="naive sync top-k r=100", ratio=100, naive=True),
    StepVariant(
        name="cache top-k r=100, Adam(fused=True)", ratio=100, codec="topk", fused_adam=True
    ),
)


def gpt(size: str, *, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPT_SIZES[size])


def batch_stream(model: TinyGPT, *, batch_size: int, seed: int = 0) -> Callable[[], Batch]:
    """A function returning a fresh random (inputs, targets) batch per call."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, (64 * config.seq_len,), generator=generator)
    return lambda: make_batches(
        tokens, batch_size=batch_size, seq_len=config.seq_len, generator=generator
    )


def adam(model: torch.nn.Module, *, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None)


@dataclass
class Trainer:
    """A model copy, its optimizer, and the cache a variant adds (None: plain or naive)."""

    model: TinyGPT
    optimizer: torch.optim.Optimizer
    cache: GradientCacheHookManager | None
    fused_step: bool

    def step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        phase: PhaseScope = no_phase,
        keep_logits: bool = False,
    ) -> None:
        """One training step on the batch ``(x, y)`` (`train_step`'s options)."""
        train_step(
            self.model,
            self.optimizer,
            self.cache,
            [(x, y)],
            fused=self.fused_step,
            keep_logits=keep_logits,
            phase=phase,
        )


def build(variant: StepVariant, base: TinyGPT, **cache_options: object) -> Trainer:
    """A fresh copy of ``base`` trained the way ``variant`` says."""
    model = copy.deepcopy(base)
    optimizer = adam(model, fused=variant.fused_adam)
    cache = None
    if variant.naive:
        # After backward, before the optimizer reads the gradients: where a user's loop
        # would call it.
        optimizer.register_step_pre_hook(lambda *_: naive_topk_(model, ratio=variant.ratio))
    elif variant.ratio is not None:
        if variant.codec is not None:
            cache_options = {"codec": variant.codec, **cache_options}
        if variant.state_on_host:
            cache_options = {"offload_optimizer_state": True, **cache_options}
        cache = create_gradient_cache(model, compression_ratio=variant.ratio, **cache_options)
    return Trainer(model=model, optimizer=optimizer, cache=cache, fused_step=variant.fused_step)


@torch.no_grad()
def naive_topk_(model: torch.nn.Module, *, ratio: float) -> None:
    """Replace each gradient by its top 1/ratio entries, computed on the host, synchronously."""
    for param in model.parameters():
        if param.grad is None:
            continue
        host = param.grad.to("cpu", copy=True).reshape(-1)  # the D2H copy (a copy on CPU too)
        indices = torch.topk(host.abs(), keep_count(host.numel(), ratio), sorted=False).indices
        values = host[indices]
        dense = torch.zeros(host.numel(), dtype=host.dtype, device=param.device)
        dense[indices.to(param.device)] = values.to(param.device)  # H2D, then scatter
        param.grad = dense.view_as(param)
