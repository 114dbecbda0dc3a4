"""The contenders of `perf.peers`: ways to train with less device memory, each behind one
`Trainer` interface, and the scenarios they are measured in.

Every contender trains the same TinyGPT from the same seed with AdamW's settings (lr 1e-3,
betas (0.9, 0.999), weight decay 0.01). What a contender cannot do is said in words
(`Contender.refusal`), never skipped silently.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradient_cache import GradientCacheHookManager, create_gradient_cache
from gradient_cache.demo.accounting import (
    cache_tensors,
    optimizer_state_tensors,
    plain_tensors,
    view_bytes,
)
from gradient_cache.demo.models import TinyGPT
from gradient_cache.demo.training import Batch, PhaseScope, no_phase, train_step
from gradient_cache.engine.config import DEFAULT_COMPRESSION_RATIO

LEARNING_RATE = 1e-3


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A step: ``micro_batches`` forward/backward passes over ``batch_size`` sequences in
    all, then the optimizer, after clipping the global norm to ``max_grad_norm`` if set."""

    name: str
    micro_batches: int
    batch_size: int
    max_grad_norm: float | None
    summary: str


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            name="S1",
            micro_batches=1,
            batch_size=4,
            max_grad_norm=None,
            summary="one micro-batch of 4 sequences, no clipping",
        ),
        Scenario(
            name="S2",
            micro_batches=2,
            batch_size=4,
            max_grad_norm=1.0,
            summary="two micro-batches of 2 sequences (accumulation), clipping at 1.0",
        ),
    )
}

EXTRA = "pip install -e '.[eightbit]'"


@dataclass(frozen=True, kw_only=True)
class Contender:
    """One way of training. ``optimizer``: "adamw", "bitsandbytes" or "torchao" (their
    AdamW8bit), "cpu-offload" (torchao's CPUOffloadOptimizer around AdamW) or "fsdp-offload"
    (FSDP2 with CPUOffloadPolicy, world size 1). ``way``: how the step runs."""

    key: str
    label: str
    optimizer: str = "adamw"
    way: str = "plain"  # "plain", "in backward", "apply", "fused"
    ratio: float | None = None  # the cache's compression ratio; None: no cache
    offload_gradients: bool = False  # cpu-offload only
    state_on_host: bool = False  # the cache's offload_optimizer_state
    #: The contender whose final weights this one must equal bit for bit, if any.
    exact_reference: str | None = None
    cuda_only: bool = False

    def refusal(self, scenario: Scenario, device: torch.device) -> str | None:
        """Why this contender cannot run ``scenario`` on ``device``; None if it can."""
        if self.cuda_only and device.type != "cuda":
            return "CUDA only: it moves state from a GPU to the host; on a CPU there is no device"
        missing = _missing_package(self.optimizer)
        if missing is not None:
            return f"{missing} is not installed ({EXTRA})"
        if self.way == "in backward" and scenario.max_grad_norm is not None:
            return (
                "not supported: clipping needs the global norm of every gradient before the "
                "first parameter steps, and in backward each parameter steps as soon as its "
                "gradient is complete (and each micro-batch would step: no accumulation)"
            )
        if self.optimizer == "cpu-offload" and scenario.max_grad_norm is not None:
            reason = (
                "not supported: its backward hook copies each gradient to the host as it is "
                "produced and the CPU step reads those copies, so clip_grad_norm_ on the "
                "model's gradients does not reach the step"
            )
            if self.offload_gradients:
                reason += "; offload_gradients=True also refuses accumulation (torchao's doc)"
            return reason
        return None


def _missing_package(optimizer: str) -> str | None:
    module = {"bitsandbytes": "bitsandbytes", "torchao": "torchao", "cpu-offload": "torchao"}
    name = module.get(optimizer)
    if name is not None and importlib.util.find_spec(name) is None:
        return name
    return None


CONTENDERS = {
    c.key: c
    for c in (
        Contender(key="plain", label="plain AdamW"),
        Contender(
            key="in-backward",
            label="AdamW step in backward",
            way="in backward",
            exact_reference="plain",
        ),
        Contender(key="bnb", label="bitsandbytes AdamW8bit", optimizer="bitsandbytes"),
        Contender(key="torchao", label="torchao AdamW8bit", optimizer="torchao"),
        Contender(
            key="cache-apply",
            label="cache r=1, apply_gradients()",
            way="apply",
            ratio=1,
            exact_reference="plain",
        ),
        Contender(
            key="cache-fused",
            label="cache r=1, fused step",
            way="fused",
            ratio=1,
            exact_reference="plain",
        ),
        Contender(
            key="cache-default",
            label=f"cache r={DEFAULT_COMPRESSION_RATIO:g} (default codec), fused step",
            way="fused",
            ratio=DEFAULT_COMPRESSION_RATIO,
        ),
        Contender(
            key="cache-fused-bnb",
            label="cache r=1, fused step + bitsandbytes AdamW8bit",
            optimizer="bitsandbytes",
            way="fused",
            ratio=1,
            exact_reference="bnb",
        ),
        Contender(
            key="cache-fused-state",
            label="cache r=1, fused step, state on host",
            way="fused",
            ratio=1,
            state_on_host=True,
            exact_reference="plain",
        ),
        Contender(
            key="cache-fused-state-bnb",
            label="cache r=1, fused step, state on host + bitsandbytes AdamW8bit",
            optimizer="bitsandbytes",
            way="fused",
            ratio=1,
            state_on_host=True,
            exact_reference="bnb",
        ),
        Contender(
            key="cache-fused-torchao",
            label="cache r=1, fused step + torchao AdamW8bit",
            optimizer="torchao",
            way="fused",
            ratio=1,
            exact_reference="torchao",
        ),
        Contender(
            key="cpu-offload",
            label="torchao CPUOffloadOptimizer(AdamW)",
            optimizer="cpu-offload",
            cuda_only=True,
        ),
        Contender(
            key="cpu-offload-grads",
            label="torchao CPUOffloadOptimizer(AdamW, offload_gradients=True)",
            optimizer="cpu-offload",
            offload_gradients=True,
            cuda_only=True,
        ),
        Contender(
            key="fsdp-offload",
            label="FSDP2 CPUOffloadPolicy, world size 1",
            optimizer="fsdp-offload",
            cuda_only=True,
        ),
    )
}
#: Run by default: the stacked torchao row compiles torchao's step a second time for little
#: news beyond the bitsandbytes one (both are tested bit for bit in tests/test_eight_bit.py).
DEFAULT_CONTENDERS = tuple(k for k in CONTENDERS if k != "cache-fused-torchao")


@dataclass(kw_only=True)
class Trainer:
    """A model trained the way a contender says: ``step`` runs one scenario step."""

    contender: Contender
    model: nn.Module
    optimizer: Any  # a torch Optimizer, a list of them (in backward), or CPUOffloadOptimizer
    cache: GradientCacheHookManager | None = None
    #: Optimizers whose step torch.compile runs (torchao's): measured as one operator.
    compiled_step: bool = False
    #: Called by `close`, last first: hooks to remove, a process group to end.
    on_close: list[Callable[[], None]] = field(default_factory=list)

    @property
    def meter_optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """The optimizers whose state lives on the device (what the CPU tracker tags)."""
        if self.contender.optimizer == "fsdp-offload":
            return ()  # its state is on the host
        if self.contender.optimizer == "cpu-offload":  # parameters under 4096 entries stay
            return [] if self.optimizer.d_opt is None else [self.optimizer.d_opt]
        if isinstance(self.optimizer, list):
            return self.optimizer
        return [self.optimizer]

    def step(
        self, micro_batches: Sequence[Batch], scenario: Scenario, *, phase: PhaseScope = no_phase
    ) -> float:
        """One step of ``scenario`` on ``micro_batches``; its mean loss."""
        way = self.contender.way
        loss = train_step(
            self.model,
            None if way == "in backward" else self.optimizer,  # stepped in its hooks
            self.cache,
            micro_batches,
            fused=way == "fused",
            max_grad_norm=scenario.max_grad_norm,
            phase=phase,
        )
        return loss.item()

    def host_bytes(self) -> int:
        """Bytes this contender keeps in host memory now (on a CPU: what it would)."""
        if self.cache is not None:
            host, _ = cache_tensors(self.cache)
            return view_bytes(host())
        if self.contender.optimizer == "cpu-offload":
            return _cpu_offload_host_bytes(self.optimizer)
        if self.contender.optimizer == "fsdp-offload":
            params = list(self.model.parameters())
            grads = [p.grad for p in params if p.grad is not None]
            state = optimizer_state_tensors(self.optimizer)
            tensors = [t for each in (*params, *grads) for t in plain_tensors(each)]
            return view_bytes(t for t in (*tensors, *state) if t.device.type == "cpu")
        return 0

    def close(self) -> None:
        if self.cache is not None:
            self.cache.remove_hooks()
        while self.on_close:
            self.on_close.pop()()


def build(contender: Contender, model: TinyGPT) -> Trainer:
    """A `Trainer` for ``contender`` around ``model`` (already on its device)."""
    if contender.optimizer == "fsdp-offload":
        return _fsdp_offload(contender, model)
    if contender.optimizer == "cpu-offload":
        torchao_optim = importlib.import_module("torchao.optim")
        optimizer = torchao_optim.CPUOffloadOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            offload_gradients=contender.offload_gradients,
            lr=LEARNING_RATE,
        )
        return Trainer(contender=contender, model=model, optimizer=optimizer)
    if contender.way == "in backward":
        return _in_backward(contender, model)
    optimizer = make_optimizer(contender.optimizer, list(model.parameters()))
    cache = None
    if contender.ratio is not None:
        cache = create_gradient_cache(
            model,
            compression_ratio=contender.ratio,
            offload_optimizer_state=contender.state_on_host,
        )
    return Trainer(
        contender=contender,
        model=model,
        optimizer=optimizer,
        cache=cache,
        compiled_step=contender.optimizer == "torchao",
    )


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW, or an 8-bit AdamW: the libraries' defaults match torch's AdamW but for the
    state (weight decay 0.01; tensors under 4096 entries keep fp32 state)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LEARNING_RATE)
    if name == "bitsandbytes":
        return importlib.import_module("bitsandbytes").optim.AdamW8bit(params, lr=LEARNING_RATE)
    if name == "torchao":
        return importlib.import_module("torchao.optim").AdamW8bit(params, lr=LEARNING_RATE)
    raise ValueError(f"Unknown optimizer {name!r}.")


def _in_backward(contender: Contender, model: nn.Module) -> Trainer:
    """PyTorch's recipe: one optimizer per parameter, stepped (and its gradient freed) in
    the parameter's post-accumulate-grad hook, so no gradient outlives its backward."""
    optimizers = {p: torch.optim.AdamW([p], lr=LEARNING_RATE) for p in model.parameters()}

    def step_now(param: nn.Parameter) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)

    handles = [p.register_post_accumulate_grad_hook(step_now) for p in optimizers]
    trainer = Trainer(contender=contender, model=model, optimizer=list(optimizers.values()))
    trainer.on_close += [handle.remove for handle in handles]
    return trainer


def _cpu_offload_host_bytes(optimizer: Any) -> int:
    """torchao's CPUOffloadOptimizer: host copies of the parameters and gradients, and the
    host optimizers' state (it keeps these in its own attributes)."""
    tensors = []
    for host in optimizer.param_d2h_map.values():
        tensors += [host, host.grad]
    tensors += optimizer_state_tensors(list(optimizer.optim_dict.values()))
    return view_bytes(t for t in tensors if t is not None and t.device.type == "cpu")


def _fsdp_offload(contender: Contender, model: TinyGPT) -> Trainer:
    """FSDP2 with CPUOffloadPolicy at world size 1: parameters, gradients and AdamW's state
    on the host, the step on the CPU; each block is its own FSDP group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if next(model.parameters()).is_cuda else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    policy = CPUOffloadPolicy()
    for block in model.blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    trainer = Trainer(contender=contender, model=model, optimizer=optimizer)
    trainer.on_close.append(dist.destroy_process_group)
    return trainer


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
