"""The optimizer's state in host memory between steps (``offload_optimizer_state=True``):
the fused step brings each bucket's state to the device, steps, and sends it back, with
plain PyTorch's results bit for bit (ratio 1)."""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Iterator

import pytest
import torch
from helpers import (
    FailsOnce,
    after_each_update,
    assert_same_parameters,
    batches,
    loss_of,
    make_model,
    stepping_and_off_the_host,
)

import gradient_cache
from gradient_cache.engine.records import StateAt

SMALL_BUCKETS = dict(bucket_size_mb=0.004)  # ~4 KiB: several buckets per backward
OPTIONS = dict(
    compression_ratio=1, offload_optimizer_state=True, exclude_layers=["norm"], **SMALL_BUCKETS
)
CLIP = 0.5


def two_groups(params, **kwargs):
    """nanoGPT's decay and no-decay groups: the optimizer's order is not the model's."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, **kwargs)


OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-amsgrad-forloop": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "two-groups": two_groups,
}


def plain_step(model, optimizer, micro_batches) -> None:
    for tokens, targets in micro_batches:
        (loss_of(model, tokens, targets) / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    optimizer.zero_grad()


def cached_step(model, manager, optimizer, micro_batches) -> None:
    for tokens, targets in micro_batches:
        (loss_of(model, tokens, targets) / len(micro_batches)).backward()
    manager.step(optimizer, max_grad_norm=CLIP)
    optimizer.zero_grad()


def data(steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Two micro-batches a step (gradient accumulation)."""
    return [[(t[:2], y[:2]), (t[2:], y[2:])] for t, y in batches(steps)]


def assert_same_state(plain_opt, cached_opt, plain, cached) -> None:
    for p, q in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(p, q)
        expected, got = plain_opt.state[p], cached_opt.state[q]
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key], got[key]), key


def assert_on_the_host(manager, optimizer) -> None:
    """Every offloaded state tensor is the cache's host copy; scalars stay as they were."""
    host = manager.engine.optimizer_state.copies_of(optimizer)
    offloaded = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state[param].items():
                if value.dim() > 0:
                    assert value is host[param][key], key
                    offloaded += 1
    assert offloaded > 0


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_state_on_the_host_trains_as_plain_pytorch(name: str) -> None:
    """Five steps with accumulation, clipping and a learning-rate schedule; after each,
    every state tensor with a dimension is a host copy, and weights and state equal
    plain's bit for bit."""
    make = OPTIMIZERS[name]
    plain, cached = make_model(), make_model()
    plain_opt, cached_opt = make(list(plain.parameters())), make(list(cached.parameters()))
    schedules = [torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5) for o in (plain_opt, cached_opt)]
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    for step, micro_batches in enumerate(data(5)):
        plain_step(plain, plain_opt, micro_batches)
        cached_step(cached, manager, cached_opt, micro_batches)
        for schedule in schedules:
            schedule.step()
        assert_on_the_host(manager, cached_opt)
        assert_same_state(plain_opt, cached_opt, plain, cached)
        # The summary: the state's host bytes, and what the step moved (the first step
        # only sends the new state back; later ones bring it and send it back).
        state_bytes = sum(
            v.numel() * v.element_size()
            for state in cached_opt.state.values()
            for v in state.values()
            if v.dim() > 0
        )
        summary = manager.get_compression_summary()
        moved = summary["optimizer_state_moved_mb"] * 2**20
        assert moved == (1 if step == 0 else 2) * state_bytes
        assert state_bytes <= summary["optimizer_state_host_mb"] * 2**20 <= 1.1 * state_bytes


def test_two_optimizers_over_one_model() -> None:
    """AdamW and SGD with momentum over parts of one model, each clipped over its own
    parameters, five steps of two micro-batches: each keeps its state on the host."""
    plain, cached = make_model(), make_model()

    def split(model):
        params = list(model.parameters())
        return torch.optim.AdamW(params[:3], lr=1e-2), torch.optim.SGD(
            params[3:], lr=0.1, momentum=0.9
        )

    plain_opts, cached_opts = split(plain), split(cached)
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    for micro_batches in data(5):
        for tokens, targets in micro_batches:
            (loss_of(plain, tokens, targets) / 2).backward()
            (loss_of(cached, tokens, targets) / 2).backward()
        for plain_opt, cached_opt in zip(plain_opts, cached_opts, strict=True):
            torch.nn.utils.clip_grad_norm_(plain_opt.param_groups[0]["params"], CLIP)
            plain_opt.step()
            plain_opt.zero_grad()
            manager.step(cached_opt, max_grad_norm=CLIP)
            cached_opt.zero_grad()
            assert_on_the_host(manager, cached_opt)
    for plain_opt, cached_opt in zip(plain_opts, cached_opts, strict=True):
        assert_same_state(plain_opt, cached_opt, plain, cached)


def test_only_the_bucket_being_stepped_has_its_state_off_the_host() -> None:
    """The first step creates the state a bucket at a time (no whole-state spike), and
    every step sends each bucket's state back before the next bucket steps."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    seen = []

    def check(optimizer) -> None:
        stepping, off_host = stepping_and_off_the_host(manager, optimizer)
        host = manager.engine.optimizer_state.copies_of(optimizer)
        assert off_host <= stepping
        # and the bucket stepped on device copies, not on the host copies
        assert all(
            v is not host.get(p, {}).get(k)
            for p in stepping
            for k, v in optimizer.state[p].items()
            if v.dim() > 0
        )
        seen.append(len(stepping))

    after_each_update(optimizer, check)
    for micro_batches in data(2):
        cached_step(model, manager, optimizer, micro_batches)
    calls_per_step = len(seen) // 2
    assert calls_per_step > 3 and max(seen) < len(list(model.parameters()))


@pytest.mark.parametrize("attached", [True, False], ids=["offload_state_of", "first-step"])
def test_the_state_dict_round_trip_resumes_bit_for_bit(attached: bool) -> None:
    """Save the optimizer's state_dict mid-run, load it into a new optimizer on a new
    model and cache, go on: the same as the uninterrupted plain run. Loaded after
    ``offload_state_of``, the state goes straight to host copies."""
    steps = data(5)
    plain = make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for micro_batches in steps:
        plain_step(plain, plain_opt, micro_batches)

    first = make_model()
    first_opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(first, **OPTIONS)
    for micro_batches in steps[:3]:
        cached_step(first, manager, first_opt, micro_batches)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    manager.remove_hooks()
    buffer.seek(0)
    saved = torch.load(buffer)

    resumed = make_model(seed=7)
    resumed.load_state_dict(saved["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(resumed, **OPTIONS)
    if attached:
        manager.offload_state_of(resumed_opt)
    resumed_opt.load_state_dict(saved["optimizer"])
    if attached:
        assert_on_the_host(manager, resumed_opt)
    for micro_batches in steps[3:]:
        cached_step(resumed, manager, resumed_opt, micro_batches)
        assert_on_the_host(manager, resumed_opt)
    assert_same_state(plain_opt, resumed_opt, plain, resumed)


class SparseEmbedding(torch.nn.Module):
    """An embedding with sparse gradients under a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8, sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens)).square().mean()


SPARSE_OPTIONS = dict(compression_ratio=1, offload_optimizer_state=True, **SMALL_BUCKETS)


def test_sgd_momentum_on_a_sparse_gradient_is_refused_before_anything_steps() -> None:
    """Its momentum buffer would be sparse, which the host copies cannot hold: named, with
    the fix, before a parameter changes (it failed after the step, in the copy back, on
    every retry)."""
    model = SparseEmbedding()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = gradient_cache.create_gradient_cache(model, **SPARSE_OPTIONS)
    model(torch.tensor([1, 2, 3])).backward()
    for _ in range(2):  # the same answer again: nothing changed in between
        with pytest.raises(RuntimeError, match=r"embed\.weight has a sparse gradient"):
            manager.step(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not optimizer.state


@pytest.mark.parametrize("make", [torch.optim.SparseAdam, torch.optim.Adagrad])
def test_optimizers_with_a_dense_state_for_sparse_gradients_step_as_plain(make) -> None:
    plain, cached = SparseEmbedding(), SparseEmbedding()
    plain_opt = make([plain.embed.weight], lr=0.1)
    cached_opt = make([cached.embed.weight], lr=0.1)
    manager = gradient_cache.create_gradient_cache(cached, **SPARSE_OPTIONS)
    for step in range(3):
        tokens = torch.tensor([step, step + 1, 5])
        plain(tokens).backward()
        cached(tokens).backward()
        plain_opt.step()
        manager.step(cached_opt)
        plain_opt.zero_grad()
        cached_opt.zero_grad()
    assert torch.equal(plain.embed.weight, cached.embed.weight)
    host = manager.engine.optimizer_state.copies_of(cached_opt)[cached.embed.weight]
    moments = {k: v for k, v in cached_opt.state[cached.embed.weight].items() if k != "step"}
    assert moments and all(value is host[key] for key, value in moments.items())


def test_a_checkpoint_whose_group_sizes_differ_is_refused_as_torch_refuses_it() -> None:
    """A damaged optimizer checkpoint (a group one parameter short) gets torch's own error,
    not the cache's zip() failing, and the state and the cache are as before the load."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    cached_step(model, manager, optimizer, data(1)[0])
    damaged = copy.deepcopy(optimizer.state_dict())
    damaged["param_groups"][0]["params"].pop()
    states = manager.engine.optimizer_state
    before = {p: dict(values) for p, values in optimizer.state.items()}
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        torch.optim.AdamW(make_model().parameters()).load_state_dict(damaged)  # plain's
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        optimizer.load_state_dict(damaged)
    assert {p: dict(values) for p, values in optimizer.state.items()} == before
    assert not states._loading
    assert_on_the_host(manager, optimizer)


@pytest.mark.parametrize("after", [False, True], ids=["before-changing", "after-changing"])
@pytest.mark.parametrize("nth", [1, 3])
@pytest.mark.parametrize("at_step", [0, 1])
def test_a_raising_optimizer_step_retried_gives_plains_result(
    nth: int, at_step: int, after: bool
) -> None:
    """The ``nth`` optimizer.step() of a step raises once (at the first step: while the
    state is being created), before or after it changed the state (``step`` counted, the
    moments moved: a retry counted the step twice); the user calls step again."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    failure = FailsOnce(cached_opt, after=after)
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)

    @contextlib.contextmanager
    def armed() -> Iterator[None]:
        failure.arm(nth)
        yield

    failures = [armed] if at_step == 0 else [None, armed]
    train_through_a_failure(plain, cached, plain_opt, cached_opt, manager, failures)


def train_through_a_failure(plain, cached, plain_opt, cached_opt, manager, failures) -> None:
    """Three steps, plain against the cache's. ``failures[i]``: a context (made by calling
    it) in which step i's first ``step(optimizer)`` raises once, or None; the user calls
    ``step`` again. Then the cache's state and weights must be plain's."""
    for i, micro_batches in enumerate(data(3)):
        plain_step(plain, plain_opt, micro_batches)
        for tokens, targets in micro_batches:
            (loss_of(cached, tokens, targets) / 2).backward()
        if i < len(failures) and failures[i] is not None:
            with failures[i](), pytest.raises(torch.OutOfMemoryError):
                manager.step(cached_opt, max_grad_norm=CLIP)
            assert_on_the_host_or_absent(manager, cached_opt)
        manager.step(cached_opt, max_grad_norm=CLIP)
        cached_opt.zero_grad()
    assert_same_state(plain_opt, cached_opt, plain, cached)


def assert_on_the_host_or_absent(manager, optimizer) -> None:
    host = manager.engine.optimizer_state.copies_of(optimizer)
    for param, state in optimizer.state.items():
        for key, value in state.items():
            assert value.dim() == 0 or value is host[param][key]


def test_apply_gradients_is_refused_with_the_fix() -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).backward()
    with pytest.raises(RuntimeError, match=r"hook_manager\.step\(optimizer\)"):
        manager.apply_gradients()
    plain = gradient_cache.create_gradient_cache(make_model(), compression_ratio=1)
    with pytest.raises(RuntimeError, match="offload_optimizer_state=True"):
        plain.offload_state_of(torch.optim.SGD(make_model().parameters(), lr=0.1))
    with pytest.raises(TypeError, match="offload_optimizer_state"):
        gradient_cache.EngineConfig(offload_optimizer_state="yes")


def test_a_copy_of_the_loaded_state_is_not_shared_with_the_saved_one() -> None:
    """load_state_dict copies into the cache's host memory: the dict the user loaded from
    stays theirs (changing it later changes nothing in training)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    cached_step(model, manager, optimizer, data(1)[0])
    saved = copy.deepcopy(optimizer.state_dict())
    manager.offload_state_of(optimizer)
    optimizer.load_state_dict(saved)
    for state in saved["state"].values():
        state["exp_avg"].fill_(1e9)
    assert all(s["exp_avg"].abs().max() < 1e9 for s in optimizer.state.values())


def test_an_allocation_failing_while_the_state_is_created_is_retried_as_plain(
    monkeypatch,
) -> None:
    """An out-of-memory error inside the first step's state creation (exp_avg made,
    exp_avg_sq not) leaves no half-made state: the retry creates it whole."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2, foreach=False)
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    zeros_like, calls = torch.zeros_like, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the second parameter's exp_avg_sq
            raise torch.OutOfMemoryError("injected: out of memory")
        return zeros_like(*args, **kwargs)

    @contextlib.contextmanager
    def failing_zeros_like() -> Iterator[None]:
        with monkeypatch.context() as patch:
            patch.setattr(torch, "zeros_like", fails_once)
            yield

    train_through_a_failure(plain, cached, plain_opt, cached_opt, manager, [failing_zeros_like])


def test_the_memory_accounting_counts_the_state_as_host_memory() -> None:
    """The demo's tensor accounting (`cache_tensors`): between steps the optimizer state's
    host copies are host bytes, and the device holds only its scalars (AdamW's steps)."""
    from gradient_cache.demo.accounting import OPTIMIZER_STATE, device_memory_meter

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    for micro_batches in data(2):
        cached_step(model, manager, optimizer, micro_batches)
    with device_memory_meter(model, optimizer=optimizer, cache=manager) as meter:
        reading = meter.reading()
    params = list(model.parameters())
    state_bytes = 2 * sum(p.numel() * p.element_size() for p in params)
    assert reading.by_category[OPTIMIZER_STATE] <= 64 * len(params)  # the step scalars
    assert reading.host_bytes >= state_bytes


def test_verbose_logs_the_states_host_and_moved_bytes(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, verbose=True, **OPTIONS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with caplog.at_level(logging.INFO, logger="gradient_cache"):
        for micro_batches in data(2):
            cached_step(model, manager, optimizer, micro_batches)
    momentum = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert f"optimizer state {momentum:.1f} MiB in host memory" in caplog.text
    assert f"{2 * momentum:.1f} MiB moved between host and device" in caplog.text  # step 2


def test_the_accounting_counts_the_brought_state_as_device_memory_at_the_step() -> None:
    """At the step a bucket's state is on the device: the step's accounted peak holds the
    largest parameter's gradient and both AdamW moments beside the weights (a copy made
    from a host tensor would count as host memory: the CPU backend makes new ones)."""
    from gradient_cache.demo.accounting import device_memory_meter

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    steps = data(2)
    cached_step(model, manager, optimizer, steps[0])  # the state exists from here on
    for tokens, targets in steps[1]:
        (loss_of(model, tokens, targets) / 2).backward()
    with (
        device_memory_meter(model, optimizer=optimizer, cache=manager) as meter,
        meter.phase("step"),
    ):
        manager.step(optimizer, max_grad_norm=CLIP)
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    assert meter.peaks["step"].peak.device_bytes >= weights + 3 * largest


def test_a_saved_state_dict_holds_the_states_bytes_not_its_slabs() -> None:
    """A host copy is a view of a slab that many copies share, and ``torch.save`` writes a
    view's whole storage: ``optimizer.state_dict()`` hands out compact copies, so one state
    tensor saves its own bytes and the whole state dict about the state's (beside plain
    PyTorch's own pickle overhead). The optimizer keeps its host copies; a load resumes."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    for micro_batches in data(2):
        plain_step(plain, plain_opt, micro_batches)
        cached_step(cached, manager, cached_opt, micro_batches)
    saved, expected = cached_opt.state_dict(), plain_opt.state_dict()
    assert_on_the_host(manager, cached_opt)  # the optimizer's own dicts are untouched

    def saved_bytes(value: object) -> int:
        file = io.BytesIO()
        torch.save(value, file)
        return file.tell()

    one, plain_one = saved["state"][0]["exp_avg"], expected["state"][0]["exp_avg"]
    assert torch.equal(one, plain_one)
    assert saved_bytes(one) <= 1.05 * saved_bytes(plain_one)
    state_bytes = sum(
        v.numel() * v.element_size()
        for values in expected["state"].values()
        for v in values.values()
        if v.dim() > 0
    )
    overhead = saved_bytes(expected) - state_bytes
    assert saved_bytes(saved) <= 1.05 * state_bytes + overhead
    resumed = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    resumed.load_state_dict(copy.deepcopy(saved))
    for index, values in expected["state"].items():
        for key, value in values.items():
            assert torch.equal(resumed.state_dict()["state"][index][key], value), key


def test_gpt2_124m_adamw_state_pins_within_ten_percent_of_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layout of the state's host copies on CUDA (`StateSlabs` as the CUDA backend
    uses it: power-of-two slabs), for GPT-2 124M's AdamW state created a 4 MiB bucket at a
    time in backward order (the tied embedding last): within 10% of the state's 0.93 GiB
    (slabs per bucket pinned 1.6 times it). Meta tensors: nothing is allocated; each new
    slab is checked against the host budget first."""
    from gradient_cache.demo.models import GPTConfig, TinyGPT
    from gradient_cache.engine import state_slabs
    from gradient_cache.engine.backend import CpuBackend
    from gradient_cache.engine.optimizer_state import HostOptimizerState

    checked = []
    monkeypatch.setattr(
        state_slabs, "check_host_budget", lambda nbytes, **_: checked.append(nbytes)
    )

    class MetaSlabs(CpuBackend):
        host_slabs_round_up = True  # as AcceleratorBackend: pinned slabs come in powers of two

        def host_slab(self, nbytes: int) -> torch.Tensor:
            allocated.append(nbytes)
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    allocated: list[int] = []
    with torch.device("meta"):
        model = TinyGPT(
            GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12)
        )
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == 124_439_808
    states = HostOptimizerState(MetaSlabs(torch.device("meta"), keep_previous_residual=False), 1.0)
    states.begin_step(torch.optim.AdamW(params))
    bucket: list[torch.nn.Parameter] = []
    copies: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for param in reversed(params):  # backward order: the tied embedding's hook fires last
        bucket.append(param)
        if sum(p.numel() * 4 for p in bucket) >= 4 * 2**20 or param is params[0]:
            keys = ("exp_avg", "exp_avg_sq")
            items = [(p, key, torch.empty_like(p)) for p in bucket for key in keys]
            states._allocate(items, copies)
            bucket = []
    state_bytes = 2 * 4 * 124_439_808
    assert checked == allocated and all(n & (n - 1) == 0 for n in allocated)
    assert states.host_bytes == sum(allocated) <= 1.1 * state_bytes
    assert all(copies[p][key].shape == p.shape for p in params for key in ("exp_avg",))


def test_the_default_buckets_save_device_memory_at_the_step_of_a_small_model() -> None:
    """A 0.2M-parameter model (0.8 MiB of gradients) with the default bucket size: buckets
    sized from the model, so the step brings a bucket or two of AdamW's state, and its
    accounted peak falls well below plain's (one 4 MiB bucket held everything: plain's)."""
    from gradient_cache.demo.accounting import device_memory_meter

    def step_peak(offload: bool) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(12)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        manager = None
        if offload:
            manager = gradient_cache.create_gradient_cache(
                model, compression_ratio=1, offload_optimizer_state=True
            )
        x = torch.randn(8, 128)

        def step() -> None:
            manager.step(optimizer) if manager else optimizer.step()

        model(x).square().mean().backward()
        step()  # the state exists from here on
        optimizer.zero_grad()
        model(x).square().mean().backward()
        with (
            device_memory_meter(model, optimizer=optimizer, cache=manager) as meter,
            meter.phase("step"),
        ):
            step()
        return meter.peaks["step"].peak.device_bytes

    assert step_peak(offload=True) < 0.6 * step_peak(offload=False)


class StepHooks:
    """A pre-hook that counts, and an EMA of the weights and a logger of Adam's first
    moment as post-hooks: they read the parameters and ``optimizer.state`` on the host."""

    def __init__(self, model, optimizer) -> None:
        self.params = list(model.parameters())
        self.pre = 0
        self.ema = [p.detach().clone() for p in self.params]
        self.logged: list[list[torch.Tensor]] = []
        optimizer.register_step_pre_hook(self.before)
        optimizer.register_step_post_hook(self.after)

    def before(self, optimizer, args, kwargs) -> None:
        self.pre += 1

    def after(self, optimizer, args, kwargs) -> None:
        for ema, param in zip(self.ema, self.params, strict=True):
            ema.mul_(0.9).add_(param.detach(), alpha=0.1)
        self.logged.append([optimizer.state[p]["exp_avg"].clone() for p in self.params])


def test_step_hooks_fire_once_around_the_fused_step_and_read_the_complete_state() -> None:
    """Under hook_manager.step(optimizer), as around a plain optimizer.step(): the pre-hooks
    once before, the post-hooks once after, with every parameter stepped and the state's
    host copies complete: an EMA of the weights and a log of exp_avg as plain's, bit for bit."""
    plain, cached = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cached_opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    plain_hooks, cached_hooks = StepHooks(plain, plain_opt), StepHooks(cached, cached_opt)
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    for micro_batches in data(3):
        plain_step(plain, plain_opt, micro_batches)
        cached_step(cached, manager, cached_opt, micro_batches)
    assert cached_hooks.pre == plain_hooks.pre == len(cached_hooks.logged) == 3
    for mine, theirs in zip(cached_hooks.ema, plain_hooks.ema, strict=True):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(cached_hooks.logged, plain_hooks.logged, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_a_learning_rate_scheduler_sees_the_fused_step() -> None:
    """No "lr_scheduler.step() before optimizer.step()" warning: the bucket steps run
    through the optimizer's own step (the scheduler's wrapper), without its hooks."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for micro_batches in data(2):
            cached_step(model, manager, optimizer, micro_batches)
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 1e-2 / 4


def test_where_each_parameters_state_is_is_a_field_each_phase_sets() -> None:
    """`StateAt`: on the host between steps; during a bucket's step, on the device for that
    bucket's parameters only (the others on the host, or in transit for the bucket after);
    and a state a framework put back on the device is seen at the next step's begin."""
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, **OPTIONS)
    seen: list[tuple[dict, dict]] = []

    class Watching(torch.optim.AdamW):
        def step(self, closure=None):  # type: ignore[override]
            at = manager.engine.optimizer_state.state_copies(self).at
            params = [p for group in self.param_groups for p in group["params"]]
            stepping = {p for p in params if p.grad is not None}
            seen.append(({p: at.get(p) for p in stepping}, {p: at.get(p) for p in params}))
            return super().step(closure)

    optimizer = Watching(model.parameters(), lr=1e-2)
    places = manager.engine.optimizer_state.state_copies(optimizer)
    for tokens, targets in batches(2):
        loss_of(model, tokens, targets).backward()
        seen.clear()
        manager.step(optimizer)
        assert len(places.at) == len(list(model.parameters()))
        assert set(places.at.values()) == {StateAt.HOST}
    assert len(seen) > 2  # several buckets, then the excluded layers' step
    for stepping, everyone in seen:  # the second step's (the state existed before it)
        assert set(stepping.values()) == {StateAt.DEVICE}
        others = {at for p, at in everyone.items() if p not in stepping}
        assert others <= {StateAt.HOST, StateAt.IN_TRANSIT}
    # A framework's resume moves the state to the device behind the cache's back (new
    # tensors in optimizer.state): the step's begin finds them and sends them home.
    for values in optimizer.state.values():
        for key, value in values.items():
            if value.dim():
                values[key] = value.clone()
    manager.offload_state_of(optimizer)
    copies = manager.engine.optimizer_state.copies_of(optimizer)
    for param, values in optimizer.state.items():
        assert places.at[param] is StateAt.HOST
        assert all(values[key] is host for key, host in copies[param].items())


class FailsAtCall:
    """Wraps ``owner.name`` (an instance attribute, so the class is untouched): its
    ``nth`` call raises an out-of-memory error, once."""

    def __init__(self, owner: object, name: str, nth: int) -> None:
        self.original, self.calls, self.nth = getattr(owner, name), 0, nth
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.nth:
            raise torch.OutOfMemoryError("injected: out of memory")
        return self.original(*args, **kwargs)


def _plain_and_cached_adamw() -> tuple[torch.nn.Module, torch.nn.Module, object, object, object]:
    plain, cached = make_model(), make_model()
    manager = gradient_cache.create_gradient_cache(cached, **OPTIONS)
    return (
        plain,
        cached,
        manager,
        torch.optim.AdamW(plain.parameters(), lr=1e-2),
        torch.optim.AdamW(cached.parameters(), lr=1e-2),
    )


def test_a_failed_send_back_of_new_state_is_not_stepped_twice_by_the_retry() -> None:
    """The first step creates the state; allocating the second bucket's host copies raises
    after that bucket stepped. Its payloads are spent first, so the retry steps the other
    buckets only (the bucket's state, left on the device, goes home as the retry begins):
    plain PyTorch's bits."""
    plain, cached, manager, plain_opt, optimizer = _plain_and_cached_adamw()
    tokens, targets = batches(1)[0]
    loss_of(plain, tokens, targets).backward()
    plain_opt.step()
    loss_of(cached, tokens, targets).backward()
    failure = FailsAtCall(manager.engine.optimizer_state, "_allocate", nth=2)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer)
    manager.step(optimizer)  # the retry
    assert failure.calls > 2  # the failed bucket's state was allocated by the retry
    assert_same_parameters(plain, cached)
    copies = manager.engine.optimizer_state.copies_of(optimizer)
    for param, values in optimizer.state.items():
        assert all(values[key] is host for key, host in copies[param].items())


def test_a_failed_bring_leaves_the_state_home_and_the_retry_brings_it() -> None:
    """A bring that raises (the device out of memory as the copy starts) leaves the
    bucket's state on the host, marked so: the retry brings it as any other."""
    plain, cached, manager, plain_opt, optimizer = _plain_and_cached_adamw()
    for tokens, targets in batches(2):
        loss_of(plain, tokens, targets).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    tokens, targets = batches(2)[0]
    loss_of(cached, tokens, targets).backward()
    manager.step(optimizer)  # the state exists from here
    optimizer.zero_grad()  # the excluded layers' gradients, left in .grad
    tokens, targets = batches(2)[1]
    loss_of(cached, tokens, targets).backward()
    FailsAtCall(manager.engine.backend, "start_to_device", nth=1)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer)
    places = manager.engine.optimizer_state.state_copies(optimizer)
    assert set(places.at.values()) == {StateAt.HOST}
    brought: list[int] = []
    backend = manager.engine.backend
    start = backend.start_to_device
    backend.start_to_device = lambda hosts: brought.append(len(hosts)) or start(hosts)
    manager.step(optimizer)  # the retry brings every bucket's state
    assert sum(brought) == sum(len(v) for v in places.copies.values())
    assert_same_parameters(plain, cached)


class CountingSGD(torch.optim.Optimizer):
    """SGD whose per-parameter state is a Python count alone: nothing to offload."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    state = self.state[param]
                    state["n"] = state.get("n", 0) + 1
                    param.add_(param.grad, alpha=-group["lr"] / state["n"])


@pytest.mark.parametrize("attached", [False, True])
def test_a_loaded_state_with_no_tensor_to_offload_resumes_as_plain(attached: bool) -> None:
    """A loaded state whose values are all scalars has nothing on the host: the next fused
    step finds it where the optimizer keeps it (it raised a KeyError when attached)."""
    steps = data(4)
    plain = make_model()
    plain_opt = CountingSGD(plain.parameters(), lr=0.1)
    for micro_batches in steps:
        plain_step(plain, plain_opt, micro_batches)

    first = make_model()
    first_opt = CountingSGD(first.parameters(), lr=0.1)
    manager = gradient_cache.create_gradient_cache(first, **OPTIONS)
    for micro_batches in steps[:2]:
        cached_step(first, manager, first_opt, micro_batches)
    saved = copy.deepcopy(first_opt.state_dict())
    resumed_opt = CountingSGD(first.parameters(), lr=0.1)
    if attached:
        manager.offload_state_of(resumed_opt)
    resumed_opt.load_state_dict(saved)
    for micro_batches in steps[2:]:
        cached_step(first, manager, resumed_opt, micro_batches)
    assert_same_parameters(plain, first)
    assert [s["n"] for s in resumed_opt.state.values()] == [4] * len(resumed_opt.state)
