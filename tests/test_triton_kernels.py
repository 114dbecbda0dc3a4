"""The codecs' Triton kernels (`codecs/int8_triton.py`, `codecs/block_triton.py`), the path
CUDA tensors take: run on the CPU through Triton's interpreter (the eager path's bytes,
draws and decodes) and compiled for a Hopper GPU (the rounding in the PTX). And the
package without Triton: the eager path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_triton_kernels_give_the_eager_paths_bytes() -> None:
    """int8 and the block codes (q1-q4 stochastic, sign; rotated or not): fp32 and bf16
    gradients over several noise windows and packing runs, a seed past 2^63, NaN and inf
    blocks, one entry. And first, in the same process before Triton loads, the package
    where Triton is absent: the eager path."""
    result = subprocess.run(
        [sys.executable, "tests/triton_interpreted.py"],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    absent, *cases = [json.loads(line) for line in result.stdout.splitlines()]
    assert absent["fused device types"] == [] and absent["error"] < 1 / 64, absent
    assert len(cases) == 12
    for case in cases:
        assert case["scales"] and case["codes"] and case["decoded"], case
        eager_draws, fused_draws = case["draws"]
        assert eager_draws == fused_draws, case  # noise_windows counts what eager draws
    non_finite = [case["non-finite blocks"] for case in cases]
    assert non_finite.count(3) == 2 and non_finite.count(0) == 10  # NaN and inf blocks


def test_a_kernel_triton_cannot_build_falls_back_to_the_eager_path_with_a_warning(
    monkeypatch,
) -> None:
    """An unsupported GPU, a missing C compiler or too old a Triton costs launches, not the
    step: the first launch that fails writes the eager path's bytes, later calls take the
    eager path, and the user is told. A kernel that has run once raises its errors."""
    import pytest
    from triton.compiler.errors import CompilationError

    from gradient_cache.codecs import int8_kernels

    monkeypatch.setattr(int8_kernels, "FUSED_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(int8_kernels, "_BUILT", set())
    ran = []

    def cannot_build() -> None:
        raise CompilationError("", None, "no such instruction on this GPU")

    def no_compiler() -> None:  # what Triton raises building its launcher without cc
        raise RuntimeError("Failed to find C compiler. Please specify via CC")

    for failing in (cannot_build, no_compiler):
        monkeypatch.setattr(int8_kernels, "FUSED_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
        with pytest.warns(RuntimeWarning, match="could not build or launch the codec kernel"):
            int8_kernels.run_fused(("encode",), failing, lambda: ran.append("eager"))
        assert "cuda" not in int8_kernels.FUSED_DEVICE_TYPES  # and "cpu" stays
    assert ran == ["eager", "eager"]

    int8_kernels.run_fused(("encode",), lambda: ran.append("fused"), lambda: None)
    assert ran[-1] == "fused" and ("encode",) in int8_kernels._BUILT

    def faulty() -> None:
        raise ValueError("an error of the call, once the kernel has run")

    with pytest.raises(ValueError, match="of the call"):
        int8_kernels.run_fused(("encode",), faulty, lambda: ran.append("eager"))
    assert ran == ["eager", "eager", "fused"]


def hopper_ptx(kernel, signature: dict[str, str], constexprs: dict[str, int | bool]) -> str:
    """``kernel`` compiled for an H100/H200 (sm_90) on this machine, no GPU needed, with
    the options the launches pass: the PTX, after Triton's lowering and ptxas ran."""
    import triton  # the test extra installs it
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gradient_cache.codecs.int8_triton import OPTIONS

    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=OPTIONS).asm["ptx"]


def test_the_triton_kernels_compile_for_hopper_with_the_eager_paths_rounding() -> None:
    """What the interpreter cannot show: the kernels lower for a GPU, every divide is the
    correctly rounded one (Triton's `/` is approximate there), no multiply and add
    fused into one rounding (PyTorch rounds each), no subnormal flushed to zero."""
    from gradient_cache.codecs import block_triton, int8_triton

    scalars = {"numel": "i64", "seed": "i64", "first_draw": "i64"}
    int8 = {"ROWS": int8_triton.ROWS, "BLOCK": 64, "CHUNK": 1 << 18, "WINDOW": 1 << 18}
    block = {"ROWS": block_triton.ROWS, "CHUNK": 1 << 18, "WINDOW": 1 << 18}
    pointers = {"x_ptr": "*bf16", "codes_ptr": "*u8"}
    encodes = [
        hopper_ptx(
            int8_triton.ENCODE,
            {**pointers, "codes_ptr": "*i8", "scales_ptr": "*fp32", "table_ptr": "*fp32"}
            | {**scalars, "blocks": "i64", "scale_step": "fp32"}
            | dict.fromkeys(int8, "constexpr"),
            int8,
        )
    ]
    for bits, rotate, sign in [(3, True, False), (4, True, False), (1, True, True)]:
        constexprs = {**block, "BITS": bits, "LOW": block_triton.low_bits(bits)}
        constexprs |= {"ROTATE": rotate, "SIGN": sign}
        encodes.append(
            hopper_ptx(
                block_triton.ENCODE,
                {**pointers, "scales_ptr": "*fp32", "signs_ptr": "*fp32", "table_ptr": "*fp32"}
                | {**scalars, "padded": "i64"}
                | dict.fromkeys(constexprs, "constexpr"),
                constexprs,
            )
        )
    decodes = [
        hopper_ptx(
            int8_triton.DECODE,
            {"codes_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": "*fp32", "numel": "i64"}
            | {"ROWS": "constexpr", "BLOCK": "constexpr"},
            {"ROWS": int8_triton.ROWS, "BLOCK": 64},
        ),
        hopper_ptx(
            block_triton.DECODE,
            {"codes_ptr": "*u8", "scales_ptr": "*fp32", "signs_ptr": "*fp32", "out_ptr": "*fp32"}
            | {"numel": "i64", "padded": "i64", "step": "fp32"}
            | dict.fromkeys(["ROWS", "BITS", "LOW", "ROTATE", "CHUNK"], "constexpr"),
            {"ROWS": block_triton.ROWS, "BITS": 3, "LOW": 2, "ROTATE": True, "CHUNK": 1 << 18},
        ),
    ]
    for ptx in encodes[:3]:  # the stochastic roundings divide by the scale
        assert "div.rn.f32" in ptx
    for ptx in encodes + decodes:
        assert "div.full" not in ptx and "div.approx" not in ptx and "fma" not in ptx
        assert ".ftz" not in ptx  # subnormals kept, as PyTorch keeps them
