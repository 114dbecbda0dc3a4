"""Engine parts on their own: buckets, backends, host-memory budget."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import assert_same_parameters, batches, loss_of, make_model, train
from hypothesis import given, settings
from hypothesis import strategies as st

import gradient_cache
from gradient_cache import EngineConfig, HostMemoryError, Ladder
from gradient_cache.codecs import ResidualCodec
from gradient_cache.engine import hostmem, pool
from gradient_cache.engine.backend import CpuBackend
from gradient_cache.engine.bucket import BucketAssembler
from gradient_cache.engine.cuda import CudaBackend
from gradient_cache.engine.factory import build_cuda_backend, parameter_device
from gradient_cache.engine.route import plan_params, planner


def test_bucket_assembler_fills_to_capacity_in_arrival_order() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 5, 40)]
    assembler = BucketAssembler(capacity_bytes=100)
    full = [assembler.add(p, torch.zeros(p.numel())) for p in params]
    assert full[0] is None and full[1] is not None  # 40 B, then 120 B >= 100 B
    assert [p for p, _ in full[1]] == params[:2]
    assert full[2] is None and [p for p, _ in full[3]] == params[2:]
    assert assembler.flush() is None


def test_a_second_gradient_for_a_waiting_parameter_is_added_to_it() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    assembler = BucketAssembler(capacity_bytes=100)
    first, second = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1e-8, 5.0, -0.3])
    expected = first + second  # plain PyTorch's accumulation
    assert assembler.add(param, first) is None and assembler.add(param, second) is None
    [(held, grad)] = assembler.flush()
    assert held is param and torch.equal(grad, expected)


def test_buckets_follow_backward_order_and_launch_during_backward(monkeypatch) -> None:
    model = make_model()
    manager = gradient_cache.create_gradient_cache(model, compression_ratio=1, bucket_size_mb=1e-6)
    pipeline = manager.engine
    launched: list[str] = []
    grads_left: list[int] = []
    original = pipeline._encode

    def spy(param, grad, loss_scale):
        launched.append(pipeline.records[param].name)
        grads_left.append(sum(p.grad is not None for p in model.parameters()))
        return original(param, grad, loss_scale)

    monkeypatch.setattr(pipeline, "_encode", spy)
    tokens, targets = batches(1)[0]
    loss_of(model, tokens, targets).backward()
    assert launched.index("mlp.2.weight") < launched.index("mlp.0.weight")  # backward order
    assert all(left == 0 for left in grads_left)  # each freed as soon as it was ready


def test_the_removed_cpu_worker_thread_option_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"Unknown engine option\(s\) \['cpu_worker_thread'\]"):
        gradient_cache.create_gradient_cache(make_model(), cpu_worker_thread=True)


def fail_on(pipeline, name: str, monkeypatch) -> None:
    """Make the encode of parameter ``name`` raise an out-of-memory error, once."""
    original = pipeline._encode
    state = {"armed": True}

    def encode(param, grad, loss_scale):
        if state["armed"] and pipeline.records[param].name == name:
            state["armed"] = False
            raise torch.OutOfMemoryError("injected: out of memory")
        return original(param, grad, loss_scale)

    monkeypatch.setattr(pipeline, "_encode", encode)


@pytest.mark.parametrize("ratio", [1, 20])
def test_an_encode_failure_at_the_drain_loses_no_gradient(monkeypatch, ratio: int) -> None:
    """Gradients not yet encoded go back to the parameters, whole; the rest stay cached."""
    options = dict(compression_ratio=ratio, min_compress_numel=1, codec=Ladder(selection="exact"))
    plain, reference, failing = make_model(), make_model(), make_model()
    ref_manager = gradient_cache.create_gradient_cache(reference, **options)
    manager = gradient_cache.create_gradient_cache(failing, **options)
    tokens, targets = batches(1)[0]
    for model in (plain, reference):
        loss_of(model, tokens, targets).backward()
    ref_manager.apply_gradients()
    loss_of(failing, tokens, targets).backward()  # one bucket, waiting for the drain
    engine = manager.engine
    waiting = [engine.records[p].name for p in engine.assembler.params()]
    fail_on(engine, waiting[2], monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):
        manager.compress_and_free_gradients()
    given_back = {n for n, p in failing.named_parameters() if p.grad is not None}
    assert given_back == set(waiting[2:])  # the first two were cached
    manager.apply_gradients()
    for name, param in failing.named_parameters():
        expected = plain if name in given_back else reference  # whole, or as cached
        assert torch.equal(param.grad, expected.get_parameter(name).grad), name


def test_an_encode_failure_in_backward_leaves_a_usable_manager(monkeypatch) -> None:
    """Backward raises; the user skips the batch; training then matches plain PyTorch."""
    data = batches(4)
    plain = make_model()
    train(plain, [data[0], *data[2:]])
    cached = make_model()
    manager = gradient_cache.create_gradient_cache(
        cached, compression_ratio=1, bucket_size_mb=0.004
    )
    optimizer = torch.optim.Adam(cached.parameters(), lr=1e-2)
    for i, (tokens, targets) in enumerate(data):
        if i == 1:
            fail_on(manager.engine, "mlp.0.weight", monkeypatch)
            with pytest.raises(torch.OutOfMemoryError):
                loss_of(cached, tokens, targets).backward()
            manager.discard_gradients()
            optimizer.zero_grad()
            continue
        loss_of(cached, tokens, targets).backward()
        manager.apply_gradients()
        optimizer.step()
        optimizer.zero_grad()
    assert_same_parameters(plain, cached)


def test_parameters_on_several_devices_are_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match=r"several devices \['cpu', 'meta'\]"):
        parameter_device(params)


def write_cgroup(root, path: str, files: dict[str, str]) -> None:
    directory = root / path.lstrip("/")
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text + "\n")


def test_cgroup_headroom_is_the_smallest_of_the_process_cgroup_and_its_ancestors(
    tmp_path,
) -> None:
    root = tmp_path / "fs"
    proc = tmp_path / "cgroup"
    proc.write_text("0::/outer/inner\n")
    write_cgroup(root, "/outer", {"memory.max": "1000", "memory.current": "900"})
    write_cgroup(root, "/outer/inner", {"memory.max": "max", "memory.current": "500"})
    assert hostmem.cgroup_headroom_bytes(proc, root) == 100  # the parent's limit binds
    write_cgroup(root, "/outer/inner", {"memory.max": "550", "memory.current": "500"})
    assert hostmem.cgroup_headroom_bytes(proc, root) == 50
    write_cgroup(root, "/outer", {"memory.max": "max", "memory.current": "900"})
    write_cgroup(root, "/outer/inner", {"memory.max": "max", "memory.current": "500"})
    assert hostmem.cgroup_headroom_bytes(proc, root) is None
    assert hostmem.cgroup_headroom_bytes(tmp_path / "absent", root) is None


def test_cgroup_v1_memory_hierarchy(tmp_path) -> None:
    root = tmp_path / "fs"
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpu,cpuacct:/job\n4:memory:/job/step\n")
    limits = {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "5"}
    write_cgroup(root, "/memory/job/step", limits)
    write_cgroup(
        root, "/memory/job", {"memory.limit_in_bytes": "2000", "memory.usage_in_bytes": "1500"}
    )
    assert hostmem.cgroup_headroom_bytes(proc, root) == 500


def test_available_host_bytes_is_capped_by_the_cgroup(monkeypatch) -> None:
    monkeypatch.setattr(hostmem, "cgroup_headroom_bytes", lambda: 123)
    assert hostmem.available_host_bytes() == 123


def test_engine_refuses_to_start_when_the_host_cannot_hold_it(monkeypatch) -> None:
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda: 2**20)
    model = torch.nn.Linear(1024, 1024)
    with pytest.raises(HostMemoryError) as info:
        gradient_cache.create_gradient_cache(
            model, compression_ratio=100, codec="topk", residual_dtype="float32"
        )
    message = str(info.value)
    assert "needs about 8 MiB" in message and "may use 0 MiB" in message  # two residuals
    assert "host_memory_fraction=0.5" in message and "error_feedback=False" in message
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    gradient_cache.create_gradient_cache(
        model, compression_ratio=100, codec="topk", error_feedback=False
    )


def slots(params: list[torch.nn.Parameter], *, ratio: float, **options) -> dict:
    """Each parameter's pool slot, as its route lays it out."""
    config = EngineConfig.from_options(options, compression_ratio=ratio)
    routes = plan_params(params, config, ratio=ratio, selection="exact")
    return {param: route.slot for param, route in routes.items()}


def test_host_pool_lays_out_one_aligned_slot_per_parameter() -> None:
    big, small = torch.nn.Parameter(torch.zeros(100_000)), torch.nn.Parameter(torch.zeros(10))
    layout = slots(
        [big, small], ratio=100, codec="topk", min_compress_numel=1000, residual_dtype="float32"
    )
    host_pool = pool.HostPool(layout, allocate_pinned=None)
    slot, dense = host_pool.slots[big], host_pool.slots[small]
    values, indices = slot.regions
    assert values.numel() == indices.numel() == 4000  # bytes: 1000 fp32 values, int32 indices
    assert slot.residual.dtype == torch.float32 and slot.residual.numel() == 100_000
    assert torch.count_nonzero(slot.residual) == 0  # a new residual is zero
    assert len(dense.regions) == 1 and dense.residual is None and dense.regions[0].numel() == 40
    assert slot.spare_residual.numel() == 100_000
    assert slot.spare_residual.data_ptr() != slot.residual.data_ptr()
    views = (values, indices, slot.residual, slot.spare_residual, dense.regions[0])
    assert all(view.data_ptr() % pool.ALIGN == 0 for view in views)
    # 4000 B of values and of indices, each padded to 4032; 400 kB of residual, twice (the
    # current one and a pending step's); the small one's 40 B padded to 64.
    assert host_pool.needed_bytes == 4032 + 4032 + 2 * 400_000 + 64


@pytest.mark.parametrize(
    ("residual_dtype", "warmup", "spare", "expected"),
    [
        # int8: 100,000 codes padded to 100,032 (whole blocks of 64) + 1,563 fp32 scales;
        # each residual twice: the current one and a pending step's.
        ("int8", False, True, 4032 + 4032 + 2 * (100_032 + 6_272)),
        ("bfloat16", False, True, 4032 + 4032 + 2 * 200_000),
        # keep_previous_residual=False: one residual slot.
        ("int8", False, False, 4032 + 4032 + 100_032 + 6_272),
        # A warm-up sends the first steps dense: the values take the dense size.
        ("int8", True, True, 400_000 + 4032 + 2 * (100_032 + 6_272)),
    ],
)
def test_host_pool_sizes_residual_and_warmup_slots(
    residual_dtype: str, warmup: bool, spare: bool, expected: int
) -> None:
    big = torch.nn.Parameter(torch.zeros(100_000))
    layout = slots(
        [big],
        ratio=100,
        codec="topk",
        min_compress_numel=1000,
        residual_dtype=residual_dtype,
        keep_previous_residual=spare,
        warmup_steps=3 if warmup else 0,
    )
    host_pool = pool.HostPool(layout, allocate_pinned=None)
    assert host_pool.needed_bytes == expected
    assert (host_pool.slots[big].spare_residual is not None) == spare
    residual = host_pool.slots[big].residual
    assert torch.count_nonzero(ResidualCodec(residual_dtype).decode(residual, big.numel())) == 0


def power_of_two_rounding(nbytes: int) -> int:
    """What torch's caching host allocator reserves for a pinned request (its default)."""
    return 1 << max(0, nbytes - 1).bit_length()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    sizes=st.lists(
        st.one_of(st.integers(1, 5000), st.integers(1, 300 * 2**20)), min_size=1, max_size=60
    )
)
def test_slabs_are_powers_of_two_hold_every_region_once_and_never_waste_more(sizes) -> None:
    sizes = [pool.aligned(n) for n in sizes]
    slabs = pool.pack_slabs(sizes)
    placed = sorted(index for _, regions in slabs for index, _ in regions)
    assert placed == list(range(len(sizes)))
    for size, regions in slabs:
        assert power_of_two_rounding(size) == size  # the allocator adds nothing
        spans = sorted((offset, offset + sizes[index]) for index, offset in regions)
        assert all(end <= size for _, end in spans)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    # Never more than one slab of the whole, the allocator's own rounding, would reserve.
    reserved = sum(size for size, _ in slabs)
    assert sum(sizes) <= reserved <= power_of_two_rounding(sum(sizes))


def model_layouts() -> dict[str, dict]:
    """Pool layouts of the test model, the demo's GPT sizes and the planner's 1.3B GPT, at
    ratio 1 (the largest pool) and at the default ratio."""
    from gradient_cache.demo.models import GPT_SIZES, TinyGPT
    from gradient_cache.planner import tensors_of_factory

    models = {"test model": [p.numel() for p in make_model().parameters()]}
    with torch.device("meta"):
        for name, config in GPT_SIZES.items():
            models[f"TinyGPT {name}"] = [p.numel() for p in TinyGPT(config).parameters()]
    models["1.3B GPT"] = tensors_of_factory("examples.plan_gpt:gpt_1b")
    layouts = {}
    for name, numels in models.items():
        params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in numels]
        for ratio in (1, 3):
            layouts[f"{name}, ratio {ratio}"] = slots(params, ratio=ratio)
    return layouts


def test_the_pools_of_real_models_pin_within_two_percent_of_what_they_need() -> None:
    """One slab of the whole would pin up to twice the bytes (the 1.3B GPT's 4.9 GiB lossless
    pool: 8 GiB); the packed slabs reserve at most 2% more than the slots need."""
    for name, layout in model_layouts().items():
        needed = sum(spec.nbytes for spec in layout.values())
        reserved = pool.reserved_bytes(layout)
        assert needed <= reserved <= max(1.02 * needed, needed + pool.SMALL_SLAB), name


def test_a_pool_allocates_what_reserved_bytes_says_and_the_slots_do_not_overlap() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100_000, 3000, 10, 70_000)]
    layout = slots(params, ratio=100, codec="topk", min_compress_numel=1000)
    requests = []

    def allocate(nbytes: int) -> torch.Tensor:
        requests.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    host_pool = pool.HostPool(layout, allocate_pinned=allocate)
    assert sum(map(power_of_two_rounding, requests)) == host_pool.capacity_bytes
    assert host_pool.capacity_bytes == pool.reserved_bytes(layout) >= host_pool.needed_bytes
    views = [
        view
        for slot in host_pool.slots.values()
        for view in (*slot.regions, slot.residual, slot.spare_residual)
        if view is not None
    ]
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert all(view.data_ptr() % pool.ALIGN == 0 for view in views)


def test_the_cuda_backends_host_check_counts_what_the_pool_reserves(monkeypatch) -> None:
    """The budget check sees the slabs' bytes (what gets pinned), not the slots' sum."""
    from stream_checker import FakeCuda, StreamChecker

    from gradient_cache.engine import factory

    checked = []
    monkeypatch.setattr(factory, "check_host_budget", lambda needed, **_: checked.append(needed))
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300_000, 70_000, 10)]
    cuda = FakeCuda(StreamChecker())
    backend = build_cuda_backend(
        params,
        EngineConfig(),
        torch.device("cpu"),
        plan=planner(params, EngineConfig(), ratio=1),
        cuda=cuda,
        allocate=cuda.allocate_pinned,
    )
    assert checked == [backend.pool.capacity_bytes]
    assert backend.pool.capacity_bytes > backend.pool.needed_bytes  # 1.48 MB needs 2 MiB


def test_host_pool_falls_back_to_pageable_memory_with_one_warning() -> None:
    def refuse(nbytes: int) -> torch.Tensor:
        raise RuntimeError("no CUDA driver")

    param = torch.nn.Parameter(torch.zeros(10))
    with pytest.warns(RuntimeWarning, match="could not pin host memory") as record:
        host_pool = pool.HostPool(slots([param], ratio=1), allocate_pinned=refuse)
    assert len(record) == 1 and not host_pool.pinned


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(selection="threshold"), "selection='threshold' is not supported on CUDA"),
        (dict(host_pool_mb=0.001), r"host_pool_mb=0.001 is below the 4.0 MiB"),
    ],
)
def test_cuda_backend_refusals_come_before_touching_cuda(options: dict, match: str) -> None:
    params = [torch.nn.Parameter(torch.zeros(1024, 1024))]
    with pytest.raises(ValueError, match=match):
        config = EngineConfig.from_options(options)  # the ladder's selection, at ratio 3
        plan = planner(params, config, ratio=1)
        build_cuda_backend(params, config, torch.device("cuda"), plan=plan)


def test_auto_selection_depends_on_the_backend() -> None:
    assert CpuBackend.default_selection == "threshold"
    assert CudaBackend.default_selection == "exact"  # torch.topk: no host sync
    manager = gradient_cache.create_gradient_cache(make_model(), compression_ratio=10, codec="topk")
    assert manager.engine.codecs.candidates[0].encoder.selector.method == "threshold"


def test_the_store_refuses_to_hand_out_a_bucket_still_landing() -> None:
    """Host payloads are complete only after the drain: a restore before it is a bug."""
    from gradient_cache.codecs import DensePayload
    from gradient_cache.engine.store import GradientStore

    param = torch.nn.Parameter(torch.zeros(4))
    store = GradientStore()
    store.put({param: DensePayload(torch.ones(4))})
    with pytest.raises(RuntimeError, match="a restore before the drain"):
        store.parts({param})
    store.landed()
    assert [[p for p, _ in part] for part in store.parts({param})] == [[param]]
