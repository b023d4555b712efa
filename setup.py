"""Builds the optional C++ extension sicl_fast.ops._C (csrc/, pybind11, OpenMP when the compiler has it).

Everything else is declared in pyproject.toml. If the extension cannot be built (no compiler), the install goes
on without it: sicl_fast then imports and says what is missing when the C++ path is asked for.
"""
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # building without pybind11: the package is pure Python then
    Pybind11Extension = None


class OptionalBuildExt(build_ext):
    """Build the extension if possible; warn instead of failing the install."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure
            print(f"WARNING: sicl_fast.ops._C not built ({exc}); the C++ CPU path will be unavailable", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"WARNING: sicl_fast.ops._C not built ({exc}); the C++ CPU path will be unavailable", file=sys.stderr)


ext_modules = []
sources = (
    sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".cpp")) if os.path.isdir("csrc") else []
)
if Pybind11Extension is not None and sources:
    ext_modules.append(
        Pybind11Extension(
            "sicl_fast.ops._C",  # beside the ops that call it (sicl_fast.ops.cpp_ops), below every floor that uses it
            sources,
            cxx_std=17,
            # -ffp-contract=off: no fused multiply-adds, so the Philox normals are bit-identical to the Triton kernels
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
