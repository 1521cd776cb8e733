"""The one C extension (everything else is configured in pyproject.toml): fused row loops for R_1 and R_inf.

Installing from source therefore needs a C compiler (gcc or clang); see shuffledp/mechanisms/_ldp_kernels.c for why.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shuffledp.mechanisms._ldp_kernels",
            sources=["shuffledp/mechanisms/_ldp_kernels.c"],
            extra_compile_args=["-O3", "-Wno-psabi"],  # no -ffast-math: the kernels must see NaN and inf
        )
    ]
)
