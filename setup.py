"""The one compiled part: the int8 codec's CPU kernels (`gradient_cache/codecs/_int8_cpu.c`).

Optional: where it does not build (no C compiler, no Python headers) the package installs
without it and the codec runs its eager PyTorch path, the same bytes more slowly.
Everything else is declared in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

# GCC and Clang: optimise, and never fuse a multiply and an add (an FMA rounds once, the
# eager path twice: the bytes must match).
FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-math-errno"]

setup(
    ext_modules=[
        Extension(
            "gradient_cache.codecs._int8_cpu",
            sources=["gradient_cache/codecs/_int8_cpu.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
