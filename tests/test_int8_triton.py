"""The int8 codec's Triton kernels (`codecs/int8_triton.py`), the path CUDA tensors take,
run on the CPU through Triton's interpreter (the eager path's bytes, draws and decodes)
and compiled for a Hopper GPU (the rounding in the PTX). And the package without Triton:
the eager path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_triton_kernels_give_the_eager_paths_bytes() -> None:
    result = subprocess.run(
        [sys.executable, "tests/int8_triton_interpreted.py"],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    cases = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(cases) == 6
    for case in cases:
        assert case["scales"] and case["codes"] and case["decoded"], case
        eager_draws, fused_draws = case["draws"]
        assert eager_draws == fused_draws, case  # the generator's state after the encode
    assert cases[-1]["non-finite blocks"] == 3  # NaN and inf blocks: a non-finite scale


def test_without_triton_the_int8_codec_takes_the_eager_path() -> None:
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from gradient_cache.codecs import int8_kernels\n"
        "from gradient_cache.codecs.registry import make_codec\n"
        "assert int8_kernels.FUSED_DEVICE_TYPES == frozenset(), int8_kernels.FUSED_DEVICE_TYPES\n"
        "int8_kernels.CPU_KERNELS = None\n"
        "x = torch.randn(1000)\n"
        "payload, _ = make_codec('int8').encode(x, None, loss_scale=None)\n"
        "error = (payload.kept_values() - x).abs().max() / x.abs().max()\n"
        "assert error < 1 / 64, error\n"
        "print('eager')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "eager"


def hopper_ptx(kernel, signature: dict[str, str], constexprs: dict[str, int]) -> str:
    """``kernel`` compiled for an H100/H200 (sm_90) on this machine, no GPU needed: the
    PTX, after Triton's own lowering and ptxas (bundled with Triton) ran."""
    import triton  # the test extra installs it
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def test_the_triton_kernels_compile_for_hopper_with_the_rounding_the_eager_path_has() -> None:
    """What the interpreter cannot show: the kernels lower for a GPU, the divide is the
    correctly rounded one (Triton's `/` is approximate there), and no multiply and add
    fused into one rounding (PyTorch rounds each)."""
    from gradient_cache.codecs import int8_triton

    pointers = {"codes_ptr": "*i8", "scales_ptr": "*fp32"}
    encode = hopper_ptx(
        int8_triton.ENCODE,
        {"x_ptr": "*bf16", **pointers, "table_ptr": "*fp32", "numel": "i64", "blocks": "i64"}
        | {"seed": "i64", "first_draw": "i64", "scale_step": "fp32"}
        | {"ROWS": "constexpr", "BLOCK": "constexpr", "WINDOW": "constexpr"},
        {"ROWS": int8_triton.ROWS, "BLOCK": 64, "WINDOW": 1 << 18},
    )
    assert "div.rn.f32" in encode and "div.full" not in encode and "div.approx" not in encode
    decode = hopper_ptx(
        int8_triton.DECODE,
        {**pointers, "out_ptr": "*fp32", "numel": "i64", "ROWS": "constexpr", "BLOCK": "constexpr"},
        {"ROWS": int8_triton.ROWS, "BLOCK": 64},
    )
    for ptx in (encode, decode):
        assert "fma" not in ptx
