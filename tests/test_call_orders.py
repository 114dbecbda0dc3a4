"""The public API driven in random but legal orders, against a plain PyTorch twin, bit for bit.

A `hypothesis` state machine trains one model through a lossless cache
(``compression_ratio=1``) and a twin without one (same initial weights, same micro-batches,
same optimizer: Adam or SGD with momentum), calling the cache in whatever legal order it
draws: backward (1 to 3 micro-batches per step), ``compress_and_free_gradients()``,
``disable()`` / ``enable()`` between micro-batches, ``apply_gradients()`` then
``optimizer.step()``, the fused ``step(optimizer)`` with and without ``max_grad_norm``,
``discard_gradients()``, ``state_dict()`` loaded into a new manager on the same model
(mid-accumulation too), an ``optimizer.step()`` that raises once (then the retry, or the
discard), and calls the API refuses: each must raise its documented error and change
nothing. After every call the weights must equal the twin's (`torch.equal`), and so must the
restored gradients, the clip norm and the summary's step count. It runs on the CPU backend
and on the CUDA backend with the stand-in streams of tests/test_stream_order.py, whose
checker must see no ordering error.

The default run is sized for CI (40 runs of up to 20 calls a backend) and deterministic
(fixed seeds, no example database). To search longer::

    GRADIENT_CACHE_HYPOTHESIS_EXAMPLES=1000 GRADIENT_CACHE_HYPOTHESIS_STEPS=40 \\
        .venv/bin/python -m pytest tests/test_call_orders.py

``GRADIENT_CACHE_HYPOTHESIS_SEED=<int>`` (default 0) starts the seeds elsewhere, for other
orders. A failure prints the order of calls that produced it;
``GRADIENT_CACHE_HYPOTHESIS_SHRINK=1`` shrinks it to the shortest such order first (that
can take minutes, so CI runs without it).
"""

from __future__ import annotations

import io
import math
import os
import warnings

import pytest
import torch
from helpers import FailsOnce, assert_same_parameters, batches, loss_of, make_model
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from stream_checker import StreamChecker

# The stand-in CUDA streams (a pytest fixture, found here by name).
from test_stream_order import fake_accelerator  # noqa: F401

import gradient_cache
from gradient_cache.engine.bucket import BucketState
from gradient_cache.engine.records import GradientAt
from gradient_cache.engine.step_state import StepState

EXAMPLES = int(os.environ.get("GRADIENT_CACHE_HYPOTHESIS_EXAMPLES", "40"))
STEPS = int(os.environ.get("GRADIENT_CACHE_HYPOTHESIS_STEPS", "20"))
FIRST_SEED = int(os.environ.get("GRADIENT_CACHE_HYPOTHESIS_SEED", "0"))
SHRINK = os.environ.get("GRADIENT_CACHE_HYPOTHESIS_SHRINK", "") not in ("", "0")
# The examples are split between a few fixed seeds: a short hypothesis run spends most of
# its examples on variations of its first few, so several short runs see more orders.
SEEDS = range(FIRST_SEED, FIRST_SEED + 4)

SETTINGS = settings(
    max_examples=max(1, EXAMPLES // len(SEEDS)),
    stateful_step_count=STEPS,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if SHRINK else [])],
)

POOL = batches(6, seed=11)  # micro-batches, drawn by index
MAX_MICRO_BATCHES = 3
SMALL = 0.004  # MiB: one or two tensors a bucket, so the fused step steps several buckets
OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    # Adam's update hardly depends on the gradient's scale; SGD's shows a wrong clip.
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, for the cached run and its twin alike (bit for bit needs one
    count, not a particular one): hundreds of tiny steps run several times faster than
    with the suite's count when other processes share the cores, where idle OpenMP
    workers spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _same(left: torch.Tensor | None, right: torch.Tensor | None) -> bool:
    if left is None or right is None:
        return left is right
    return torch.equal(left, right)


def _has_micro_batches(machine: CallOrders) -> bool:
    return machine.micro_batches > 0


def _has_room(machine: CallOrders) -> bool:
    return machine.micro_batches < MAX_MICRO_BATCHES


class CallOrders(RuleBasedStateMachine):
    """``model`` with the cache, ``twin`` without; each rule makes the same calls on both.

    Hypothesis turns a random share of the rules off in each run of calls ("swarm
    testing"), so every rule ends what it starts: a fused step that raised is retried or
    discarded within its rule, and a step may be ended by three rules.
    """

    def __init__(self, backend_factory=None, checker: StreamChecker | None = None) -> None:
        super().__init__()
        self.backend_factory = backend_factory
        self.checker = checker
        self.manager = None

    @initialize(
        optimizer=st.sampled_from(sorted(OPTIMIZERS)),
        bucket_size_mb=st.sampled_from([SMALL, 0.02, 8.0]),
        staging_depth=st.sampled_from([2, 16]),
        exclude_norm=st.booleans(),
    )
    def build(
        self, optimizer: str, bucket_size_mb: float, staging_depth: int, exclude_norm: bool
    ) -> None:
        """``staging_depth`` (CUDA backend): 16 leaves the copies of a backward unwaited
        for, so that the next micro-batch's encode must wait for them itself."""
        self.model, self.twin = make_model(), make_model()
        self.options = dict(
            compression_ratio=1, bucket_size_mb=bucket_size_mb, staging_depth=staging_depth
        )
        if exclude_norm:  # its gradients stay on the device, as plain PyTorch leaves them
            self.options["exclude_layers"] = ["norm"]
        if self.backend_factory is not None:
            self.options["backend_factory"] = self.backend_factory
        self.manager = gradient_cache.create_gradient_cache(self.model, **self.options)
        self.optimizer = OPTIMIZERS[optimizer](list(self.model.parameters()))
        self.twin_optimizer = OPTIMIZERS[optimizer](list(self.twin.parameters()))
        self.failure = FailsOnce(self.optimizer)
        self.micro_batches = 0  # backward passes since the last step or discard
        self.steps = 0  # steps that restored cached gradients: what the summary counts
        self.enabled = True
        self.state = StepState.IDLE  # the model of the engine's step state

    # --- micro-batches ----------------------------------------------------------------

    @precondition(_has_room)
    @rule(index=st.integers(0, len(POOL) - 1), offload=st.booleans())
    def backward(self, index: int, offload: bool) -> None:
        """``enable()`` or ``disable()`` at a step's first micro-batch (gradients made while
        disabled stay on the device; the twin is unaffected), then one micro-batch, the
        cache's calls left for later. Switching between micro-batches of one step sums them
        in another order than plain PyTorch (`disable`'s docstring): not drawn here."""
        if self.micro_batches == 0:
            if offload:
                self.manager.enable()
            else:
                self.manager.disable()
            self.enabled = offload
        self.run_backward(index)

    @precondition(_has_room)
    @rule(index=st.integers(0, len(POOL) - 1))
    def backward_then_compress(self, index: int) -> None:
        """One micro-batch, then ``compress_and_free_gradients()``."""
        self.run_backward(index)
        self.manager.compress_and_free_gradients()
        self.drained()

    def run_backward(self, index: int) -> None:
        loss_of(self.model, *POOL[index]).backward()
        self.on_twin(lambda: loss_of(self.twin, *POOL[index]).backward())
        self.micro_batches += 1
        if self.enabled:  # the first gradient handed over starts the step, or goes on with it
            self.state = StepState.CAPTURING
        # Enabled, the hooks take each gradient off its parameter (with any device part made
        # while disabled); disabled, or for excluded layers, they leave it there.
        excluded = self.options.get("exclude_layers", [])
        for name, param in self.model.named_parameters():
            stays = not self.enabled or any(pattern in name for pattern in excluded)
            assert (param.grad is not None) == stays, f"{name}: grad {param.grad is not None}"

    # --- ending a step ----------------------------------------------------------------

    @precondition(_has_micro_batches)
    @rule(fails=st.booleans())
    def apply_gradients_then_step(self, fails: bool) -> None:
        """``apply_gradients()``, ``optimizer.step()`` (which raises once first if
        ``fails``: the gradients stay, the retry steps), ``zero_grad()``."""
        self.steps += self.manager.engine.step_pending
        self.manager.apply_gradients()
        assert not self.manager.engine.store
        self.assert_same_gradients()
        if fails:
            self.failure.arm(1)
            with pytest.raises(torch.OutOfMemoryError):
                self.optimizer.step()
            self.assert_same_gradients()
            assert_same_parameters(self.twin, self.model)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.twin_step(None)
        self.step_done()

    @precondition(_has_micro_batches)
    @rule(
        max_grad_norm=st.sampled_from([None, 0.05]),
        fail_at=st.sampled_from([None, 1, 2, 3]),
        discard_if_it_fails=st.booleans(),
    )
    def fused_step(
        self, max_grad_norm: float | None, fail_at: int | None, discard_if_it_fails: bool
    ) -> None:
        """``step(optimizer, max_grad_norm=...)``. Its ``fail_at``-th ``optimizer.step()``
        raises, if it makes that many (one per bucket, one more for gradients on the
        device); then ``state_dict()`` is refused until the step is retried, which finishes
        it, or discarded (the error's other way out: only before a bucket was stepped, for
        the twin cannot undo a part of a step)."""
        counted = int(self.manager.engine.step_pending)
        self.steps += counted
        if fail_at is not None:
            self.failure.arm(fail_at)
        try:
            norm = self.manager.step(self.optimizer, max_grad_norm=max_grad_norm)
        except torch.OutOfMemoryError:
            assert self.failure.calls == self.failure.fail_at
            # What was not stepped is kept: cached buckets, or device gradients put back.
            kept = any(p.grad is not None for p in self.model.parameters())
            assert self.manager.engine.store or kept
            self.state = StepState.INTERRUPTED
            assert self.manager.engine.state is self.state
            with pytest.raises(RuntimeError, match="cannot save the pending step"):
                self.manager.state_dict()
            self.manager.compress_and_free_gradients()  # harmless here too
            if discard_if_it_fails and fail_at == 1:
                self.steps -= counted  # a discarded step leaves no trace, nor a count
                self.discard_gradients()
                return
            norm = self.manager.step(self.optimizer, max_grad_norm=max_grad_norm)
        else:
            if fail_at is not None:
                assert self.failure.calls < self.failure.fail_at  # it made fewer steps
                self.failure.fail_at = None
        self.optimizer.zero_grad()  # gradients of excluded layers are left in place
        expected = self.twin_step(max_grad_norm)
        assert _same(norm, expected), f"clip norm {norm} against clip_grad_norm_'s {expected}"
        self.step_done()

    @precondition(_has_micro_batches)
    @rule()
    def discard_gradients(self) -> None:
        """A skipped step: the cache drops its gradients, ``zero_grad`` the device ones."""
        self.manager.discard_gradients()
        self.optimizer.zero_grad()
        self.on_twin(self.twin_optimizer.zero_grad)
        self.step_done()

    # --- between the calls of a step --------------------------------------------------

    @rule(saved=st.booleans())
    def resume_from_state_dict(self, saved: bool) -> None:
        """``state_dict()`` (through ``torch.save`` and ``torch.load`` if ``saved``), the old
        manager closed, a new one on the same model loads it (mid-accumulation too).
        Gradients still on the device (excluded layers, or made while disabled) stay there,
        as they would in the running process; the twin does nothing."""
        state = self.manager.state_dict()
        self.drained()
        if saved:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            state = torch.load(buffer, weights_only=True)
        device_grads = {p: p.grad for p in self.model.parameters()}
        for param in self.model.parameters():
            param.grad = None
        old, cached = self.manager, set(self.manager.engine.store)
        old.remove_hooks()  # puts the cached gradients back into param.grad
        for param, twin_param in zip(self.model.parameters(), self.twin.parameters(), strict=True):
            if param in cached and device_grads[param] is None:
                assert _same(param.grad, twin_param.grad)  # the cached sum, bit for bit
            param.grad = device_grads[param]  # the checkpoint holds the cached part
        with pytest.raises(RuntimeError, match="was closed by remove_hooks"):
            old.apply_gradients()
        self.manager = gradient_cache.create_gradient_cache(self.model, **self.options)
        if not self.enabled:
            self.manager.disable()
        self.manager.load_state_dict(state)
        assert set(self.manager.engine.store) == cached
        assert self.manager.summary().steps == self.steps
        self.state = StepState.CACHED if cached else StepState.IDLE

    @rule(
        call=st.sampled_from(
            ["load_state_dict with a step pending", "step_completed", "bad arguments to step"]
        )
    )
    def refused_call(self, call: str) -> None:
        """A call the API refuses raises its documented error and changes nothing; where
        the order makes it legal (nothing pending), it must work."""
        if call == "load_state_dict with a step pending":
            pending = self.manager.engine.step_pending
            assert pending == (self.state is not StepState.IDLE)
            state = self.manager.state_dict()  # drains: what backward left is cached now
            self.drained()
            cached = set(self.manager.engine.store)
            if pending:
                with pytest.raises(RuntimeError, match="needs a manager with no step pending"):
                    self.manager.load_state_dict(state)
            else:
                self.manager.load_state_dict(state)
        elif call == "step_completed":  # warns exactly when gradients are still cached
            self.manager.compress_and_free_gradients()
            self.drained()
            cached = set(self.manager.engine.store)
            if cached:
                with pytest.warns(UserWarning, match="still cached"):
                    self.manager.step_completed()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    self.manager.step_completed()
        else:
            cached = set(self.manager.engine.store)
            with pytest.raises(TypeError, match="cannot step LBFGS"):
                self.manager.step(torch.optim.LBFGS(self.model.parameters()))
            with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
                self.manager.step(self.model)
            with pytest.raises(ValueError, match="Invalid max_grad_norm: nan"):
                self.manager.step(self.optimizer, max_grad_norm=math.nan)
            with pytest.raises(ValueError, match="Invalid norm_type: 0"):
                self.manager.step(self.optimizer, norm_type=0)
        assert set(self.manager.engine.store) == cached

    # --- checks -----------------------------------------------------------------------

    @invariant()
    def same_weights_as_the_twin(self) -> None:
        if self.manager is not None:
            assert_same_parameters(self.twin, self.model)

    @invariant()
    def step_state_as_modelled(self) -> None:
        if self.manager is not None:
            assert self.manager.engine.state is self.state

    @invariant()
    def each_record_says_where_its_gradient_is(self) -> None:
        """Location is a field (`records.GradientAt`): after every call each record names
        the container that holds its gradient, and each container holds what its records
        name."""
        if self.manager is None:
            return
        engine = self.manager.engine
        for param, record in engine.records.items():
            at = record.gradient
            assert (at is GradientAt.OPEN_BUCKET) == engine.assembler.holds(param), record.name
            bucket = engine.store.bucket_state(param)
            if at is not GradientAt.OPEN_BUCKET:
                landing = bucket is BucketState.LANDING
                assert (at is GradientAt.IN_FLIGHT) == landing, (record.name, at)
                assert (at is GradientAt.STORED) == (bucket is BucketState.CACHED), record.name
            assert at is not GradientAt.HELD_FOR_STEP, record.name  # only inside a fused step
            if at is GradientAt.KEPT_ON_DEVICE:
                assert param.grad is not None, record.name

    def drained(self) -> None:
        """A drain caches what backward left: a capturing step is cached now."""
        if self.state is StepState.CAPTURING:
            self.state = StepState.CACHED

    def on_twin(self, action) -> None:
        """Run ``action`` on the twin, unseen by the stream checker (it is plain PyTorch)."""
        if self.checker is None:
            action()
        else:
            with self.checker.disabled():
                action()

    def twin_step(self, max_grad_norm: float | None) -> torch.Tensor | None:
        """Clip (over the optimizer's parameters, in its order) if asked, step, zero_grad."""
        norm = []

        def step() -> None:
            if max_grad_norm is not None:
                params = [p for g in self.twin_optimizer.param_groups for p in g["params"]]
                norm.append(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
            self.twin_optimizer.step()
            self.twin_optimizer.zero_grad()

        self.on_twin(step)
        return norm[0] if norm else None

    def assert_same_gradients(self) -> None:
        pairs = zip(self.twin.named_parameters(), self.model.parameters(), strict=True)
        for (name, expected), param in pairs:
            assert _same(expected.grad, param.grad), f"the gradient of {name} differs"

    def step_done(self) -> None:
        """Nothing is left of the step, and the summary counts the steps restored."""
        self.micro_batches = 0
        self.state = StepState.IDLE
        assert not self.manager.engine.store
        assert not self.manager.engine.step_pending
        assert all(p.grad is None for p in self.model.parameters())
        counted = self.manager.summary().steps
        assert counted == self.steps, f"the summary counts {counted} steps, not {self.steps}"

    def teardown(self) -> None:
        if self.manager is not None:
            self.manager.remove_hooks()
        # Let this run's tensors go now, not at the next garbage collection: the stream
        # checker, shared by every run, tracks each live storage.
        self.manager = self.model = self.twin = self.optimizer = self.twin_optimizer = None
        if self.checker is not None:
            violations, self.checker.violations[:] = list(self.checker.violations), []
            assert not violations, "\n".join(dict.fromkeys(violations))


@pytest.mark.parametrize("hypothesis_seed", SEEDS)
@pytest.mark.parametrize("backend", ["cpu", "stand-in cuda"])
def test_legal_call_orders_match_plain_pytorch_bit_for_bit(
    backend: str, hypothesis_seed: int, request: pytest.FixtureRequest
) -> None:
    if backend == "cpu":
        factory, checker = None, None
    else:
        accelerator = request.getfixturevalue("fake_accelerator")
        factory, checker = accelerator.factory, accelerator.checker

    @seed(hypothesis_seed)
    def machine() -> CallOrders:
        return CallOrders(factory, checker)

    run_state_machine_as_test(machine, settings=SETTINGS)
