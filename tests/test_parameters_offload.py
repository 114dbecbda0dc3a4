"""offload_parameters=True: the weights on the host, a block at a time on the device in
forward and backward, a bucket at a time in the fused step; bit for bit with plain PyTorch."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import FailsOnce, assert_same_parameters, save_and_load
from stream_checker import FakeAccelerator
from test_optimizer_state import FailsAtCall
from test_planner import planned_weights_on_host
from test_stream_order import fake_accelerator  # noqa: F401 - the stand-in streams' fixture

import gradient_cache
from gradient_cache.demo.models import GPTConfig, TinyGPT
from gradient_cache.engine.hostmem import HostMemoryError
from gradient_cache.engine.records import StateAt
from gradient_cache.engine.weights import at_rest
from gradient_cache.engine.weights.blocks import weight_units
from gradient_cache.engine.weights.masters import WeightAt, unit_offsets

CONFIG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2)
STREAMED = {"compression_ratio": 1, "offload_optimizer_state": True, "offload_parameters": True}


def gpt(*, checkpointing: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CONFIG, activation_checkpointing=checkpointing)


def batches(n: int, *, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(64, (4, 16), generator=generator),
            torch.randint(64, (4, 16), generator=generator),
        )
        for _ in range(n)
    ]


def batches_on(device: torch.device, n: int = 3, *, seed: int = 1) -> list:
    """`batches` on ``device`` (the emulated device's tests)."""
    return [(tokens.to(device), targets.to(device)) for tokens, targets in batches(n, seed=seed)]


def adamw_two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=1e-2,
    )


def sgd_momentum(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model, optimizer, data, *, manager=None, micro_batches=1, clip=None):
    """Plain PyTorch's loop (``manager`` None) or the fused step's, ``micro_batches``
    batches of ``data`` accumulated per step."""
    for i, (tokens, targets) in enumerate(data):
        _, loss = model(tokens, targets)
        (loss / micro_batches).backward()
        if (i + 1) % micro_batches:
            continue
        step(model, optimizer, manager, clip=clip)


def step(model, optimizer, manager=None, *, clip=None):
    """Plain PyTorch's step (``manager`` None: clip_grad_norm_, then optimizer.step()) or the
    fused step, then zero_grad."""
    if manager is None:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    else:
        manager.step(optimizer, max_grad_norm=clip)
    optimizer.zero_grad()


def weights_of(manager):
    return manager.engine.weights


def all_on_the_host(model, manager) -> bool:
    weights = weights_of(manager)
    return all(weights.where(p) is WeightAt.HOST for p in model.parameters())


@pytest.mark.parametrize(
    ("make_optimizer", "micro_batches", "clip"),
    [(adamw_two_groups, 2, 0.5), (sgd_momentum, 1, None)],
    ids=["adamw-groups-accumulation-clip", "sgd-momentum"],
)
def test_training_with_the_weights_on_the_host_is_plain_pytorch_bit_for_bit(
    make_optimizer, micro_batches, clip
) -> None:
    data = batches(6)
    plain = gpt()
    train(plain, make_optimizer(plain), data, micro_batches=micro_batches, clip=clip)
    cached = gpt()
    optimizer = make_optimizer(cached)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, bucket_size_mb=0.02)
    train(cached, optimizer, data, manager=manager, micro_batches=micro_batches, clip=clip)
    assert all_on_the_host(cached, manager)  # between steps, nothing on the device
    assert_same_parameters(plain, cached)
    summary = manager.summary()
    assert summary.parameters_host_mb * 2**20 >= sum(p.nbytes for p in cached.parameters())


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_unit_over_a_run_comes_in_runs_into_one_buffer(monkeypatch, compute_dtype) -> None:
    """A unit larger than a host run (pinned slabs are powers of two: one region of several
    GiB would waste up to half) lies in several runs, each one copy into the unit's one
    buffer; training is unchanged, bit for bit with the same unit in one run."""
    from gradient_cache.engine.weights import masters

    options = {**STREAMED, "compute_dtype": compute_dtype, "bucket_size_mb": 0.02}
    data = batches(2)
    whole = gpt()
    train(
        whole,
        adamw_two_groups(whole),
        data,
        manager=gradient_cache.create_gradient_cache(whole, **options),
    )
    monkeypatch.setattr(masters, "RUN_BYTES", 8192)
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **options)
    pairs: list[int] = []
    start_refill = manager.engine.backend.start_refill

    def counted(refill_pairs, **kwargs):
        pairs.append(len(refill_pairs))
        return start_refill(refill_pairs, **kwargs)

    manager.engine.backend.start_refill = counted
    tokens, targets = data[0]
    model(tokens, targets)[1].backward()
    units = weight_units(model)
    assert sum(pairs) > len(units.block_params) * 2  # more copies than units: the runs
    manager.engine.backend.start_refill = start_refill
    optimizer = adamw_two_groups(model)
    step(model, optimizer, manager)
    train(model, optimizer, data[1:], manager=manager)
    assert_same_parameters(whole, model)


@pytest.mark.parametrize("variant", ["checkpointing", "compile-model", "compile-blocks"])
def test_checkpointing_and_compile_keep_working_bit_for_bit(variant: str) -> None:
    """A checkpointed block's forward reruns in backward: it brings its weights and frees
    nothing. Compiled, the hooks run outside the graphs."""
    data = batches(3)
    checkpointing = variant == "checkpointing"
    plain = gpt(checkpointing=checkpointing)
    train(plain, adamw_two_groups(plain), data)
    cached = gpt(checkpointing=checkpointing)
    optimizer = adamw_two_groups(cached)
    called = cached
    if variant == "compile-model":
        called = torch.compile(cached, backend="eager")
    elif variant == "compile-blocks":
        for block in cached.blocks:
            block.compile(backend="eager")
    manager = gradient_cache.create_gradient_cache(called, **STREAMED)
    train(called, optimizer, data, manager=manager)
    assert_same_parameters(plain, cached)


class ViewBlock(torch.nn.Module):
    """A block whose backward reads a view of its weight (``weight.t()``, saved in
    forward), not the parameter: it shares the weight's device storage."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, 32) / 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(hidden @ self.weight.t())


class ViewModel(torch.nn.Module):
    def __init__(self, *, checkpointing: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointing = checkpointing
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(ViewBlock() for _ in range(3))

    def forward(self, tokens, targets):
        hidden = self.embed(tokens)
        for block in self.blocks:
            if self.checkpointing:
                # Not stopped early: the recomputation runs to the block's end, its hook too.
                with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                    hidden = torch.utils.checkpoint.checkpoint(block, hidden, use_reentrant=False)
            else:
                hidden = block(hidden)
        logits = hidden @ self.embed.weight.t()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


@pytest.mark.parametrize("checkpointing", [False, True], ids=["saved", "recomputed"])
def test_views_of_a_weight_saved_for_backward_read_its_refilled_storage(checkpointing) -> None:
    """A view autograd saved in forward (or in the recomputation) shares the weight's
    device storage, which is given up after forward and refilled for backward: the same
    storage, so backward reads the weights (a recomputation inside backward, run to the
    block's end, frees nothing: backward reads its views next)."""
    data = batches(3)
    plain = ViewModel(checkpointing=checkpointing)
    train(plain, adamw_two_groups(plain), data)
    cached = ViewModel(checkpointing=checkpointing)
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    train(cached, optimizer, data, manager=manager)
    assert_same_parameters(plain, cached)


def measure_the_window(manager) -> list[int]:
    """The device bytes the weights hold after each bring, in order."""
    weights = weights_of(manager)
    seen: list[int] = []
    bring = weights.bring

    def measured(params, **options):
        bring(params, **options)
        seen.append(weights.device_bytes())

    weights.bring = measured
    return seen


def test_the_device_holds_the_rest_and_two_blocks_and_each_step_moves_what_it_says() -> None:
    """The window: the rest and two blocks (the one running, the next arriving), in
    forward and backward alike; a weight goes once its gradient is accumulated. What moves:
    per micro-batch, every weight to the device in forward and the blocks' but the last
    again in backward; in the step, every weight both ways."""
    model = gpt()
    units = weight_units(model)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, bucket_size_mb=0.02)
    seen = measure_the_window(manager)
    optimizer = adamw_two_groups(model)
    train(model, optimizer, batches(2), manager=manager, micro_batches=2)
    block_bytes = [sum(p.nbytes for p in params) for params in units.block_params]
    rest = sum(p.nbytes for p in units.rest)
    every = sum(p.nbytes for p in model.parameters())
    assert max(seen) <= rest + 2 * max(block_bytes)
    assert max(seen) < every - min(block_bytes)  # never the whole model
    # The last block stays from its forward to its backward: brought once a micro-batch.
    moved = 2 * (every + sum(block_bytes) - block_bytes[-1]) + 2 * every
    summary = manager.summary()
    assert summary.parameters_moved_mb * 2**20 == moved
    # The planner's figures (`gradient-cache plan --offload-parameters`) are these.
    planned = planned_weights_on_host(model, micro_batches=2)
    assert max(seen) <= planned.window_bytes
    assert planned.streamed_bytes_per_micro_batch * 2 + 2 * planned.host_bytes == moved
    aligned = len(list(model.parameters())) * 64  # each master starts on an aligned boundary
    assert 0 <= summary.parameters_host_mb * 2**20 - planned.host_bytes <= aligned


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_and_backward_bring_a_unit_with_one_allocation_and_one_copy(
    compute_dtype,
) -> None:
    """Each unit (the rest, a block) comes to the device as one allocation filled by one
    copy, in the compute dtype (from its wires with bf16), not one of each per parameter;
    the step's buckets bring each weight in fp32 on its own."""
    model = gpt()
    units = weight_units(model)
    manager = gradient_cache.create_gradient_cache(
        model, **STREAMED, compute_dtype=compute_dtype, bucket_size_mb=0.02
    )
    backend = manager.engine.backend
    refills: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    allocations: list[int] = []
    start_refill, resize_storage = backend.start_refill, backend.resize_storage

    def counted_refill(pairs, **options):
        refills.append(list(pairs))
        return start_refill(pairs, **options)

    def counted_resize(tensor, nbytes):
        if nbytes:
            allocations.append(nbytes)
        resize_storage(tensor, nbytes)

    backend.start_refill, backend.resize_storage = counted_refill, counted_resize
    tokens, targets = batches(1)[0]
    model(tokens, targets)[1].backward()
    wanted = compute_dtype or torch.float32

    def unit_bytes(params: list) -> int:
        return unit_offsets(params)[1] * wanted.itemsize

    # Forward: every unit; backward: the blocks but the last again.
    expected = [unit_bytes(p) for p in [units.rest, *units.block_params, *units.block_params[:-1]]]
    pairs = [pair for refill in refills for pair in refill]
    assert all(device.dim() == 1 and host.dim() == 1 for device, host in pairs)  # flat
    assert {device.dtype for device, _ in pairs} == {host.dtype for _, host in pairs} == {wanted}
    assert sorted(d.numel() * d.element_size() for d, _ in pairs) == sorted(expected)
    assert sorted(allocations) == sorted(expected)
    before = len(refills)
    manager.step(adamw_two_groups(model))  # the step: a copy per weight, in fp32
    step_pairs = [pair for refill in refills[before:] for pair in refill]
    assert all(device.dtype == torch.float32 for device, _ in step_pairs)
    assert len(step_pairs) == len(list(model.parameters()))


def test_the_masters_fill_unit_by_unit_never_two_whole_copies(monkeypatch) -> None:
    """A model on the host: each unit's masters are cut and filled, and its parameters rest
    on them, before the next unit's are cut, so the cache never holds the old weights and
    the masters whole at once (the host's peak: the model and one unit)."""
    from gradient_cache.engine.state_slabs import StateSlabs

    model = gpt()
    units = weight_units(model)
    every = sum(p.nbytes for p in model.parameters())
    largest = max(unit_offsets(u)[1] * 4 for u in [units.rest, *units.block_params])
    held: list[int] = []
    take = StateSlabs.take

    def counted(slabs, sizes):
        regions = take(slabs, sizes)
        old = sum(p.nbytes for p in model.parameters() if not slabs.holds(p.data))
        held.append(slabs.reserved_bytes + old)  # the masters cut so far, the weights not moved
        return regions

    monkeypatch.setattr(StateSlabs, "take", counted)
    gradient_cache.create_gradient_cache(model, **STREAMED)
    assert len(held) == 1 + len(units.block_params)  # a take a unit
    assert max(held) <= every + largest


def test_an_eval_under_no_grad_matches_plain_and_leaves_nothing_on_the_device() -> None:
    plain, cached = gpt(), gpt()
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    tokens, _ = batches(1)[0]
    with torch.no_grad():
        expected, _ = plain(tokens)
        logits, _ = cached(tokens)
    assert torch.equal(expected, logits)
    assert all_on_the_host(cached, manager)


def test_two_forwards_before_one_backward_keep_the_weights_until_its_end() -> None:
    """Two losses summed: on CUDA each forward gives a parameter its own accumulation
    (its weights moved between them), so none goes at an accumulation, all at the end of
    backward (freed at the first, the second forward's backward would read freed memory)."""
    data = batches(4)

    def run(model, optimizer, manager=None):
        for (tokens, targets), (tokens2, targets2) in zip(data[::2], data[1::2], strict=True):
            (model(tokens, targets)[1] + model(tokens2, targets2)[1]).backward()
            step(model, optimizer, manager)

    plain, cached = gpt(), gpt()
    run(plain, sgd_momentum(plain))
    optimizer = sgd_momentum(cached)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    kept = []
    cached.blocks[1].mlp.fc.weight.register_post_accumulate_grad_hook(
        lambda p: kept.append(weights_of(manager).where(p) is WeightAt.DEVICE)
    )  # registered after the cache's hooks: runs after them
    run(cached, optimizer, manager)
    assert kept == [True, True]
    assert_same_parameters(plain, cached)


def test_a_block_reused_at_every_depth_keeps_its_weights_until_backward_ends() -> None:
    """One block module reused at three depths (ALBERT's sharing): brought at each use,
    and, as it moved between its uses (on CUDA each move starts a new accumulation of its
    gradient), not freed at its first accumulation but at the end of backward."""

    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(64, 32)
            layer = torch.nn.Linear(32, 32)
            self.layers = torch.nn.ModuleList([layer, layer, layer, torch.nn.Linear(32, 32)])
            self.head = torch.nn.Linear(32, 64)

        def forward(self, tokens, targets):
            hidden = self.embed(tokens)
            for layer in self.layers:
                hidden = torch.tanh(layer(hidden))
            logits = self.head(hidden)
            return logits, torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten()
            )

    data = batches(3)
    plain, cached = Shared(), Shared()
    train(plain, adamw_two_groups(plain), data)
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    shared = cached.layers[0].weight
    kept = []
    shared.register_post_accumulate_grad_hook(
        lambda p: kept.append(weights_of(manager).where(p) is WeightAt.DEVICE)
    )  # registered after the cache's hooks: runs after them
    train(cached, optimizer, data, manager=manager)
    assert kept == [True] * len(data)
    assert_same_parameters(plain, cached)


def test_state_dicts_are_the_host_masters_and_a_resumed_run_is_bit_for_bit() -> None:
    """``model.state_dict()`` holds the masters (host tensors, plain's values); a
    checkpoint of model and optimizer, loaded into a new model with its own cache, goes on
    as plain PyTorch's uninterrupted run."""
    data = batches(6)
    plain = gpt()
    train(plain, adamw_two_groups(plain), data)

    first = gpt()
    optimizer = adamw_two_groups(first)
    manager = gradient_cache.create_gradient_cache(first, **STREAMED)
    train(first, optimizer, data[:3], manager=manager)
    state = first.state_dict()
    pointers = {value.untyped_storage().data_ptr() for value in state.values()}
    tied = {value.untyped_storage().data_ptr() for value in plain.state_dict().values()}
    assert len(tied) < len(state)  # the head tied to the embedding
    assert len(pointers) == len(tied)  # a copy of its own each, a tied weight's once, as plain
    assert sum(value.untyped_storage().nbytes() for value in state.values()) == sum(
        value.nbytes for value in state.values()
    )
    buffer = io.BytesIO()
    torch.save({"model": state, "optimizer": optimizer.state_dict()}, buffer)
    manager.remove_hooks()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = gpt()
    optimizer = adamw_two_groups(resumed)
    manager = gradient_cache.create_gradient_cache(resumed, **STREAMED)
    resumed.load_state_dict(saved["model"])  # into the masters
    manager.offload_state_of(optimizer)
    optimizer.load_state_dict(saved["optimizer"])
    train(resumed, optimizer, data[3:], manager=manager)
    assert all_on_the_host(resumed, manager)
    assert_same_parameters(plain, resumed)


def test_closing_the_cache_puts_the_weights_back_on_the_device_and_plain_steps_go_on() -> None:
    data = batches(4)
    plain = gpt()
    plain_optimizer = sgd_momentum(plain)
    train(plain, plain_optimizer, data)
    cached = gpt()
    optimizer = sgd_momentum(cached)
    with gradient_cache.create_gradient_cache(cached, **STREAMED) as manager:
        train(cached, optimizer, data[:2], manager=manager)
        weights = weights_of(manager)
        master = weights._weights[cached.tok_emb.weight].master
        assert cached.tok_emb.weight.data_ptr() == master.data_ptr()
    assert cached.tok_emb.weight.data_ptr() != master.data_ptr()  # a device tensor again
    train(cached, optimizer, data[2:])  # plain PyTorch's loop, no cache
    assert_same_parameters(plain, cached)


@pytest.mark.parametrize(
    ("nth", "compute_dtype"),
    [(None, None), (2, None), (2, torch.bfloat16)],
    ids=["ordered", "a-failed-bucket-retried", "bf16-a-forward-after-a-failed-bucket"],
)
def test_every_weight_copy_is_ordered_on_the_stand_in_streams(
    fake_accelerator: FakeAccelerator,  # noqa: F811
    nth,
    compute_dtype,
) -> None:
    """The accelerator backend on stand-in streams: each weight's device memory is filled on the
    restore stream after the compute stream's earlier work, used only after the copy,
    given back only once nothing reads it, and copied back after the step before it goes.
    With ``nth``, a bucket's optimizer.step() raises once (the next bucket's weights on
    their way), and the retry gives the result of a run without the failure; with bf16, a
    forward comes between (its wires are cast from masters the failed step's copies back
    were still writing: the host waits for them first)."""
    data = batches(3)
    options = {**STREAMED, "bucket_size_mb": 0.02, "compute_dtype": compute_dtype}
    plain, cached = gpt(), gpt()
    with fake_accelerator.checker.disabled():
        reference = None
        if compute_dtype is not None:
            reference = gradient_cache.create_gradient_cache(plain, **options)
        train(plain, adamw_two_groups(plain), data, manager=reference, clip=0.5)
    optimizer = adamw_two_groups(cached)
    failure = FailsOnce(optimizer)
    manager = gradient_cache.create_gradient_cache(
        cached, **options, backend_factory=fake_accelerator.factory
    )
    for i, (tokens, targets) in enumerate(data):
        cached(tokens, targets)[1].backward()
        if i == 1 and nth is not None:
            failure.arm(nth)
            with pytest.raises(torch.OutOfMemoryError):
                manager.step(optimizer, max_grad_norm=0.5)
            assert all_on_the_host(cached, manager)
            if compute_dtype is not None:
                with torch.no_grad():
                    cached(tokens)
            # The buckets stepped before the failure copied their weights back, and no
            # step's end waited for that: reading the masters waits first.
            assert all(value.sum() is not None for value in cached.state_dict().values())
        manager.step(optimizer, max_grad_norm=0.5)
        optimizer.zero_grad()
    state = cached.state_dict()  # waits for the copies back
    assert all(value.sum() is not None for value in state.values())  # host reads, checked
    fake_accelerator.checker.assert_clean()
    with fake_accelerator.checker.disabled():
        assert_same_parameters(plain, cached)


def test_a_failed_send_back_of_a_new_state_still_sends_the_stepped_weights_home() -> None:
    """The first step creates the state; allocating the second bucket's host copies raises
    after that bucket stepped, which the retry does not step again: its new weights went to
    their masters before the state's send could raise (else they would be lost at the next
    free)."""
    plain, cached, _ = a_first_step_failing_at("optimizer_state", "_allocate", steps=2)
    assert_same_parameters(plain, cached)


@pytest.mark.parametrize("then", ["eval", "close"])
def test_a_stepped_weight_whose_copy_back_failed_reaches_its_master_when_freed(then) -> None:
    """Without a retry: the weights a failed copy back left on the device, stepped, go to
    their masters when something frees them (an eval), or with the cache's close, not
    dropped (the close copies the masters back to the device: after that copy back)."""
    model = gpt()
    optimizer = adamw_two_groups(model)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, bucket_size_mb=0.02)
    tokens, targets = batches(1)[0]
    model(tokens, targets)[1].backward()
    FailsAtCall(manager.engine.backend, "start_to_host", nth=2)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer)
    stepped = [p for p in model.parameters() if weights_of(manager).where(p) is WeightAt.DEVICE]
    values = [p.detach().clone() for p in stepped]
    assert stepped
    if then == "eval":
        with torch.no_grad():
            model(tokens)
        assert all_on_the_host(model, manager)
    else:
        manager.remove_hooks()
    assert all(torch.equal(p, v) for p, v in zip(stepped, values, strict=True))


def a_first_step_failing_at(part: str, call: str, *, steps: int):
    """Plain's ``steps`` steps, and the cache's, whose first step raises once at the
    second call of ``call`` of the engine's ``part`` and is retried (every weight home at
    the retry's end); the last steps run after it. Returns (plain, cached, manager)."""
    data = batches(steps)
    plain = gpt()
    train(plain, adamw_two_groups(plain), data)
    cached = gpt()
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, bucket_size_mb=0.02)
    tokens, targets = data[0]
    cached(tokens, targets)[1].backward()
    FailsAtCall(getattr(manager.engine, part), call, nth=2)
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer)
    if call == "start_to_device":  # nothing dirty: the failed bucket's weights went home
        assert all_on_the_host(cached, manager)
    manager.step(optimizer)  # the retry
    optimizer.zero_grad()
    assert all_on_the_host(cached, manager)
    train(cached, optimizer, data[1:], manager=manager)
    return plain, cached, manager


def fsdp2_mixed_precision(
    rank: int, out: str, data: list, micro_batches: int, threads: int
) -> None:
    """The reference of ``compute_dtype``: FSDP2 with ``MixedPrecisionPolicy(param_dtype=
    bfloat16, reduce_dtype=float32)`` on each block and the root, on one process (a gloo
    group with an in-memory store), no offload; its final weights, whole, to ``out``. With
    the test process's ``threads``: a CPU matmul's bits may depend on how many split it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    weights = []
    for model in (gpt(), gpt_reusing_a_block()):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in dict.fromkeys(model.blocks):  # each once: a block may be reused
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        train(model, adamw_two_groups(model), data, micro_batches=micro_batches, clip=0.5)
        weights.append([p.full_tensor() for p in model.parameters()])
    torch.save(weights, out)
    dist.destroy_process_group()


def gpt_reusing_a_block() -> TinyGPT:
    """gpt() whose second block runs twice in each forward (a block's weights shared across
    depths, as ALBERT's): the third block is gone, the fourth runs last."""
    model = gpt()
    first, second, _, last = model.blocks
    model.blocks = torch.nn.ModuleList([first, second, second, last])
    return model


def test_a_compute_dtype_is_fsdp2_mixed_precision_on_one_process_bit_for_bit(tmp_path) -> None:
    """compute_dtype=torch.bfloat16: each fp32 master's bf16 cast (its wire, cast on the
    host) brought for forward and backward, gradients accumulated in fp32, the fp32 masters
    stepped on the device; FSDP2's mixed precision on one process, bit for bit
    (accumulation, clipping, AdamW with two groups). Forward and backward move 2 bytes a
    weight over the link, not the fp32 master's 4."""
    data, micro_batches = batches(4), 2
    out = str(tmp_path / "fsdp2.pt")
    threads = torch.get_num_threads()
    torch.multiprocessing.spawn(fsdp2_mixed_precision, args=(out, data, micro_batches, threads))
    reference, reusing_reference = torch.load(out, weights_only=True)
    reusing = gpt_reusing_a_block()
    train(
        reusing,
        adamw_two_groups(reusing),
        data,
        manager=gradient_cache.create_gradient_cache(
            reusing, **STREAMED, compute_dtype=torch.bfloat16, bucket_size_mb=0.02
        ),
        micro_batches=micro_batches,
        clip=0.5,
    )
    # A reused block's two uses summed in bf16, as FSDP2's one bf16 parameter gets them
    # (the cache summed the parts widened, last bits apart).
    for expected, param in zip(reusing_reference, reusing.parameters(), strict=True):
        assert torch.equal(expected, param)
    cached = gpt()
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(
        cached, **STREAMED, compute_dtype=torch.bfloat16, bucket_size_mb=0.02
    )
    train(cached, optimizer, data, manager=manager, micro_batches=micro_batches, clip=0.5)
    for expected, param in zip(reference, cached.parameters(), strict=True):
        assert param.dtype == torch.float32 and torch.equal(expected, param)
    units = weight_units(cached)
    every = sum(p.nbytes for p in cached.parameters())

    def bf16_bytes(params: list) -> int:  # a unit's wires, each weight at an aligned place
        return unit_offsets(params)[1] * 2

    blocks = [bf16_bytes(params) for params in units.block_params]
    # Forward and backward bring the bf16 wires (the last block stays for backward), the
    # step the fp32 masters both ways: at most 0.8 of the bytes fp32 compute moves.
    streamed = bf16_bytes(units.rest) + 2 * sum(blocks) - blocks[-1]
    moved = micro_batches * streamed + 2 * every
    assert manager.summary().parameters_moved_mb * 2**20 == moved
    fp32 = micro_batches * (every + sum(blocks) * 2 - blocks[-1] * 2) + 2 * every
    assert moved <= 0.8 * fp32


def written_out_bf16_training(data: list, micro_batches: int) -> torch.nn.Module:
    """``compute_dtype``'s reference in plain PyTorch: each micro-batch's forward and
    backward through a bf16 copy of the fp32 masters, its gradients widened to fp32 and
    accumulated there, then clipping and AdamW on the masters, in fp32."""
    masters = gpt()
    optimizer = adamw_two_groups(masters)
    for index, (tokens, targets) in enumerate(data):
        copy_ = gpt().to(torch.bfloat16)
        copy_.load_state_dict(masters.state_dict())  # cast to bf16 as it is copied
        (copy_(tokens, targets)[1] / micro_batches).backward()
        for master, low in zip(masters.parameters(), copy_.parameters(), strict=True):
            widened = low.grad.float()
            master.grad = widened if master.grad is None else master.grad + widened
        if (index + 1) % micro_batches == 0:
            step(masters, optimizer, clip=0.5)
    return masters


def test_a_block_called_for_a_second_loss_under_a_compute_dtype_trains_as_written_out() -> None:
    """On a CPU run with compute_dtype the weights in use are host tensors too, in bf16: the
    guard set at the forward's end took the last block's, still in use, for weights at rest,
    and refused that block called as a module for a second loss as "block.forward(x)"
    (probe A). At rest is told by the dtype too: each backward trains as written out in
    plain PyTorch (each one's bf16 gradients widened and summed in fp32, FSDP2's way)."""
    data = batches(2)
    features = torch.randn(2, 16, CONFIG.d_model, generator=torch.Generator().manual_seed(5))

    def losses(model, tokens, targets, inputs) -> list[torch.Tensor]:
        loss = model(tokens, targets)[1]  # the last block kept in use for backward
        return [loss, model.blocks[-1](inputs).float().square().mean()]

    masters = gpt()
    optimizer = adamw_two_groups(masters)
    for tokens, targets in data:
        low = gpt().to(torch.bfloat16)
        low.load_state_dict(masters.state_dict())  # cast to bf16 as it is copied
        for loss in losses(low, tokens, targets, features.bfloat16()):
            loss.backward()
            for master, param in zip(masters.parameters(), low.parameters(), strict=True):
                if param.grad is not None:
                    widened = param.grad.float()
                    master.grad = widened if master.grad is None else master.grad + widened
                    param.grad = None
        step(masters, optimizer)
    cached = gpt()
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, compute_dtype=torch.bfloat16)
    for tokens, targets in data:
        for loss in losses(cached, tokens, targets, features):  # the block casts its input
            loss.backward()
        step(cached, optimizer, manager)
    assert_same_parameters(masters, cached)


@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_bf16_gradients_cross_as_they_came_and_train_as_written_out(micro_batches) -> None:
    """compute_dtype=torch.bfloat16, lossless: a micro-batch's gradient with nothing to
    join crosses in bf16 (2 bytes a parameter) and is widened at its restore, exactly; the
    second's crosses in bf16 too, beside the first's in its slot, summed in fp32 where read;
    a third joins their sum in fp32. Three AdamW steps with clipping equal the reference
    written out in plain PyTorch; the store holds half the dense bytes after one
    micro-batch, all of them after two or three."""
    data = batches(3 * micro_batches)
    reference = written_out_bf16_training(data, micro_batches)
    cached = gpt()
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(
        cached, **STREAMED, compute_dtype=torch.bfloat16, bucket_size_mb=0.02
    )
    train(
        cached,
        optimizer,
        data[:-micro_batches],
        manager=manager,
        micro_batches=micro_batches,
        clip=0.5,
    )
    for tokens, targets in data[-micro_batches:]:
        (cached(tokens, targets)[1] / micro_batches).backward()
    manager.compress_and_free_gradients()
    figures = manager.summary()
    dense = figures.dense_gradient_mb * 2**20
    assert figures.stored_gradient_mb * 2**20 == (dense / 2 if micro_batches == 1 else dense)
    # The planner (`gradient-cache plan --compute-dtype bf16`) counts these bytes: out in
    # backward, the first two micro-batches' carried; back at the restore.
    planned = planned_weights_on_host(
        cached, micro_batches=micro_batches, weight_copy_bytes=2, compression_ratio=1
    )
    backward, step_ = planned.phases[1:]
    carried, joined = min(micro_batches, 2) * dense / 2, max(micro_batches - 2, 0) * dense
    assert backward.link_bytes_per_step["device to host"] == carried + joined
    masters_and_adamw = planned.host_bytes * 3  # 4 bytes an entry, and AdamW's 8
    restored = step_.link_bytes_per_step["host to device"] - masters_and_adamw
    assert restored == figures.stored_gradient_mb * 2**20
    step(cached, optimizer, manager, clip=0.5)
    assert_same_parameters(reference, cached)


def test_bf16_gradients_fill_buckets_as_their_fp32_sums_will() -> None:
    """A bucket is counted in the dtype it is restored and stepped in: bf16 gradients that
    cross as they came fill the fp32 run's buckets, not twice as many parameters (the
    step holds two buckets' fp32 gradients, weights and AdamW state: a probe found a bf16
    step's peak twice the fp32 one's on Llama and Mixtral shapes)."""

    def buckets(compute_dtype: torch.dtype | None) -> list[list[int]]:
        model = gpt()
        manager = gradient_cache.create_gradient_cache(
            model, **STREAMED, compute_dtype=compute_dtype, bucket_size_mb=0.02
        )
        launched: list[list[int]] = []
        launch = manager.engine.capture.launch

        def counting(items) -> None:
            launched.append([param.numel() for param, _ in items or []])
            launch(items)

        manager.engine.capture.launch = counting
        tokens, targets = batches(1)[0]
        model(tokens, targets)[1].backward()
        manager.compress_and_free_gradients()
        manager.remove_hooks()
        return [sizes for sizes in launched if sizes]

    fp32 = buckets(None)
    assert len(fp32) > 2 and buckets(torch.bfloat16) == fp32


def test_bf16_gradients_waiting_in_an_open_bucket_join_in_fp32() -> None:
    """Two micro-batches into one bucket that fills only at the step: the first's bf16
    gradients still wait on the device when the second's come, which are widened before
    they are added to them (two bf16 gradients added in bf16 would round), as written out."""
    data = batches(2)
    reference = written_out_bf16_training(data, micro_batches=2)
    cached = gpt()
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(
        cached, **STREAMED, compute_dtype=torch.bfloat16, bucket_size_mb=64
    )
    (cached(*data[0])[1] / 2).backward()
    assert len(manager.engine.assembler) == len(list(cached.parameters()))  # all waiting
    (cached(*data[1])[1] / 2).backward()
    step(cached, optimizer, manager, clip=0.5)
    assert_same_parameters(reference, cached)


class Bf16Forward(torch.nn.Module):
    """``inner``'s forward through bf16 casts of its fp32 weights, in plain PyTorch: each
    weight's gradient is the bf16 one, widened exactly by the cast's backward."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> tuple:
        low = {name: p.to(torch.bfloat16) for name, p in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, low, args)


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_a_lossy_codec_encodes_a_compute_dtypes_gradient_widened(codec) -> None:
    """compute_dtype=torch.bfloat16 with a lossy codec: the codec encodes each gradient
    widened to fp32, as it encodes the gradient of an fp32 weight cast to bf16 in a plain
    forward (same codec, seed and buckets): bit for bit over three clipped steps of two
    micro-batches. Encoding the bf16 gradient itself (scales and rounding in bf16) trains
    2e-2 away."""
    data = batches(6)
    options = {"codec": codec, "offload_optimizer_state": True, "bucket_size_mb": 0.02}
    cached = gpt()
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(
        cached, **options, offload_parameters=True, compute_dtype=torch.bfloat16
    )
    train(cached, optimizer, data, manager=manager, micro_batches=2, clip=0.5)
    reference = gpt()
    optimizer = adamw_two_groups(reference)
    wrapped = Bf16Forward(reference)
    manager = gradient_cache.create_gradient_cache(wrapped, **options)
    train(wrapped, optimizer, data, manager=manager, micro_batches=2, clip=0.5)
    assert_same_parameters(reference, cached)


def test_two_finite_bf16_gradients_whose_sum_overflows_skip_a_scaled_step() -> None:
    """With a GradScaler two micro-batches' bf16 gradients are not kept side by side: each
    is finite (2e38), their fp32 sum is not, and the scaler's inf check reads what the
    encode sees. The step is skipped and the scale backs off, as plain PyTorch does."""

    class TwoBlocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2, bias=False) for _ in "ab")
            with torch.no_grad():
                for block in self.blocks:
                    block.weight.copy_(torch.eye(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x[:, 1].sum()  # block 0's weight gets 2e38 a micro-batch

    x = torch.tensor([[2e38, 1.0]])
    scales = []
    for options in (None, {**STREAMED, "compute_dtype": torch.bfloat16}):
        model = TwoBlocks()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        manager = None
        if options is not None:
            manager = gradient_cache.create_gradient_cache(model, **options, grad_scaler=scaler)
        for _ in range(2):
            scaler.scale(model(x)).backward()
            if manager is not None:
                manager.compress_and_free_gradients()  # the first in the store, not waiting
        if manager is None:
            scaler.step(optimizer)
        else:
            manager.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert scales == [0.5, 0.5]


def test_a_failed_encode_gives_a_carried_bf16_gradient_back_widened() -> None:
    """An encode at the drain that raises (out of memory) gives the gradients not yet
    encoded back in ``.grad``: a carried bf16 one widened to its fp32 master's dtype, its
    value unchanged (assigned as it came, it raised a dtype error in place of the
    encode's, and was lost)."""
    model = gpt()
    manager = gradient_cache.create_gradient_cache(  # the last bucket holds several
        model, **STREAMED, compute_dtype=torch.bfloat16, bucket_size_mb=0.04
    )
    low = gpt().to(torch.bfloat16)  # the written-out bf16 gradients
    low.load_state_dict(model.state_dict())
    tokens, targets = batches(1)[0]
    low(tokens, targets)[1].backward()
    model(tokens, targets)[1].backward()  # the last bucket waits for the drain
    FailsAtCall(manager.engine.capture, "_encode", nth=2)
    with pytest.raises(torch.OutOfMemoryError):
        manager.compress_and_free_gradients()
    given = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert given
    for name, grad in given.items():
        assert grad.dtype == torch.float32, name
        assert torch.equal(grad, low.get_parameter(name).grad.float()), name
    manager.remove_hooks()


@pytest.mark.parametrize("held", [1, 2])
def test_a_checkpoint_holding_bf16_gradients_resumes_as_written_out(held) -> None:
    """A checkpoint taken after the first (or the first two) of ``held + 1`` micro-batches
    holds their gradients as they crossed, in bf16 (two side by side); a new cache loads it
    (a bf16 payload of an fp32 gradient is not taken for damage, two parts of different
    dtypes are) and the step ends as the written-out reference."""
    micro_batches = held + 1
    data = batches(micro_batches)
    reference = written_out_bf16_training(data, micro_batches=micro_batches)

    def build() -> tuple:
        model = gpt()
        optimizer = adamw_two_groups(model)
        options = dict(STREAMED, compute_dtype=torch.bfloat16, bucket_size_mb=0.02)
        return model, optimizer, gradient_cache.create_gradient_cache(model, **options)

    model, optimizer, manager = build()
    for tokens, targets in data[:held]:
        (model(tokens, targets)[1] / micro_batches).backward()
    saved = save_and_load(model, manager, optimizer)
    manager.remove_hooks()
    payloads = [item["payload"] for bucket in saved["cache"]["buckets"] for item in bucket]
    assert {p["tensor"].dtype for p in payloads} == {torch.bfloat16}
    assert all((p["earlier"] is None) == (held == 1) for p in payloads)
    model, optimizer, manager = build()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    if held == 2:
        damaged = copy.deepcopy(saved["cache"])
        first = damaged["buckets"][0][0]["payload"]
        first["earlier"] = first["earlier"].float()
        with pytest.raises(ValueError, match=r"payload\['earlier'\] is a cpu torch.float32"):
            manager.load_state_dict(damaged)
    manager.load_state_dict(saved["cache"])
    (model(*data[-1])[1] / micro_batches).backward()
    step(model, optimizer, manager, clip=0.5)
    assert_same_parameters(reference, model)


def test_writes_to_the_masters_reach_the_next_forward_and_a_cast_model_is_refused() -> None:
    """compute_dtype: a load, or an in-place write at rest (an EMA copied in), writes the
    fp32 masters, and the next forward computes with them (cast on the device from the
    masters, no other copy to go stale). model.to() after the cache was created is refused
    at the next forward, naming it."""
    data = batches(2)
    plain = gpt()
    manager_plain = gradient_cache.create_gradient_cache(
        plain, **STREAMED, compute_dtype=torch.bfloat16
    )
    train(plain, adamw_two_groups(plain), data, manager=manager_plain)
    loaded = gpt()
    manager = gradient_cache.create_gradient_cache(loaded, **STREAMED, compute_dtype=torch.bfloat16)
    loaded.load_state_dict(plain.state_dict())
    tokens, _ = data[0]
    with torch.no_grad():
        assert torch.equal(plain(tokens)[0], loaded(tokens)[0])
        for param in loaded.parameters():
            param.mul_(0.5)  # at rest: the masters
        for param in plain.parameters():
            param.mul_(0.5)
        assert torch.equal(plain(tokens)[0], loaded(tokens)[0])
    loaded.to(torch.float64)
    with pytest.raises(
        RuntimeError, match=r"'blocks\.0\.ln_attn\.weight' moved or cast off the host master"
    ):
        loaded(tokens)
    manager.remove_hooks()


def test_a_write_through_param_data_at_rest_reaches_the_next_forward_and_step() -> None:
    """compute_dtype: diffusers' ``EMAModel.copy_to`` writes ``param.data.copy_(...)`` at
    rest, which moves no version counter; each ``P.data`` a weight at rest hands out is
    counted, so its bf16 copy is cast again for the next forward instead of kept stale.
    The reference: the same values written by ``load_state_dict`` into a second cache."""
    data = batches(3)
    models = gpt(), gpt()
    managers = [
        gradient_cache.create_gradient_cache(model, **STREAMED, compute_dtype=torch.bfloat16)
        for model in models
    ]
    optimizers = [adamw_two_groups(model) for model in models]
    for model, optimizer, manager in zip(models, optimizers, managers, strict=True):
        train(model, optimizer, data[:1], manager=manager)  # the wires cast, then stepped
    written, loaded = models
    # Between steps every weight at rest counts its P.data reads (plain during the step).
    assert {type(param) for param in written.parameters()} == {at_rest.WatchedAtRest}
    tokens, _ = data[1]
    with torch.no_grad():
        assert torch.equal(written(tokens)[0], loaded(tokens)[0])  # the wires cast again
    ema = {
        name: value * 0.5 + 0.01 if value.is_floating_point() else value
        for name, value in written.state_dict().items()
    }
    loaded.load_state_dict(ema)
    for name, param in written.named_parameters():
        param.data.copy_(ema[name])  # at rest: the master, no version counter moved
    with torch.no_grad():
        assert torch.equal(written(tokens)[0], loaded(tokens)[0])
    for param in written.parameters():
        param.data.mul_(0.5)  # after an eval too
    with torch.no_grad():
        for param in loaded.parameters():
            param.mul_(0.5)
    for model, optimizer, manager in zip(models, optimizers, managers, strict=True):
        train(model, optimizer, data[1:], manager=manager)
    assert_same_parameters(loaded, written)
    for manager in managers:
        manager.remove_hooks()
    assert all(type(param) is torch.nn.Parameter for param in written.parameters())


def test_after_a_skipped_step_a_write_through_param_data_still_reaches_the_next_forward() -> None:
    """The weights at rest are plain through the fused step and watched again however it ends:
    a GradScaler's skipped step (found inf) never ran the buckets (an outside review: they
    stayed plain, and a ``param.data`` write after it was lost, 0.327 off)."""
    data = batches(2)

    def run(write) -> torch.Tensor:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        model = gpt()
        manager = gradient_cache.create_gradient_cache(
            model, **STREAMED, compute_dtype=torch.float16, grad_scaler=scaler
        )
        optimizer = adamw_two_groups(model)
        tokens, targets = data[0]
        for factor in (1.0, float("inf")):  # a step, then a skipped one
            scaler.scale(model(tokens, targets)[1] * factor).backward()
            manager.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert {type(param) for param in model.parameters()} == {at_rest.WatchedAtRest}
        with torch.no_grad():
            model(data[1][0])  # an eval: the wires current
            for param in model.parameters():
                write(param)
            out = model(data[1][0])[0]
        manager.remove_hooks()
        return out

    written = run(lambda param: param.data.mul_(0.5))
    assert torch.equal(written, run(lambda param: param.mul_(0.5)))


def test_the_compute_copies_are_ordered_on_the_stand_in_streams(
    fake_accelerator: FakeAccelerator,  # noqa: F811
) -> None:
    """compute_dtype on the stand-in streams: the bf16 copies brought for forward and
    backward, the masters for the step, the new bf16 copies cast on the compute stream and
    copied back on the copy stream before their memory goes; three micro-batches a step,
    the second's bf16 gradients copied beside the first's in their slots, the third's
    encode reading both: every access ordered."""
    cached = gpt()
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(
        cached,
        **STREAMED,
        compute_dtype=torch.bfloat16,
        bucket_size_mb=0.02,
        backend_factory=fake_accelerator.factory,
    )
    train(cached, optimizer, batches(6), manager=manager, micro_batches=3, clip=0.5)
    assert all_on_the_host(cached, manager)
    with torch.no_grad():
        cached(batches(1)[0][0])  # reads the new bf16 copies
    fake_accelerator.checker.assert_clean()


def test_a_second_forward_meets_the_rest_in_the_compute_dtype_and_trains() -> None:
    """Two forwards before one backward with compute_dtype: the second forward's parameter
    check meets the rest's weights in use, in bf16 on the device, which is where the cache
    put them (not a cast of the model, which is refused)."""
    data = batches(4)
    model = gpt()
    optimizer = sgd_momentum(model)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, compute_dtype=torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    for (tokens, targets), (tokens2, targets2) in zip(data[::2], data[1::2], strict=True):
        (model(tokens, targets)[1] + model(tokens2, targets2)[1]).backward()
        step(model, optimizer, manager)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_compute_dtype_casts_the_models_floating_inputs() -> None:
    """Floating inputs meet bf16 weights: cast at the model and at each block, as FSDP2's
    mixed precision casts them (else the first layer's matmul refuses the mix)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, compute_dtype=torch.bfloat16)
    output = model(torch.randn(4, 16))
    assert output.dtype == torch.bfloat16
    output.float().pow(2).mean().backward()
    manager.step(optimizer)
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_a_forward_that_raises_gives_back_the_block_arriving_after_its_copy(
    fake_accelerator: FakeAccelerator,  # noqa: F811
) -> None:
    """A block raises while the next one arrives on the restore stream: the arriving block's
    memory goes only once the compute stream waited for its copy, and nothing stays."""
    model = gpt()
    manager = gradient_cache.create_gradient_cache(
        model, **STREAMED, backend_factory=fake_accelerator.factory
    )

    def raises(*args, **kwargs):
        raise RuntimeError("injected: a block fails")

    model.blocks[1].attn.forward = raises
    tokens, targets = batches(1)[0]
    with pytest.raises(RuntimeError, match="injected"):
        model(tokens, targets)
    assert all_on_the_host(model, manager)
    fake_accelerator.checker.assert_clean()


def test_a_submodule_called_alone_brings_the_rest_it_uses() -> None:
    """A framework calls a submodule, never the model given to the cache (Lightning's
    training_step calls self.model): the rest's modules bring their own weights, which are
    then on the device while they run (on a GPU the host masters would not be usable), and
    training is plain's."""

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = gpt()

    data = batches(2)
    plain = gpt()
    train(plain, adamw_two_groups(plain), data)
    wrapper = Wrapper()
    optimizer = adamw_two_groups(wrapper.inner)
    manager = gradient_cache.create_gradient_cache(wrapper, **STREAMED)
    seen = []
    wrapper.inner.ln_f.register_forward_hook(
        lambda *_: seen.append(weights_of(manager).where(wrapper.inner.ln_f.weight))
    )
    train(wrapper.inner, optimizer, data, manager=manager)
    assert seen == [WeightAt.DEVICE] * len(data)
    assert_same_parameters(plain, wrapper.inner)


class Wrapper(torch.nn.Module):
    """What a LightningModule is to the cache: it is given the wrapper, the loop calls
    ``inner``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = gpt()


def test_through_a_submodule_an_eval_then_a_load_reaches_training_and_the_window_holds() -> None:
    """The loop calls a submodule, never the model given: an eval under no_grad leaves
    nothing on the device (a load's write then reaches the next use, not a stale device
    copy), and every step's backward frees each weight at its accumulation (the window of
    the first step, not the model)."""
    data = batches(3)

    def run(wrapper, manager=None):
        optimizer = sgd_momentum(wrapper)
        for i, (tokens, targets) in enumerate(data):
            wrapper.inner(tokens, targets)[1].backward()
            step(wrapper, optimizer, manager)
            if i == 0:
                with torch.no_grad():
                    wrapper.inner(tokens)
                if manager is not None:
                    assert all_on_the_host(wrapper, manager)
                wrapper.load_state_dict({k: v + 0.01 for k, v in wrapper.state_dict().items()})

    plain, cached = Wrapper(), Wrapper()
    run(plain)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    last = []
    cached.inner.tok_emb.weight.register_post_accumulate_grad_hook(  # accumulated last
        lambda p: last.append(len(weights_of(manager).present()))
    )
    run(cached, manager)
    assert_same_parameters(plain, cached)
    assert last == [last[0]] * len(data) and last[0] <= 4  # the rest, not the model


def test_a_load_while_weights_are_on_the_device_reaches_the_next_use() -> None:
    """A forward with gradients whose output is dropped leaves the rest on the device until
    a backward; a load then writes the masters, and no device copy may outlive it."""
    data = batches(2)

    def run(model, manager=None):
        optimizer = sgd_momentum(model)
        loaded = {k: v + 0.01 for k, v in model.state_dict().items()}
        model(*data[0])  # dropped: no backward
        model.load_state_dict(loaded)
        train(model, optimizer, data, manager=manager)

    plain, cached = gpt(), gpt()
    run(plain)
    run(cached, gradient_cache.create_gradient_cache(cached, **STREAMED))
    assert_same_parameters(plain, cached)


def test_a_failed_copy_of_the_state_sends_the_buckets_weights_home() -> None:
    """The state's copy to the device raises after the bucket's weights were brought:
    they go home with it, and the retry gives plain's result."""
    plain, cached, _ = a_first_step_failing_at("backend", "start_to_device", steps=2)
    assert_same_parameters(plain, cached)


def test_a_failed_copy_back_loses_no_update() -> None:
    """A bucket stepped, then its weights' copy back raises: the bucket is not stepped
    again by the retry (its payloads are spent), so its updated device copy is the newer
    and must reach the master before it is freed (it is dirty until copied)."""
    plain, cached, _ = a_first_step_failing_at("backend", "start_to_host", steps=3)
    assert_same_parameters(plain, cached)


def test_a_failed_bring_in_the_step_leaves_weights_and_state_home() -> None:
    """The device runs out of memory as a bucket's weights are brought for the step:
    nothing of that bucket moved (its state is home, no device memory kept), and the
    retry steps it as plain PyTorch does."""
    data = batches(2)
    plain = gpt()
    train(plain, adamw_two_groups(plain), data)
    cached = gpt()
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED, bucket_size_mb=0.02)
    train(cached, optimizer, data[:1], manager=manager)  # the state exists from here
    tokens, targets = data[1]
    cached(tokens, targets)[1].backward()
    backend = manager.engine.backend
    resize, allocations = backend.resize_storage, []

    def fails_at_the_fifth_allocation(tensor, nbytes):
        allocations.append(nbytes)
        if nbytes and len([n for n in allocations if n]) == 5:
            raise torch.OutOfMemoryError("injected: out of memory")
        resize(tensor, nbytes)

    backend.resize_storage = fails_at_the_fifth_allocation
    with pytest.raises(torch.OutOfMemoryError):
        manager.step(optimizer)
    backend.resize_storage = resize
    places = manager.engine.optimizer_state.state_copies(optimizer)
    assert set(places.at.values()) == {StateAt.HOST}
    assert all_on_the_host(cached, manager)
    held = weights_of(manager).device_tensors()
    assert sum(tensor.untyped_storage().nbytes() for tensor in held) == 0
    manager.step(optimizer)
    assert_same_parameters(plain, cached)


def test_the_steps_end_leaves_the_masters_complete_for_the_host(
    fake_accelerator: FakeAccelerator,  # noqa: F811
) -> None:
    """At rest the parameters are the masters, which a user reads or writes between steps
    (a log, an EMA, a clamp): the step ends once its copies back are complete."""
    cached = gpt()
    optimizer = sgd_momentum(cached)
    manager = gradient_cache.create_gradient_cache(
        cached, **STREAMED, bucket_size_mb=0.02, backend_factory=fake_accelerator.factory
    )
    train(cached, optimizer, batches(1), manager=manager)
    with torch.no_grad():
        norms = [param.norm() for param in cached.parameters()]  # host reads
        for param in cached.parameters():
            param.clamp_(-1, 1)  # host writes
    assert norms
    fake_accelerator.checker.assert_clean()


def test_a_parameter_of_no_module_steps_with_the_others() -> None:
    """The optimizer also steps a parameter the model does not hold (a temperature in the
    loss): it stays where it is, outside the weights' streaming."""
    data = batches(2)

    def run(model, temperature, manager=None):
        optimizer = torch.optim.AdamW([*model.parameters(), temperature], lr=1e-2)
        for tokens, targets in data:
            logits, _ = model(tokens)
            loss = torch.nn.functional.cross_entropy(
                (logits * temperature).flatten(0, 1), targets.flatten()
            )
            loss.backward()
            step(model, optimizer, manager)

    plain, cached = gpt(), gpt()
    plain_t, cached_t = torch.nn.Parameter(torch.ones(())), torch.nn.Parameter(torch.ones(()))
    run(plain, plain_t)
    run(cached, cached_t, gradient_cache.create_gradient_cache(cached, **STREAMED))
    assert_same_parameters(plain, cached)
    assert torch.equal(plain_t, cached_t)


def test_an_eval_between_forward_and_backward_and_a_retained_graph_keep_what_backward_reads() -> (
    None
):
    """An eval forward under no_grad between a forward and its backward frees the blocks it
    brought, not what the pending backward reads; a second backward through a retained
    graph brings the rest again."""
    data = batches(2)

    def run(model, manager=None):
        optimizer = sgd_momentum(model)
        for tokens, targets in data:
            _, loss = model(tokens, targets)
            with torch.no_grad():
                model(tokens)
            loss.backward(retain_graph=True)
            loss.backward()
            step(model, optimizer, manager)

    plain, cached = gpt(), gpt()
    run(plain)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    run(cached, manager)
    assert_same_parameters(plain, cached)
    assert all_on_the_host(cached, manager)


def test_a_failed_forward_or_an_eval_leaves_the_window_as_it_was() -> None:
    """A forward that raises in a block brings nothing for good, and an eval under no_grad
    neither: the next backward holds the rest and two blocks, not the model. (A forward with
    gradients whose output is dropped counts as pending until the next backward ends: that
    one keeps its weights to its end; validation belongs under no_grad.)"""
    model = gpt()
    units = weight_units(model)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    seen = measure_the_window(manager)
    tokens, targets = batches(1)[0]
    with torch.no_grad():
        model(tokens, targets)
    with pytest.raises(IndexError):
        model(torch.full_like(tokens, 999), targets)  # raises in the embedding
    seen.clear()
    train(model, sgd_momentum(model), batches(1), manager=manager)
    rest = sum(p.nbytes for p in units.rest)
    assert max(seen) <= rest + 2 * max(sum(p.nbytes for p in ps) for ps in units.block_params)


def test_frozen_block_weights_go_when_their_blocks_backward_is_done() -> None:
    """Frozen weights (LoRA-style fine-tuning) have no accumulation to free them: each
    goes when its block's inputs have their gradient, so backward holds two blocks, not
    the model."""
    model = gpt()
    for param in model.blocks.parameters():
        if param.dim() == 2:
            param.requires_grad_(False)
    units = weight_units(model)
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    seen = measure_the_window(manager)
    first = model.blocks[0].attn.qkv.weight  # the first block's input is no block's output
    gone = []
    model.tok_emb.weight.register_post_accumulate_grad_hook(  # accumulated last
        lambda p: gone.append(weights_of(manager).where(first) is WeightAt.HOST)
    )
    train(model, sgd_momentum(model), batches(2), manager=manager)
    assert gone == [True, True]
    rest = sum(p.nbytes for p in units.rest)
    assert max(seen) <= rest + 2 * max(sum(p.nbytes for p in ps) for ps in units.block_params)


def test_two_optimizers_report_the_steps_weight_and_state_bytes_together() -> None:
    """Each optimizer's fused step brings its own parameters' weights and state; the
    summary's figures are the step's, both optimizers' together, as with one over all."""
    data = batches(2)
    figures = []
    for split in (False, True):
        model = gpt()
        manager = gradient_cache.create_gradient_cache(model, **STREAMED)
        params = list(model.parameters())
        groups = [params[:10], params[10:]] if split else [params]
        optimizers = [torch.optim.SGD(group, lr=0.05, momentum=0.9) for group in groups]
        for tokens, targets in data:
            model(tokens, targets)[1].backward()
            for optimizer in optimizers:
                manager.step(optimizer)
                optimizer.zero_grad()
        summary = manager.summary()
        figures.append((summary.parameters_moved_mb, summary.optimizer_state_moved_mb))
    assert figures[0] == figures[1]
    # The momentum buffers (the parameters' bytes) brought and sent back.
    assert figures[0][1] * 2**20 == 2 * sum(p.numel() * p.element_size() for p in params)
    assert figures[0][0] > 0


def test_disable_is_refused_with_the_weights_on_the_host() -> None:
    manager = gradient_cache.create_gradient_cache(gpt(), **STREAMED)
    with pytest.raises(RuntimeError, match="disable\\(\\) cannot run with offload_parameters"):
        manager.disable()


# --- bad input -------------------------------------------------------------------------


def test_the_option_needs_the_state_offloaded_and_the_blocks_option_needs_it() -> None:
    with pytest.raises(ValueError, match="needs offload_optimizer_state=True"):
        gradient_cache.EngineConfig(offload_parameters=True)
    with pytest.raises(ValueError, match="acts only with offload_parameters=True"):
        gradient_cache.EngineConfig(parameter_blocks="blocks")
    with pytest.raises(TypeError, match="parameter_blocks must be"):
        gradient_cache.EngineConfig(
            offload_parameters=True, offload_optimizer_state=True, parameter_blocks=3
        )


def test_a_model_without_blocks_or_a_wrong_name_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"no blocks in Linear.*parameter_blocks="):
        gradient_cache.create_gradient_cache(torch.nn.Linear(4, 4), **STREAMED)
    model = gpt()
    with pytest.raises(ValueError, match=r"parameter_blocks='layers' names no module"):
        gradient_cache.create_gradient_cache(model, **STREAMED, parameter_blocks="layers")
    manager = gradient_cache.create_gradient_cache(model, **STREAMED, parameter_blocks="blocks")
    assert manager.summary().parameters_host_mb > 0  # nothing was left attached before


def test_exclude_layers_and_a_view_parameter_are_refused_and_nothing_changes() -> None:
    model = gpt()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"exclude_layers=.*cannot be combined"):
        gradient_cache.create_gradient_cache(model, **STREAMED, exclude_layers=["ln_f"])
    flat = torch.zeros(64)
    model.ln_f.bias = torch.nn.Parameter(flat[:32])  # a view of a larger tensor
    with pytest.raises(ValueError, match=r"'ln_f.bias': it is a view of a larger tensor"):
        gradient_cache.create_gradient_cache(model, **STREAMED)
    model.ln_f.bias = torch.nn.Parameter(before["ln_f.bias"].clone())
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)  # nothing was attached
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])
    manager.remove_hooks()


def test_a_host_without_room_is_refused_before_anything_moves(monkeypatch) -> None:
    model = gpt()
    every = sum(p.nbytes for p in model.parameters())
    # host_memory_fraction=0.5 of it and of the model's own host memory, which comes back as
    # the masters fill: room for the cache's gradients, not for the weights.
    monkeypatch.setattr("gradient_cache.engine.hostmem.available_host_bytes", lambda: every // 2)
    pointers = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(HostMemoryError, match="the weights' masters"):
        gradient_cache.create_gradient_cache(model, **STREAMED)
    assert [p.data_ptr() for p in model.parameters()] == pointers  # nothing moved
    monkeypatch.undo()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)  # nothing was attached
    assert manager.summary().parameters_host_mb > 0


def test_a_close_between_a_forward_and_its_backward_is_refused_until_it_ran() -> None:
    """remove_hooks() while a forward's graph lives (a loss computed from its output, the
    output itself dropped) would leave its backward reading weights the close moved (a
    bare setStorage error): refused, changing nothing; the backward and the step then
    match plain's, and the close goes through. A forward whose graph was dropped, and a
    with-block left on an exception, close at once."""
    data = batches(2)
    plain = gpt()
    optimizer = adamw_two_groups(plain)
    train(plain, optimizer, data)
    cached = gpt()
    optimizer = adamw_two_groups(cached)
    manager = gradient_cache.create_gradient_cache(cached, **STREAMED)
    for i, (tokens, targets) in enumerate(data):
        loss = cached(tokens, targets)[1] * 1.0  # the model's own outputs dropped
        if i == 0:
            with pytest.raises(RuntimeError, match="between a forward and its backward"):
                manager.remove_hooks()
        loss.backward()
        step(cached, optimizer, manager)
    assert_same_parameters(plain, cached)
    cached(*data[0])  # no backward will come for it: its graph is dropped at once
    manager.remove_hooks()
    again = gpt()
    manager = gradient_cache.create_gradient_cache(again, **STREAMED)
    with pytest.raises(ValueError, match="the user's"), manager:
        loss = again(*data[0])[1]
        raise ValueError("the user's")
    assert manager.engine is None and loss.grad_fn is not None  # closed, its graph alive
    with pytest.raises(RuntimeError, match="before remove_hooks"):  # a bare setStorage error
        loss.backward()


def test_a_second_loss_through_the_head_called_alone_is_plain() -> None:
    """An auxiliary loss through the final norm and the head called on their own between the
    model's forward and its backward, backwarded after the model's loss: that backward's end
    freed the head's weights and the second backward failed with a bare setStorage error
    (probe A). It now brings the rest as a backward through the model's output does:
    plain's result."""
    data = batches(2)
    features = torch.randn(2, 16, CONFIG.d_model, generator=torch.Generator().manual_seed(5))
    models = []
    for cached in (False, True):
        model = gpt()
        optimizer = adamw_two_groups(model)
        manager = gradient_cache.create_gradient_cache(model, **STREAMED) if cached else None
        for tokens, targets in data:
            loss = model(tokens, targets)[1]
            auxiliary = model.lm_head(model.ln_f(features)).square().mean()
            loss.backward()
            auxiliary.backward()
            step(model, optimizer, manager)
        models.append(model)
    assert_same_parameters(*models)


class Queries(torch.nn.Module):
    """Learned queries handed on as they are (DETR's): a module returning its parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, CONFIG.d_model))

    def forward(self) -> torch.Tensor:
        return self.weight


def test_a_module_outside_the_blocks_returning_its_parameter_trains_as_plain() -> None:
    """A submodule of the rest called on its own that returns its parameter as is: the
    cache hooked its output, the parameter itself, at every call, and the hooks stayed (one
    a step, each slowing every backward; after the close they refused a plain backward:
    review R13). Leaves are not hooked: plain's result, no hook left, and the parameter
    trains plainly after the close."""
    data = batches(3)
    models = []
    for cached in (False, True):
        model = gpt()
        model.queries = Queries()
        optimizer = adamw_two_groups(model)
        manager = gradient_cache.create_gradient_cache(model, **STREAMED) if cached else None
        for tokens, targets in data:
            (model(tokens, targets)[1] + model.queries().square().mean()).backward()
            step(model, optimizer, manager)
        if manager is not None:
            assert not model.queries.weight._backward_hooks
            manager.remove_hooks()
        model.queries().square().mean().backward()
        models.append(model)
    assert_same_parameters(*models)
    assert torch.equal(models[0].queries.weight.grad, models[1].queries.weight.grad)


def test_a_close_after_a_backward_that_raised_goes_through() -> None:
    """A backward that began and raised (a user's hook): the forward's backward came, so
    remove_hooks() right after closes (no backward's end ran to say so), and the model then
    trains as plain PyTorch."""
    data = batches(2)
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)

    def fails(grad: torch.Tensor) -> None:
        raise ValueError("the user's hook")

    handle = model.tok_emb.weight.register_hook(fails)  # late in backward, after its begin
    loss = model(*data[0])[1]
    with pytest.raises(ValueError, match="the user's hook"):
        loss.backward()
    handle.remove()
    manager.remove_hooks()
    model(*data[1])[1].backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_backward_after_a_close_that_another_backward_allowed_is_refused_by_name() -> None:
    """Two forwards, the second's backward, then remove_hooks(): a backward's end lets a
    close through (a forward's output kept and never backwarded, a metric, is common), so
    the first forward's backward, still to come, met the moved weights with a bare setStorage
    error. It is refused by name now; before the close both backwards in reverse order train
    as plain's."""
    data = batches(2)
    models = []
    for cached in (False, True):
        model = gpt()
        optimizer = adamw_two_groups(model)
        manager = gradient_cache.create_gradient_cache(model, **STREAMED) if cached else None
        first = model(*data[0])[1] * 1.0
        second = model(*data[1])[1] * 1.0
        second.backward()
        first.backward()
        step(model, optimizer, manager)
        models.append(model)
    assert_same_parameters(*models)
    model = gpt()
    manager = gradient_cache.create_gradient_cache(model, **STREAMED)
    first = model(*data[0])[1] * 1.0
    model(*data[1])[1].backward()
    manager.remove_hooks()
    with pytest.raises(RuntimeError, match="before remove_hooks"):
        first.backward()


def test_a_backward_naming_every_weight_under_a_compute_dtype_is_the_whole_backward() -> None:
    """On the CPU with compute_dtype=torch.bfloat16 a block weight moves between dtypes
    (fp32 master, bf16 in use), which resets its accumulation node as a device change
    does: ``backward(inputs=model.parameters())`` named nodes the graph never used and
    trained only the block kept for backward. Now the weights are guarded at rest there
    too, and the call trains what ``backward()`` trains, bit for bit."""
    data = batches(2)
    models = []
    for named in (False, True):
        model = gpt()
        optimizer = adamw_two_groups(model)
        manager = gradient_cache.create_gradient_cache(
            model, **STREAMED, compute_dtype=torch.bfloat16
        )
        for tokens, targets in data:
            loss = model(tokens, targets)[1]
            loss.backward(inputs=list(model.parameters()) if named else None)
            step(model, optimizer, manager)
        models.append(model)
    assert_same_parameters(*models)
    assert not torch.equal(models[1].blocks[0].mlp.fc.weight, gpt().blocks[0].mlp.fc.weight)
