"""Build the C run loop (csrc/) and its Cython wrappers.

The C core is compiled with -O3 and OpenMP but never for the build machine's CPU:
SIMD paths are chosen at run time by CPU feature detection, so one wheel is
fast on every x86-64 machine.

OpenMP, per compiler:
  - GCC / LLVM clang: -fopenmp.
  - Apple clang (macOS): -Xpreprocessor -fopenmp against libomp, found in
    $FASTLLM_LIBOMP_PREFIX, `brew --prefix libomp`, /opt/homebrew/opt/libomp
    or /usr/local/opt/libomp.
  - MSVC: /openmp (OpenMP 2.0, which is all the C core uses).
Each candidate is tried on a small test program; when none works the core is
built without OpenMP (single-threaded, same results) and a warning says so.
FASTLLM_NO_OPENMP=1 forces that build; FASTLLM_REQUIRE_OPENMP=1 makes a
missing OpenMP an error instead (the wheel builds set it).
"""
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OMP_TEST = r"""
#include <omp.h>
int fastllm_omp_probe(void) {
    int n = 0;
#pragma omp parallel reduction(+:n)
    n += omp_get_thread_num() >= 0;
    return n + omp_get_max_threads();
}
"""


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _libomp_prefixes():
    """Where libomp may live on macOS, most specific first."""
    prefixes = []
    if os.environ.get("FASTLLM_LIBOMP_PREFIX"):
        prefixes.append(os.environ["FASTLLM_LIBOMP_PREFIX"])
    brew = shutil.which("brew")
    if brew:
        try:
            out = subprocess.run([brew, "--prefix", "libomp"], capture_output=True,
                                 text=True, timeout=60)
            if out.returncode == 0 and out.stdout.strip():
                prefixes.append(out.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    prefixes += ["/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"]
    return [p for p in dict.fromkeys(prefixes)
            if os.path.exists(os.path.join(p, "include", "omp.h"))]


def _openmp_candidates(compiler_type):
    """(description, compile args, link args) to try, in order."""
    if compiler_type == "msvc":
        return [("/openmp", ["/openmp"], [])]
    cands = [("-fopenmp", ["-fopenmp"], ["-fopenmp"])]
    if sys.platform == "darwin":
        for p in _libomp_prefixes():
            cands.append((f"libomp in {p}",
                          ["-Xpreprocessor", "-fopenmp", "-I" + os.path.join(p, "include")],
                          ["-L" + os.path.join(p, "lib"), "-lomp"]))
    return cands


def _compiles(compiler, cflags, ldflags):
    """Whether a small OpenMP program compiles and links as a shared library."""
    tmp = tempfile.mkdtemp(prefix="fastllm-omp-")
    try:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(OMP_TEST)
        objs = compiler.compile([src], output_dir=tmp, extra_postargs=cflags)
        compiler.link_shared_object(objs, os.path.join(tmp, "probe" + (".dll" if os.name == "nt" else ".so")),
                                    extra_postargs=ldflags)
        return True
    except Exception:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _no_rpath(cmd):
    """Drop -Wl,-rpath options (e.g. pyenv's LDFLAGS put one into the Python
    interpreter's LDSHARED, which then ends up as a RUNPATH into the build
    machine's Python in every extension)."""
    out, skip = [], False
    for arg in cmd:
        if skip:
            skip = False
            continue
        if arg.startswith(("-Wl,-rpath", "-Wl,--enable-new-dtags,-rpath", "-Wl,-R")):
            continue
        if arg in ("-rpath", "-R"):
            skip = True
            continue
        out.append(arg)
    return out


class BuildExt(build_ext):
    def build_extensions(self):
        ctype = self.compiler.compiler_type
        if ctype != "msvc":
            for attr in ("linker_so", "linker_so_cxx"):
                if getattr(self.compiler, attr, None):
                    self.compiler.set_executables(**{attr: _no_rpath(getattr(self.compiler, attr))})

        omp_c, omp_l, how = [], [], None
        if _env_flag("FASTLLM_NO_OPENMP"):
            how = "disabled by FASTLLM_NO_OPENMP"
        else:
            for desc, cflags, ldflags in _openmp_candidates(ctype):
                if ctype == "msvc" or _compiles(self.compiler, cflags, ldflags):
                    omp_c, omp_l, how = cflags, ldflags, desc
                    break
            if not omp_c:
                msg = ("fastllm: no working OpenMP found for this compiler; building the C core "
                       "single-threaded (on macOS: brew install libomp, or set FASTLLM_LIBOMP_PREFIX)")
                if _env_flag("FASTLLM_REQUIRE_OPENMP"):
                    raise RuntimeError(msg + "; FASTLLM_REQUIRE_OPENMP is set")
                print("WARNING: " + msg, file=sys.stderr)
                how = "not found"
        print(f"fastllm: OpenMP: {how}", file=sys.stderr)

        for ext in self.extensions:
            if ctype == "msvc":
                ext.extra_compile_args += ["/O2", "/fp:precise"] + omp_c
            else:
                # -g0 after Python's own CFLAGS (which carry -g): no debug info.
                ext.extra_compile_args += ["-O3", "-g0", "-fno-fast-math",
                                           "-ffp-contract=off", "-std=gnu11"] + omp_c
                if not omp_c:
                    ext.extra_compile_args.append("-Wno-unknown-pragmas")
                # expf, sqrtf, log1pf: name libm rather than rely on the
                # interpreter having loaded it (and let auditwheel see it).
                if sys.platform.startswith("linux"):
                    ext.libraries = list(ext.libraries or []) + ["m"]
            ext.extra_link_args += omp_l
        if ctype != "msvc":
            _strict_overflow_in_csrc(self.compiler)
        super().build_extensions()


def _strict_overflow_in_csrc(compiler):
    """Compile csrc/ with -fno-wrapv after Python's CFLAGS, which carry
    -fwrapv (signed overflow wraps) for CPython's own code. Under it GCC may
    not treat the int index arithmetic of the kernels' inner loops as plain
    counting, and a Q6_K decode ran 25-35% slower. The C core never relies on
    signed overflow (its standalone test, tests/test_c_core.py, builds it
    without -fwrapv); the Cython modules keep Python's flags."""
    compile_one = getattr(compiler, "_compile", None)
    if compile_one is None:   # a distutils without the per-file hook: Python's flags, slower kernels
        print("WARNING: fastllm: csrc/ is built with Python's -fwrapv (slower kernels)", file=sys.stderr)
        return

    def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
        if os.path.basename(os.path.dirname(os.path.abspath(src))) == "csrc":
            extra_postargs = list(extra_postargs) + ["-fno-wrapv"]
        return compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)

    compiler._compile = _compile


csrc = [os.path.join("csrc", f) for f in sorted(os.listdir("csrc"))
        if f.endswith(".c") and not f.startswith("test_")]

extensions = [
    Extension(
        "fastllm.core._core",
        sources=["src/fastllm/core/_core.pyx"] + csrc,
        include_dirs=["csrc", np.get_include()],
        depends=[os.path.join("csrc", f) for f in sorted(os.listdir("csrc")) if f.endswith(".h")],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    Extension("fastllm.tokenizer._bpe", sources=["src/fastllm/tokenizer/_bpe.pyx"]),
]

setup(
    ext_modules=cythonize(extensions, language_level=3, include_path=["src"],
                          compiler_directives={"boundscheck": False,
                                               "wraparound": False}),
    cmdclass={"build_ext": BuildExt},
)
