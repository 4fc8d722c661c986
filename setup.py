"""Builds spec-cli's C++ CPU kernels (spec_cli/model/kernels/kernels.cpp) during `pip install`; metadata is in pyproject.toml.

The library is plain C ABI loaded with ctypes (no Python or torch headers, so no build-time torch). It is optional:
without a compiler the install still succeeds and spec-cli falls back to float32 weights with a warning.
"""

import platform

from setuptools import Extension, setup

# No -ffast-math and no FMA contraction: the kernels' batch invariance rests on the compiler keeping the written
# order of every float operation. AVX2 code is compiled per function (target attributes) and chosen at run time.
flags = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-pthread"]
if platform.machine() in ("x86_64", "AMD64"):
    flags.append("-mtune=generic")

setup(
    ext_modules=[
        Extension(
            "spec_cli.model.kernels._kernels",
            sources=["spec_cli/model/kernels/kernels.cpp"],
            depends=["spec_cli/model/kernels/x8_kernels.h"],
            extra_compile_args=flags,
            extra_link_args=["-pthread"],
            language="c++",
            optional=True,
        )
    ]
)
