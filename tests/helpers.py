"""Test helpers: shared models, data, and a reference training loop for comparing against
plain PyTorch. Imported as a module (``from helpers import ...``): pytest's ``pythonpath``
setting puts tests/ on the path in every import mode."""

from __future__ import annotations

import contextlib
import gc
import inspect
import io
import sys
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import gradient_cache


class TiedLM(nn.Module):
    """Embedding, an MLP, a LayerNorm and an output head tied to the embedding."""

    def __init__(self, vocab: int = 64, width: int = 32, *, with_unused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.norm = nn.LayerNorm(width)
        self.unused = nn.Linear(width, width) if with_unused else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)  # [batch, seq, width]
        hidden = self.norm(hidden + self.mlp(hidden))
        return hidden @ self.embed.weight.t()  # [batch, seq, vocab], tied head


def make_model(seed: int = 0, **kwargs) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM(**kwargs)


def batches(
    steps: int, *, vocab: int = 64, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(vocab, (4, 8), generator=generator),
            torch.randint(vocab, (4, 8), generator=generator),
        )
        for _ in range(steps)
    ]


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def finish_step(
    manager: gradient_cache.GradientCacheHookManager | None,
    optimizer: torch.optim.Optimizer,
    *,
    fused_step: bool,
) -> None:
    """The step after backward: plain, apply_gradients() then step, or the fused step."""
    if manager is None:
        optimizer.step()
    elif fused_step:
        manager.step(optimizer)
    else:
        manager.apply_gradients()
        optimizer.step()
    optimizer.zero_grad()


def train(
    model: nn.Module,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    manager: gradient_cache.GradientCacheHookManager | None = None,
    make_optimizer: OptimizerFactory = adam,
    micro_batches: int = 1,
    fused_step: bool = False,
    compress_each_micro_batch: bool = True,
) -> list[float]:
    """The user's loop: plain when ``manager`` is None, else with the cache's calls."""
    optimizer = make_optimizer(list(model.parameters()))
    losses = []
    for tokens, targets in data:
        for part in range(micro_batches):
            rows = slice(
                part * len(tokens) // micro_batches, (part + 1) * len(tokens) // micro_batches
            )
            loss = loss_of(model, tokens[rows], targets[rows]) / micro_batches
            loss.backward()
            losses.append(loss.item())
            if manager is not None and compress_each_micro_batch:
                manager.compress_and_free_gradients()
        finish_step(manager, optimizer, fused_step=fused_step)
    return losses


class MadeGradients:
    """Each gradient of ``model`` as backward made it, before the cache takes it (hooks
    registered before the cache's run first): what the fused step's clip norm is of."""

    def __init__(self, model: nn.Module) -> None:
        self.grads: dict[nn.Parameter, torch.Tensor] = {}
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(self._keep)

    def _keep(self, param: nn.Parameter) -> None:
        assert param.grad is not None
        self.grads[param] = param.grad.clone()

    def clip_as_the_fused_step(
        self, model: nn.Module, step: int, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip ``model``'s restored gradients (``apply_gradients``) as ``step(optimizer,
        max_grad_norm=max_norm)`` does at its ``step``-th call (from 0): by the norm of the
        restored gradients at the first (read from the payloads), of the gradients as
        backward made them afterwards (computed by the encodes). Returns that norm."""
        if step == 0:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        norm = torch.nn.utils.get_total_norm([self.grads[p] for p in model.parameters()], norm_type)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
        return norm


def assert_same_parameters(left: nn.Module, right: nn.Module, *, atol: float = 0.0) -> None:
    for (name, a), (_, b) in zip(left.named_parameters(), right.named_parameters(), strict=True):
        if atol == 0.0:
            assert torch.equal(a, b), f"{name} differs by {(a - b).abs().max().item()}"
        else:
            torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=f"{name} differs")


class FailsOnce:
    """Once armed, makes the ``nth`` next update of ``optimizer`` raise before changing
    anything (``after``: once it changed every state entry of the parameters with a
    gradient but no weight, as an out-of-memory error inside Adam at ``_foreach_sqrt``,
    after it counted the step and moved the moments): each bucket's, in a fused step
    (which steps its buckets without step hooks, so this is no hook: the optimizer's class
    becomes a subclass whose ``step`` counts)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, after: bool = False) -> None:
        self.calls = 0
        self.fail_at = None
        parent = type(optimizer)
        watch = self

        def step(opt, *args, **kwargs):
            watch.calls += 1
            if watch.calls == watch.fail_at:
                stepped = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
                for state in (opt.state.get(p, {}) for p in stepped if after):
                    for value in state.values():
                        value.add_(1)
                raise torch.OutOfMemoryError("injected: out of memory")
            return parent.step(opt, *args, **kwargs)

        optimizer.__class__ = type(f"FailsOnce{parent.__name__}", (parent,), {"step": step})

    def arm(self, nth: int) -> None:
        self.fail_at = self.calls + nth


def after_each_update(optimizer: torch.optim.Optimizer, check: Callable[..., None]) -> None:
    """Call ``check(optimizer)`` after each update of ``optimizer``: each bucket's, in a
    fused step (whose step hooks fire once, around the whole step: see `FailsOnce`)."""
    parent = type(optimizer)

    def step(opt, *args, **kwargs):
        out = parent.step(opt, *args, **kwargs)
        check(opt)
        return out

    optimizer.__class__ = type(f"Checked{parent.__name__}", (parent,), {"step": step})


def train_through_a_failed_step(
    plain: nn.Module,
    cached: nn.Module,
    manager: gradient_cache.GradientCacheHookManager,
    *,
    nth: int,
    clip: float | None,
    after_failure: Callable[[], object] = lambda: None,
) -> None:
    """Three Adam steps, plain against the cache's fused step. In the second, the cache's
    ``nth`` ``optimizer.step()`` raises once; ``after_failure()`` runs, then the user calls
    ``step`` again."""
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.Adam(cached.parameters(), lr=1e-2)
    failure = FailsOnce(cached_opt)
    for i, (tokens, targets) in enumerate(batches(3)):
        loss_of(plain, tokens, targets).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        plain_opt.step()
        plain_opt.zero_grad()
        loss_of(cached, tokens, targets).backward()
        if i == 1:
            failure.arm(nth)
            with pytest.raises(torch.OutOfMemoryError):
                manager.step(cached_opt, max_grad_norm=clip)
            # What was not stepped is kept: cached buckets, or device gradients put back.
            kept = any(p.grad is not None for p in cached.parameters())
            assert manager.engine.store or kept
            after_failure()
        manager.step(cached_opt, max_grad_norm=clip)
        cached_opt.zero_grad()


def train_with_a_skipped_batch(
    options: dict | None, *, skip: bool, fused_step: bool = False, discard: bool = True
) -> torch.nn.Module:
    """Four Adam steps; with ``skip``, a batch whose step is skipped comes before the third.

    The skipped batch gets the user's calls for a skipped step: backward, then (with a
    cache and ``discard``) ``discard_gradients()``, and ``zero_grad()``, which drops the
    cached gradients too. ``options`` None is plain.
    """
    model = make_model()
    manager = None if options is None else gradient_cache.create_gradient_cache(model, **options)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    skipped = batches(1, seed=7)[0]
    for index, (tokens, targets) in enumerate(batches(4)):
        if skip and index == 2:
            loss_of(model, *skipped).backward()
            if manager is not None and discard:
                manager.compress_and_free_gradients()
                manager.discard_gradients()
            optimizer.zero_grad()
        loss_of(model, tokens, targets).backward()
        finish_step(manager, optimizer, fused_step=fused_step)
    return model


# --- checkpoint runs (tests/test_checkpoint.py, and the stand-in CUDA ones) -------------

CHECKPOINT_STEPS = 5
CHECKPOINT_MICRO_BATCHES = 2
CHECKPOINT_DATA = batches(CHECKPOINT_STEPS * CHECKPOINT_MICRO_BATCHES)

CHECKPOINT_RECIPES = {
    "lossless": dict(compression_ratio=1),
    "r100 top-k only": dict(compression_ratio=100, codec="topk", error_feedback=False),
    # Top-k's defaults: error feedback with an int8 residual (stochastic rounding) and, on
    # the CPU, threshold selection (random samples): both draw from the engine's
    # generators, which the checkpoint must carry.
    "r100 error feedback": dict(compression_ratio=100, codec="topk"),
    "r100 int8 values, warm-up": dict(
        compression_ratio=100, codec="topk", value_dtype="int8", warmup_steps=2
    ),
    # The default: the ladder at the default ratio (int8 codes for fp32, stochastic
    # rounding from the engine's generators); the block codecs' dither offsets too.
    "default": dict(),
    "q4": dict(codec="q4"),
    "sign": dict(codec="sign"),
    "ratio 100 by the ladder": dict(compression_ratio=100),
}


def build_checkpointed(options: dict):
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, min_compress_numel=1, **options)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, manager, optimizer


def run_checkpointed(model, manager, optimizer, micro_batches: range) -> None:
    """Train on micro-batches ``micro_batches`` (indices into CHECKPOINT_DATA), stepping
    after each pair."""
    for index in micro_batches:
        loss_of(model, *CHECKPOINT_DATA[index]).backward()
        manager.compress_and_free_gradients()
        if index % CHECKPOINT_MICRO_BATCHES == CHECKPOINT_MICRO_BATCHES - 1:
            manager.apply_gradients()
            optimizer.step()
            optimizer.zero_grad()


def save_and_load(model, manager, optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "cache": manager.state_dict(),
        },
        buffer,
    )
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def resumed_run(options: dict, cut: int):
    """Train to micro-batch ``cut``, checkpoint, build everything anew, load, train on."""
    model, manager, optimizer = build_checkpointed(options)
    run_checkpointed(model, manager, optimizer, range(cut))
    saved = save_and_load(model, manager, optimizer)
    manager.remove_hooks()
    model, manager, optimizer = build_checkpointed(options)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    manager.load_state_dict(saved["cache"])
    run_checkpointed(
        model, manager, optimizer, range(cut, CHECKPOINT_STEPS * CHECKPOINT_MICRO_BATCHES)
    )
    return model, manager


def detach_managers_other_tests_left() -> None:
    """Detach every manager still attached in this process: pytest's saved tracebacks and
    the docs' shared namespaces keep earlier tests' managers alive, and any attached
    manager keeps the gradient readers swapped. For tests of the swap itself."""
    import gc

    from gradient_cache import manager

    gc.collect()
    for attached in list(manager._attached):
        attached.remove_hooks()


def stepping_and_off_the_host(
    manager: gradient_cache.GradientCacheHookManager, optimizer: torch.optim.Optimizer
) -> tuple[set[torch.nn.Parameter], set[torch.nn.Parameter]]:
    """During a bucket's update (`after_each_update`): the parameters it steps (those with a
    gradient) and those whose offloaded state is not their host copy (on the device)."""
    host = manager.engine.optimizer_state.copies_of(optimizer)
    stepping = {p for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
    off_host = {
        p
        for p, state in optimizer.state.items()
        if any(v.dim() > 0 and v is not host.get(p, {}).get(k) for k, v in state.items())
    }
    return stepping, off_host


def assert_a_closed_manager_lets_the_model_go_without_a_gc_pass(
    build: Callable[[], tuple[nn.Module, object]],
) -> None:
    """``build()``'s model freed by reference counting alone once its manager is closed and
    both are dropped: no reference cycle (on a GPU, one holds the weights until a full gc).
    Built here, so that this frame holds the only references."""
    model, manager = build()
    weight = weakref.ref(next(model.parameters()))
    gc.collect()
    gc.disable()
    try:
        manager.remove_hooks()
        del model, manager
        assert weight() is None
    finally:
        gc.enable()


@contextlib.contextmanager
def interrupt_at(function: Callable[..., object], line: str, *, nth: int = 1) -> Iterator[None]:
    """Within it, a KeyboardInterrupt raised in ``function`` as it reaches the ``nth`` run of
    its line whose text (stripped) is ``line``, as a signal (Ctrl-C) lands between two
    statements (through ``sys.settrace``)."""
    code = function.__code__
    lines = inspect.getsourcelines(function)
    numbers = [lines[1] + i for i, text in enumerate(lines[0]) if text.strip() == line]
    if len(numbers) != 1:
        raise ValueError(f"{line!r} is not one line of {function.__qualname__}")
    runs = 0

    def local(frame, event, arg):
        nonlocal runs
        if event == "line" and frame.f_lineno == numbers[0]:
            runs += 1
            if runs == nth:
                raise KeyboardInterrupt
        return local

    def calls(frame, event, arg):
        return local if frame.f_code is code and runs < nth else None

    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(None)
