"""Build the C run loop (csrc/) and its Cython wrappers.

The C core is compiled with -O3 and OpenMP but never for the build machine's CPU:
SIMD paths are chosen at run time by CPU feature detection, so one wheel is
fast on every x86-64 machine.
"""
import os
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    def build_extensions(self):
        ctype = self.compiler.compiler_type
        for ext in self.extensions:
            if ctype == "msvc":
                ext.extra_compile_args += ["/O2", "/openmp", "/fp:precise"]
            else:
                ext.extra_compile_args += ["-O3", "-fopenmp", "-fno-fast-math",
                                           "-ffp-contract=off", "-std=gnu11"]
                if sys.platform == "darwin":
                    ext.extra_link_args += ["-lomp"]
                else:
                    ext.extra_link_args += ["-fopenmp"]
        super().build_extensions()


csrc = [os.path.join("csrc", f) for f in sorted(os.listdir("csrc"))
        if f.endswith(".c") and not f.startswith("test_")]

extensions = [
    Extension(
        "fastllm._core",
        sources=["src/fastllm/_core.pyx"] + csrc,
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
]
if os.path.exists("src/fastllm/_bpe.pyx"):
    extensions.append(Extension("fastllm._bpe", sources=["src/fastllm/_bpe.pyx"]))

setup(
    ext_modules=cythonize(extensions, language_level=3, include_path=["src"],
                          compiler_directives={"boundscheck": False,
                                               "wraparound": False}),
    cmdclass={"build_ext": BuildExt},
)
