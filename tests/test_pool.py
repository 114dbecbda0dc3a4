"""The pinned host pool (engine/pool.py): slot layout, power-of-two slabs, pageable fallback."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import make_model
from hypothesis import given, settings
from hypothesis import strategies as st

from gradient_cache import EngineConfig
from gradient_cache.codecs import ResidualCodec
from gradient_cache.engine import pool
from gradient_cache.engine.route import plan_params


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


def test_host_pool_falls_back_to_pageable_memory_with_one_warning() -> None:
    def refuse(nbytes: int) -> torch.Tensor:
        raise RuntimeError("no CUDA driver")

    param = torch.nn.Parameter(torch.zeros(10))
    with pytest.warns(RuntimeWarning, match="could not pin host memory") as record:
        host_pool = pool.HostPool(slots([param], ratio=1), allocate_pinned=refuse)
    assert len(record) == 1 and not host_pool.pinned


def test_a_failed_pin_makes_only_its_slab_pageable() -> None:
    """The OS refuses the second slab's pinning: that slab is pageable (one warning), the
    first and the third stay pinned, so only copies into the second block the host. A
    relaid pool and the optimizer state's slabs (`allocate_slab`) share the allocator,
    which still knows the pageable slab."""
    calls = []

    def second_fails(nbytes: int) -> torch.Tensor:
        calls.append(nbytes)
        if len(calls) == 2:
            raise RuntimeError("cannot lock more pages")
        return torch.empty(nbytes, dtype=torch.uint8)

    params = [torch.nn.Parameter(torch.zeros(2**18)) for _ in range(2)]  # 1 MiB each
    with pytest.warns(RuntimeWarning, match="could not pin host memory") as record:
        host_pool = pool.HostPool(slots(params, ratio=1), allocate_pinned=second_fails)
        third = host_pool.allocate_slab(4096)
    assert len(record) == 1 and len(calls) == 3
    first, second = (host_pool.slots[p].regions[0] for p in params)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert [host_pool.is_pinned(view) for view in (first, second, third)] == [True, False, True]
    assert not host_pool.pinned  # not every slab: the summary says so
    assert host_pool.relaid(slots(params, ratio=1)).is_pinned(second) is False


def test_relaid_cuts_the_steady_slots_from_the_warmups_slabs() -> None:
    """The warm-up's end allocates nothing: each parameter's steady slot lies at the front of
    its warm-up room, the residuals start again at zero, and no two slots overlap. A layout
    that does not fit (larger than the slabs were cut for) gets slabs of its own."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100_000, 3000, 10)]
    config = EngineConfig.from_options(
        dict(codec="topk", min_compress_numel=1000, warmup_steps=2), compression_ratio=100
    )

    def layout(steps: int) -> dict:
        routes = plan_params(params, config, ratio=100, selection="exact", steps=steps)
        return {param: route.slot for param, route in routes.items()}

    requests = []

    def allocate(nbytes: int) -> torch.Tensor:
        requests.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    warmup = pool.HostPool(layout(0), allocate_pinned=allocate)
    for slot in warmup.slots.values():
        if slot.residual is not None:
            slot.residual.fill_(1.0)
    allocated = list(requests)
    steady = warmup.relaid(layout(2))
    assert requests == allocated  # nothing new pinned
    assert steady.needed_bytes < warmup.needed_bytes
    assert steady.capacity_bytes == warmup.capacity_bytes  # the same slabs, counted once
    assert steady.layout == layout(2) and steady.pinned
    for param in params:
        before, after = warmup.slots[param], steady.slots[param]
        starts = [view.data_ptr() for view in before.regions]
        assert [view.data_ptr() for view in after.regions] == starts
    residuals = [s.residual for s in steady.slots.values() if s.residual is not None]
    assert residuals and all(torch.count_nonzero(r) == 0 for r in residuals)
    views = [
        view
        for slot in steady.slots.values()
        for view in (*slot.regions, slot.residual, slot.spare_residual)
        if view is not None
    ]
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    # Back to a warm-up's room from a pool cut for the steady slots: new slabs.
    small = pool.HostPool(layout(2), allocate_pinned=allocate)
    allocated = list(requests)
    larger = small.relaid(layout(0))
    assert len(requests) > len(allocated) and larger.capacity_bytes > small.capacity_bytes
