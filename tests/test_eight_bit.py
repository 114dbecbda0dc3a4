"""The cache with 8-bit optimizers (the ``eightbit`` extra): bitsandbytes' and torchao's
AdamW8bit give, through the cache at ratio 1, the weights and the 8-bit state they give
without it (the state on the host, and the weights too); the planner's and the accounting's
8-bit state bytes.

Both libraries' CPU steps are elementwise within 256-entry blocks, so the same gradient
bits give the same bits out: every comparison here is exact (tolerance 0). torchao
compiles its step once per tensor shape and kind of state (torch.compile, a C++ compiler
needed): the model has two shapes, so two compilations, a few seconds each.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from torch import nn

import gradient_cache
from gradient_cache.demo.accounting import (
    OPTIMIZER_STATE,
    device_memory_meter,
    plain_tensors,
    storage_bytes,
)
from gradient_cache.demo.models import GPT_SIZES, TinyGPT
from gradient_cache.planner import PlanInputs, optimizer_state_bytes, plan

WIDTH = 64  # a 64 x 64 weight has 4096 entries: the smallest both libraries quantize
STEPS = 3
MICRO_BATCHES = 2
MAX_NORM = 1.0
LEARNING_RATE = 1e-2
# The fused step with offload_optimizer_state: gradients and 8-bit state both on the host.
STATE_ON_HOST = "fused step, state on the host"
# And the weights there too (offload_parameters): each bucket's weights and 8-bit state.
WEIGHTS_ON_HOST = "fused step, weights and state on the host"


def bitsandbytes_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    bnb = pytest.importorskip(
        "bitsandbytes", reason="needs the eightbit extra: pip install -e '.[eightbit]'"
    )
    return bnb.optim.AdamW8bit(params, lr=LEARNING_RATE)


def torchao_optim() -> ModuleType:
    optim = pytest.importorskip(
        "torchao.optim", reason="needs the eightbit extra: pip install -e '.[eightbit]'"
    )
    if not any(map(shutil.which, ("g++", "c++", "clang++"))):
        pytest.skip("torchao's optimizers compile their step (torch.compile): no C++ compiler")
    return optim


def torchao_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torchao_optim().AdamW8bit(params, lr=LEARNING_RATE)


LIBRARIES: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "bitsandbytes": bitsandbytes_adamw,
    "torchao": torchao_adamw,
}


class Stack(nn.Module):
    """Three 64 x 64 layers (8-bit state) and a LayerNorm (fp32 state: too small to
    quantize): two shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return self.norm(x)


def make_stack() -> Stack:
    torch.manual_seed(0)
    return Stack()


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, WIDTH, generator=generator), torch.randn(8, WIDTH, generator=generator))
        for _ in range(STEPS)
    ]


def train(
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], way: str
) -> tuple[Stack, torch.optim.Optimizer, list[float]]:
    """Two micro-batches a step and clipping at MAX_NORM: plain (``way="plain"``), or the
    cache lossless with ``"fused step"`` or ``"apply_gradients()"``. Returns the model,
    the optimizer and each step's gradient norm."""
    model = make_stack()
    optimizer = make_optimizer(list(model.parameters()))
    cache = None
    if way != "plain":
        # Buckets smaller than any gradient: the fused step steps each tensor on its own.
        cache = gradient_cache.create_gradient_cache(
            model,
            compression_ratio=1,
            bucket_size_mb=1e-3,
            offload_optimizer_state=way in (STATE_ON_HOST, WEIGHTS_ON_HOST),
            offload_parameters=way == WEIGHTS_ON_HOST,
        )
    norms = []
    for x, y in data():
        for xs, ys in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES), strict=True):
            loss = nn.functional.mse_loss(model(xs), ys, reduction="sum") / MICRO_BATCHES
            loss.backward()
            if cache is not None:
                cache.compress_and_free_gradients()
        if way in ("fused step", STATE_ON_HOST, WEIGHTS_ON_HOST):
            norms.append(cache.step(optimizer, max_grad_norm=MAX_NORM))
        else:
            if cache is not None:
                cache.apply_gradients()
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if way in (STATE_ON_HOST, WEIGHTS_ON_HOST):  # each state tensor: the cache's host copy
        host = cache.engine.optimizer_state.copies_of(optimizer)
        for param in model.parameters():
            for key, value in optimizer.state[param].items():
                assert not torch.is_tensor(value) or value.dim() == 0 or value is host[param][key]
    if way == WEIGHTS_ON_HOST:  # the weights moved with each step's buckets
        assert cache.summary().parameters_moved_mb > 0
    if cache is not None:
        cache.remove_hooks()
    return model, optimizer, [float(n) for n in norms]


def state_tensors(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[torch.Tensor]:
    """Every tensor of every parameter's state, in the model's order, 8-bit parts unpacked
    (torchao's codes, scales and code table)."""
    tensors = []
    for param in model.parameters():
        for _, value in sorted(optimizer.state[param].items()):
            if isinstance(value, torch.Tensor):
                tensors += plain_tensors(value)
            else:
                tensors.append(torch.tensor(value))  # bitsandbytes' step counter
    return tensors


@pytest.mark.parametrize("library", sorted(LIBRARIES))
@pytest.mark.parametrize("way", ["fused step", "apply_gradients()", STATE_ON_HOST, WEIGHTS_ON_HOST])
def test_cache_at_ratio_1_gives_the_8bit_optimizers_own_weights_and_state(
    library: str, way: str
) -> None:
    # The 8-bit path ran: the weights' moments are one byte an entry.
    assert same_as_plain(LIBRARIES[library], way) < 3 * WIDTH * WIDTH


def same_as_plain(
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], way: str
) -> int:
    """Plain's and the cache's (``way``) runs, with clipping at every step: the same norms,
    weights and every state tensor. The bytes of the first weight's state."""
    plain, plain_optimizer, plain_norms = train(make_optimizer, "plain")
    cached, cached_optimizer, cached_norms = train(make_optimizer, way)
    assert all(norm > MAX_NORM for norm in plain_norms)  # clipping acts at every step
    assert cached_norms == plain_norms
    for (name, expected), (_, got) in zip(
        plain.named_parameters(), cached.named_parameters(), strict=True
    ):
        assert torch.equal(got, expected), f"{name} differs by {(got - expected).abs().max()}"
    expected_state = state_tensors(plain_optimizer, plain)
    got_state = state_tensors(cached_optimizer, cached)
    assert len(got_state) == len(expected_state)
    for expected, got in zip(expected_state, got_state, strict=True):
        assert torch.equal(got, expected)
    return storage_bytes(
        t for t in plain_optimizer.state[plain.layers[0].weight].values() if torch.is_tensor(t)
    )


def test_planner_counts_8bit_state_as_the_libraries_hold_it() -> None:
    """Quantized tensors exactly (torchao: codes, block scales, two code tables and its
    step per tensor; bitsandbytes shares its two tables); the demo's GPT whole, with its
    fp32 biases and norms, within 1%."""
    per_param, per_tensor = optimizer_state_bytes("adamw8bit")
    shapes = [(WIDTH, WIDTH)] * 2  # one shape: torchao compiled it for the test above
    expected = plan(
        PlanInputs(
            tensors=[rows * cols for rows, cols in shapes],
            optimizer_state_bytes=per_param,
            optimizer_tensor_bytes=per_tensor,
        )
    ).device["plain"]["optimizer state"]
    params = [nn.Parameter(torch.zeros(shape)) for shape in shapes]
    held = {library: state_after_a_step(LIBRARIES[library], params) for library in LIBRARIES}
    assert held["torchao"] == expected
    assert held["bitsandbytes"] == expected - per_tensor * len(shapes) + 2 * 256 * 4

    with torch.device("meta"):
        sizes = [p.numel() for p in TinyGPT(GPT_SIZES["medium"]).parameters()]
    planned = plan(
        PlanInputs(tensors=sizes, optimizer_state_bytes=per_param, optimizer_tensor_bytes=0)
    ).device["plain"]["optimizer state"]
    model = TinyGPT(GPT_SIZES["medium"])
    measured = state_after_a_step(bitsandbytes_adamw, list(model.parameters()))
    assert planned < measured < 1.01 * planned


def state_after_a_step(
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    params: list[nn.Parameter],
) -> int:
    """Optimizer-state bytes as the demo's accounting counts them, after one step."""
    optimizer = make_optimizer(params)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    model = nn.Module()
    model.params = nn.ParameterList(params)
    with device_memory_meter(model, optimizer=optimizer) as meter:
        return meter.reading().by_category[OPTIMIZER_STATE]


def test_a_compiled_8bit_step_runs_inside_a_measured_phase() -> None:
    """torch.compile refuses to run under the CPU tracker's dispatch mode; `opaque()` lets
    torchao's step through, and the state it holds afterwards is counted."""
    model = make_stack()
    optimizer = torchao_adamw(list(model.parameters()))
    x, y = data()[0]
    with device_memory_meter(model, optimizer=optimizer) as meter:
        with meter.phase("step"):
            nn.functional.mse_loss(model(x), y).backward()
            with meter.opaque():
                optimizer.step()  # the first: it creates the state
        state = meter.reading().by_category[OPTIMIZER_STATE]
    assert "step" in meter.peaks
    weights = 3 * (2 * (WIDTH * WIDTH + WIDTH * WIDTH // 256 * 4 + 256 * 4) + 4)
    norm = 2 * (2 * WIDTH * 4 + 4)
    assert state == weights + norm


class Bf16MomentsAdamW(torch.optim.Optimizer):
    """AdamW whose moments are kept in bf16 (4 bytes a parameter): each update computed
    in fp32 from the widened moments, which are then rounded back. Any optimizer's state
    tensors travel as they are, whatever their dtype."""

    def __init__(self, params: list[nn.Parameter], lr: float = LEARNING_RATE) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "wd": 0.01})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), device=param.device)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
                state["step"] += 1
                grad = param.grad
                exp_avg = state["exp_avg"].float().mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2)
                exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                step = state["step"]
                denominator = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
                param.mul_(1 - group["lr"] * group["wd"])
                param.addcdiv_(exp_avg / (1 - beta1**step), denominator, value=-group["lr"])


def torchao_adamw_of(name: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return getattr(torchao_optim(), name)(params, lr=LEARNING_RATE)

    return make


#: Each optimizer, and its state's bytes a parameter and a tensor as the planner counts them
#: (`--optimizer`: a name, or bytes a parameter; the bf16 moments' step is a 4-byte tensor).
SMALLER_STATES = {
    "torchao 4-bit": (torchao_adamw_of("AdamW4bit"), optimizer_state_bytes("adamw4bit")),
    "torchao fp8": (torchao_adamw_of("AdamWFp8"), optimizer_state_bytes("adamwfp8")),
    "bf16 moments": (Bf16MomentsAdamW, (optimizer_state_bytes("4")[0], 4)),
}


@pytest.mark.parametrize("optimizer", sorted(SMALLER_STATES))
def test_state_smaller_than_fp32_on_the_host_with_the_weights_bit_for_bit(optimizer: str) -> None:
    """torchao's 4-bit and fp8 AdamW and an AdamW with bf16 moments, the weights and the
    state on the host: the weights, the norms and every state tensor as without the cache;
    the weights' moments take the bytes the planner counts."""
    make_optimizer, (per_param, per_tensor) = SMALLER_STATES[optimizer]
    weight_state = same_as_plain(make_optimizer, WEIGHTS_ON_HOST)
    assert weight_state == WIDTH * WIDTH * per_param + per_tensor
