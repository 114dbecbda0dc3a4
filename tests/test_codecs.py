"""The codecs on their own: property-based tests over shapes, dtypes and values.

Every codec must give back a gradient of the right size and dtype, let non-finite entries
through (a GradScaler must still see them), stay within its error bound, round without
bias where it says so, and draw only from its own seeded generators.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import gradient_cache
from gradient_cache.codecs import BLOCK_CODECS, LADDER, int8_kernels, make_codec
from gradient_cache.codecs.dither import WINDOW, Dither
from gradient_cache.codecs.int8_kernels import (
    CODEC_CHUNK,  # the block codecs' chunk
    INT8_BLOCK,
    int8_blocks_decode,
    int8_blocks_encode,
)
from gradient_cache.codecs.rotation import ROTATION_BLOCK, rotate_blocks, unrotate_blocks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# No shrinking: a failure is reported as found (shrinking 700-entry tensors takes minutes).
FAST = (Phase.explicit, Phase.reuse, Phase.generate)
STOCHASTIC = [name for name in BLOCK_CODECS if make_codec(name).rounding == "stochastic"]


def codec(name: str, seed: int = 0):
    return make_codec(name, seed=seed)


def roundtrip(name: str, flat: torch.Tensor, seed: int = 0) -> torch.Tensor:
    payload, residual = codec(name, seed).encode(flat, None, loss_scale=None)
    assert residual is None  # no codec here keeps one
    out = torch.empty_like(flat)
    return payload.decode_into(out)


def finite_values(dtype: torch.dtype, *, big: float) -> st.SearchStrategy[float]:
    """Finite floats of ``dtype`` up to ``big`` in magnitude, with zeros and subnormals."""
    big = torch.tensor(min(big, torch.finfo(dtype).max / 2)).item()  # a float32
    return st.one_of(
        st.floats(-big, big, allow_nan=False, allow_infinity=False, width=32),
        st.sampled_from([0.0, -0.0, 1e-42, -3e-45, torch.finfo(dtype).tiny / 4]),
    )


@st.composite
def gradients(draw, *, big: float = 1e4, special: bool = True, headroom: float = 1):
    """Flat gradients of 0-700 entries; finite ones at most ``big`` and the dtype's
    largest value / ``headroom``; a few NaN or inf if ``special``."""
    dtype = draw(st.sampled_from(DTYPES))
    numel = draw(st.integers(0, 700))
    big = min(big, torch.finfo(dtype).max / headroom)
    values = draw(st.lists(finite_values(dtype, big=big), min_size=numel, max_size=numel))
    flat = torch.tensor(values, dtype=torch.float32).to(dtype)
    if special and numel and draw(st.booleans()):
        where = draw(st.lists(st.integers(0, numel - 1), min_size=1, max_size=3))
        flat[where] = torch.tensor(
            draw(st.sampled_from([math.nan, math.inf, -math.inf])), dtype=dtype
        )
    return flat


@pytest.mark.parametrize("name", [*BLOCK_CODECS, "int8", "lossless"])
@settings(max_examples=40, deadline=None, derandomize=True, phases=FAST)
@given(flat=gradients())
def test_decode_has_the_gradients_size_and_dtype_and_keeps_non_finite_entries(name, flat):
    out = roundtrip(name, flat)
    assert out.shape == flat.shape and out.dtype == flat.dtype
    bad = ~torch.isfinite(flat)
    assert not torch.isfinite(out[bad]).any()
    if name == "lossless":
        torch.testing.assert_close(out, flat, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", STOCHASTIC)
@settings(max_examples=40, deadline=None, derandomize=True, phases=FAST)
@given(flat=gradients(big=1e30, special=False, headroom=4 * ROTATION_BLOCK))
def test_each_blocks_error_is_within_its_bound(name, flat):
    """Rounding moves a rotated entry by less than one level step, 2 s / (2**bits - 1), with
    s the block's largest rotated magnitude (at most the block's L2 norm); the rotation is
    orthonormal, so the block's L2 error is at most sqrt(128) steps.

    A decoded entry can be up to 128 times the block's largest: within that of a 16-bit
    dtype's largest value it overflows to inf (a GradScaler then skips the step), so the
    bound is checked below it."""
    bits = make_codec(name).bits
    x = flat.float()
    error = roundtrip(name, flat).float() - x
    pad = -x.numel() % ROTATION_BLOCK
    x_blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, ROTATION_BLOCK)
    e_blocks = torch.nn.functional.pad(error, (0, pad)).view(-1, ROTATION_BLOCK)
    step = 2 * x_blocks.norm(dim=1) / (2**bits - 1)
    # Storing the decoded value in a 16-bit dtype adds up to half an ulp per entry.
    storage = torch.finfo(flat.dtype).eps * x_blocks.abs().amax(dim=1) * ROTATION_BLOCK**0.5
    bound = ROTATION_BLOCK**0.5 * step * (1 + 1e-5) + storage + 1e-30
    assert (e_blocks.norm(dim=1) <= bound).all()


def int8_error_bound(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(|decoded - x|, its bound) per entry: below the block's scale, max|x| / 127, plus
    half an ulp of a 16-bit dtype's stored value and of a subnormal scale's product."""
    x = flat.float()
    error = (roundtrip("int8", flat).float() - x).abs()
    pad = -x.numel() % INT8_BLOCK
    x_blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, INT8_BLOCK)
    scale = x_blocks.abs().amax(dim=1, keepdim=True).expand(-1, INT8_BLOCK) / 127
    storage = torch.finfo(flat.dtype).eps * x_blocks.abs().amax(dim=1, keepdim=True)
    bound = (scale * (1 + 1e-5) + storage + 1e-44).reshape(-1)[: x.numel()]
    return error, bound


@settings(max_examples=40, deadline=None, derandomize=True, phases=FAST)
@given(flat=gradients(big=1e30, special=False))
def test_int8_error_is_below_its_blocks_scale(flat):
    error, bound = int8_error_bound(flat)
    assert (error <= bound).all()


def test_int8_is_exact_to_its_bound_for_subnormal_blocks():
    """A block of subnormals: its scale is subnormal too (1 / scale would overflow)."""
    flat = torch.zeros(INT8_BLOCK)
    flat[:3] = torch.tensor([1e-40, 5e-41, -3e-41])
    error, bound = int8_error_bound(flat)
    assert (error <= bound).all()


class NearlyOne:
    """Noise at its largest, 1 - 2**-24: the rounding then goes up wherever it can."""

    def uniform(self, count: int, device: torch.device) -> torch.Tensor:
        return torch.full((count,), 1 - 2**-24, device=device)


@pytest.mark.parametrize("kernels", [int8_kernels.CPU_KERNELS, None], ids=["compiled", "eager"])
def test_int8_never_flips_the_sign_of_a_blocks_largest_entry(kernels, monkeypatch):
    """max|x| / (max|x| / 127) rounds to just above 127 for some values; with noise near 1
    that floors to 128, which int8 cannot hold: the code must stay 127. On both paths (the
    compiled kernel's AVX2 packing would also saturate at 127; the eager cast wraps)."""
    monkeypatch.setattr(int8_kernels, "CPU_KERNELS", kernels)
    candidates = torch.linspace(1, 2, 10_000)
    largest = candidates[candidates / (candidates / 127) > 127][0]
    x = torch.zeros(INT8_BLOCK)
    x[0] = largest
    decoded = int8_blocks_decode(int8_blocks_encode(x, NearlyOne()), x.numel())
    assert decoded[0] > 0
    assert (decoded[0] - largest).abs() <= largest / 127


@pytest.mark.parametrize("name", [*STOCHASTIC, "int8"])
def test_stochastic_rounding_is_unbiased(name):
    """The mean of 400 encodes of one gradient is within 5 standard errors of it.

    Each entry's rounding error has variance at most step**2 / 4 (step: the level spacing
    of its block); the rotation is orthonormal, so that holds after it too."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, generator=generator) * torch.rand(256, generator=generator)
    if name == "int8":
        step = x.view(-1, 64).abs().amax(dim=1, keepdim=True).expand(-1, 64) / 127
    else:
        levels = 2 ** make_codec(name).bits - 1
        rotated = x.view(-1, ROTATION_BLOCK) @ make_codec(name).rotation_matrix(x.device)
        largest = rotated.abs().amax(dim=1, keepdim=True).expand(-1, ROTATION_BLOCK)
        step = 2 * largest / levels
    quantizer = codec(name)
    draws = 400
    mean = sum(quantizer.encode(x, None, loss_scale=None)[0].kept_values() for _ in range(draws))
    standard_error = step.reshape(-1) / 2 / draws**0.5
    assert ((mean / draws - x).abs() <= 5 * standard_error + 1e-6).all()


@pytest.mark.parametrize("name", ["q4", "int8"])
def test_rounding_is_unbiased_at_every_position_over_many_steps(name):
    """The mean error over 400 encodes, pooled over 512 blocks, at each block's first entry
    (where the rotation gathers a bias all rotated entries share, times sqrt(128)) and over
    all entries, within 4 standard errors of zero. A fixed noise table alone fails this:
    its mean misses 1/2 by about 4e-4, the same at every step."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(512 * ROTATION_BLOCK, generator=generator)
    if name == "int8":
        largest = x.view(-1, INT8_BLOCK).abs().amax(dim=1, keepdim=True)
        step = (largest / 127).expand(-1, INT8_BLOCK).reshape(-1, ROTATION_BLOCK)
    else:
        rotated = x.view(-1, ROTATION_BLOCK) @ make_codec(name).rotation_matrix(x.device)
        largest = rotated.abs().amax(dim=1, keepdim=True).expand(-1, ROTATION_BLOCK)
        step = 2 * largest / (2 ** make_codec(name).bits - 1)
    quantizer = codec(name)
    draws = 400
    total = sum(quantizer.encode(x, None, loss_scale=None)[0].kept_values() for _ in range(draws))
    relative = (total / draws - x).view(-1, ROTATION_BLOCK) / step  # in level steps
    # Each error is at most one step, so its sd is at most 1/2 step per draw.
    for pooled in (relative[:, 0], relative):
        standard_error = 0.5 / (draws * pooled.numel()) ** 0.5
        assert pooled.mean().abs() <= 4 * standard_error, pooled.mean().item()


def test_sign_sends_the_scaled_sign_of_the_rotated_block():
    x = torch.randn(ROTATION_BLOCK, generator=torch.Generator().manual_seed(2))
    rotated = x @ make_codec("sign").rotation_matrix(x.device)
    expected = rotated.sign() * rotated.abs().mean()
    decoded = roundtrip("sign", x) @ make_codec("sign").rotation_matrix(x.device)
    torch.testing.assert_close(decoded, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["int8", "q4"])
def test_a_bf16_gradients_payload_decodes_to_its_bf16_values_whatever_the_output(name):
    """Decoding into an fp32 tensor (faster: no temporary) must not skip the rounding to
    the gradient's dtype that decoding into its own dtype does."""
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(3)).bfloat16()
    payload, _ = make_codec(name).encode(flat, None, loss_scale=None)
    as_bf16 = payload.decode_into(torch.empty(1000, dtype=torch.bfloat16))
    as_fp32 = payload.decode_into(torch.empty(1000))
    assert torch.equal(as_fp32, as_bf16.float())


def test_a_bf16_dense_payload_crosses_in_its_own_bytes_and_widens_after() -> None:
    """A compute dtype's gradient carried in bf16 (`NARROW_FLOATS`): its restore into the
    fp32 gradient moves the bf16 tensor itself (2 bytes an entry: a cross-device copy_
    that converts would cast on the host first and move 4) and widens it, exactly."""
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(4)).bfloat16()
    payload, _ = make_codec("lossless").encode(flat, None, loss_scale=None)
    moved: list[torch.Tensor] = []

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        moved.append(tensor)
        return tensor.clone()

    out = payload.restore_into(torch.empty(1000), to_device)
    assert [t.dtype for t in moved] == [torch.bfloat16]
    assert out.dtype == torch.float32 and torch.equal(out, flat.float())


def test_two_bf16_parts_add_in_plain_pytorchs_order_wherever_read() -> None:
    """A lone bf16 payload followed by a later micro-batch's bf16 gradient keeps both
    (`followed_by`); every reader gets ``fp32(a) + fp32(b)``, and a third gradient ``c`` is
    added as ``(a + b) + c``: plain PyTorch's accumulation order, on values where another
    order gives other bits (1 + 2**-30 rounds to 1 in fp32)."""
    a = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    b = torch.tensor([2.0**-30, -3.0], dtype=torch.bfloat16)
    c = torch.tensor([-1.0, 0.5])
    plain = a.float() + b.float()  # .grad accumulated in fp32, micro-batch by micro-batch
    first, _ = make_codec("lossless").encode(a, None, loss_scale=None)
    joined = first.followed_by(b)
    assert joined is not None and joined.tensors() == [a, b]
    assert first.followed_by(c) is None and joined.followed_by(b) is None  # one part each
    assert joined.nbytes == 8 and joined.placement() == [(0, 0), (0, 4)]  # halves of fp32's
    assert joined.as_gradient() is None
    assert torch.equal(joined.kept_values(), plain)
    assert torch.equal(joined.decode_into(torch.empty(2)), plain)
    moved: list[torch.Tensor] = []

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        moved.append(tensor)
        return tensor.clone()

    assert torch.equal(joined.restore_into(torch.empty(2), to_device), plain)
    assert [t.dtype for t in moved] == [torch.bfloat16, torch.bfloat16]  # 2 bytes each
    third = joined.add_to(c.clone())
    assert torch.equal(third, plain + c) and third[0] == 0.0


@contextlib.contextmanager
def matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# Matrix products: on a GPU each runs in TF32 under set_float32_matmul_precision("high"),
# which the CPU ignores.
PRODUCTS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "mv", "addmv", "dot"})


class MatmulRecorder(TorchDispatchMode):
    """Records every matrix product dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.products: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in PRODUCTS:
            self.products.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_rotation_is_fp32_whatever_the_matmul_precision():
    """Under TF32 matmuls a matmul rotation is orthonormal to about 1e-4 only and decodes
    differently on a GPU: the rotation multiplies no matrices, matches the float64 product
    with its matrix to a few fp32 roundings, inverts to a few roundings, and gives the same
    bits under "high" as under "highest"."""
    x = torch.randn(300, ROTATION_BLOCK, generator=torch.Generator().manual_seed(5))
    x[7, 3] = 1e4  # an outlier: its block's error scales with the block's norm
    with matmul_precision("highest"):
        exact = rotate_blocks(x)
    with matmul_precision("high"), MatmulRecorder() as recorder:
        rotated = rotate_blocks(x)
        back = unrotate_blocks(rotated)
    assert recorder.products == []
    assert torch.equal(rotated, exact)
    # Seven butterfly stages and a scaling: a few roundings of the block's norm.
    tolerance = 4 * torch.finfo(torch.float32).eps * x.norm(dim=1, keepdim=True)
    matrix = make_codec("q4").rotation_matrix(x.device).double()
    assert ((rotated.double() - x.double() @ matrix).abs() <= tolerance).all()
    assert ((back - x).abs() <= tolerance).all()


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_block_codecs_encode_and_decode_alike_whatever_the_matmul_precision(name):
    x = torch.randn(2 * ROTATION_BLOCK + 5, generator=torch.Generator().manual_seed(6))
    with matmul_precision("highest"):
        payload = codec(name).encode(x, None, loss_scale=None)[0]
        exact = payload.decode_into(torch.empty_like(x))
    with matmul_precision("high"), MatmulRecorder() as recorder:
        tf32_payload = codec(name).encode(x, None, loss_scale=None)[0]
        decoded = tf32_payload.decode_into(torch.empty_like(x))
    assert recorder.products == []
    assert torch.equal(tf32_payload.packed, payload.packed)
    assert torch.equal(decoded, exact)


@pytest.mark.parametrize("name", [*BLOCK_CODECS, "int8"])
def test_large_tensors_cross_chunk_boundaries_and_a_seed_fixes_the_result(name):
    """More than one `CODEC_CHUNK`, an odd size: each chunk decodes where it belongs, and
    two codecs with one seed give the same payload."""
    x = torch.randn(CODEC_CHUNK + 333, generator=torch.Generator().manual_seed(3))
    x[CODEC_CHUNK + 5] = 1e3  # an outlier in the last chunk stays in the last chunk
    first, second = (codec(name, seed=7).encode(x, None, loss_scale=None)[0] for _ in range(2))
    assert torch.equal(first.tensors()[0], second.tensors()[0])
    decoded = first.kept_values()
    assert decoded.argmax() == CODEC_CHUNK + 5
    relative = (decoded - x).norm() / x.norm()
    assert relative < {"q4": 0.2, "q3": 0.4, "q2": 0.9, "q1": 3.0, "sign": 1.0, "int8": 0.02}[name]


def test_the_ladder_lists_codecs_from_largest_to_smallest_payload():
    from gradient_cache.codecs import Codecs
    from gradient_cache.engine.config import EngineConfig

    codecs = Codecs.for_options(EngineConfig(), ratio=50, selection="exact")
    sizes = [
        sum(n * d.itemsize for n, d in c.payload_shapes(1 << 20, torch.float32))
        for c in codecs.candidates
    ]
    assert [c.name for c in codecs.candidates] == list(LADDER)
    assert sizes == sorted(sizes, reverse=True)


def test_a_pipelines_dithered_codecs_share_one_noise_table_a_device() -> None:
    """The ladder's int8, q4, q3 and q2 read windows of the same table (a fixed seed): one
    4 MiB table a device for all of them (each held its own), listed once among the
    scratch; another manager's codecs, encoding on their own streams, have their own."""

    def dithers(manager: gradient_cache.GradientCacheHookManager) -> list[Dither]:
        assert manager.engine is not None
        sources = manager.engine.codecs.random_sources().values()
        return [source for source in sources if isinstance(source, Dither)]

    cpu = torch.device("cpu")
    manager = gradient_cache.create_gradient_cache(torch.nn.Linear(4, 4))
    own = dithers(manager)
    assert len(own) == 4
    assert len({id(dither.table(cpu)) for dither in own}) == 1
    assert manager.engine is not None
    scratch = manager.engine.codecs.scratch_tensors()
    assert [t.numel() for t in scratch].count(4 * WINDOW) == 1
    other = dithers(gradient_cache.create_gradient_cache(torch.nn.Linear(4, 4)))
    assert other[0].table(cpu) is not own[0].table(cpu)
    assert torch.equal(other[0].table(cpu), own[0].table(cpu))
