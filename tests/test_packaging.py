"""Packaging checks: the tiny model shipped in tests/data runs from the
installed package, and (when pointed at them) a built wheel and sdist hold
what they should.

    FASTLLM_WHEEL=wheelhouse/fastllm_engine-...whl \
    FASTLLM_SDIST=wheelhouse/fastllm_engine-....tar.gz python -m pytest -q tests/test_packaging.py

Without those variables the wheel and sdist tests are skipped. Needs no
torch, no network and no default model.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TINY = HERE / "data" / "tiny-llama"
TINY_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# Never in a wheel: sources and generated C.
SOURCE_SUFFIXES = (".c", ".h", ".pyx", ".pxd", ".cpp", ".o", ".obj")
# Directories that only exist on a build machine (pyenv, CI containers, home
# directories, temp build folders). A binary naming one leaks the build
# machine's layout, and a RUNPATH into one is a real bug.
BUILD_PATH = re.compile(rb"(/tmp/|/var/tmp/|/home/|/root/|/Users/|/project/|/private/var/"
                        rb"|/\.pyenv/|/work/|[A-Za-z]:\\\\(?:Users|a)\\\\)")


# ------------------------------------------------------------- build flags

def _setup_function(name: str):
    """A top-level function of setup.py, compiled alone (importing setup.py
    would run the build)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"os": os}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), namespace)
    return namespace[name]


def test_csrc_is_compiled_without_wrapv():
    """Python's CFLAGS carry -fwrapv, under which the int8 kernels ran 25-35%
    slower; the C core gets -fno-wrapv after them, the Cython modules keep
    Python's flags. No functional test sees the difference."""
    seen = []

    class Compiler:
        def _compile(self, obj, src, ext, cc_args, extra_postargs, pp_opts):
            seen.append((Path(src).name, extra_postargs))

    compiler = Compiler()
    _setup_function("_strict_overflow_in_csrc")(compiler)
    compiler._compile("quant.o", str(ROOT / "csrc" / "quant.c"), ".c", [], ["-O3"], [])
    compiler._compile("_core.o", str(ROOT / "src" / "fastllm" / "core" / "_core.c"), ".c", [], ["-O3"], [])
    assert seen == [("quant.c", ["-O3", "-fno-wrapv"]), ("_core.c", ["-O3"])]
    build = next(n for n in ast.parse((ROOT / "setup.py").read_text()).body
                 if isinstance(n, ast.ClassDef) and n.name == "BuildExt")
    calls = {c.func.id for c in ast.walk(build) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    assert "_strict_overflow_in_csrc" in calls


# ------------------------------------------------------------- tiny model

@pytest.fixture(scope="module")
def tiny():
    import fastllm
    return fastllm.Model.from_pretrained(TINY, threads=2)


def test_import_leaves_the_server_and_template_libraries_unloaded():
    """`import fastllm` in a script that generates text does not load
    asyncio (with ssl and subprocess) or jinja2: they cost every process
    about 4 MiB and 50 ms, and only serving or a chat template needs them."""
    code = ("import sys, fastllm; "
            "print(' '.join(m for m in ('asyncio', 'ssl', 'jinja2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_tiny_model_files_are_small():
    sizes = {f: (TINY / f).stat().st_size for f in TINY_FILES}
    assert sum(sizes.values()) < 200 * 1024, sizes


def test_tiny_model_generates_deterministically(tiny):
    first = tiny.generate("hello", max_new_tokens=8)
    again = tiny.generate("hello", max_new_tokens=8)
    assert first, "greedy generation returned nothing"
    assert first == again
    assert tiny.last_stats.finish_reason in ("length", "stop")
    # A fresh load with another thread count gives the same tokens.
    import fastllm
    other = fastllm.Model.from_pretrained(TINY, threads=1)
    assert other.generate("hello", max_new_tokens=8) == first


def test_tiny_tokenizer_round_trips(tiny):
    text = "hello world, the quick brown fox"
    ids = tiny.tokenizer.encode(text)
    assert len(ids) < len(text.encode())      # the merges are used
    assert tiny.tokenizer.decode(ids) == text
    assert max(ids) < tiny.config.vocab_size


def test_tiny_model_matches_generator():
    """The files in tests/data are what make_tiny_llama.py writes."""
    if not (HERE / "data" / "make_tiny_llama.py").exists():
        pytest.skip("generator not present")
    import importlib.util
    import json
    import tempfile
    spec = importlib.util.spec_from_file_location("make_tiny_llama", HERE / "data" / "make_tiny_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with tempfile.TemporaryDirectory() as d:
        mod.main(Path(d))
        for f in TINY_FILES:
            new, old = (Path(d) / f).read_bytes(), (TINY / f).read_bytes()
            if f.endswith(".json"):
                assert json.loads(new) == json.loads(old), f
            else:
                assert new == old, f


# ------------------------------------------------------------------ wheel

def _built(variable):
    """The built wheel or sdist that the environment variable names; the
    test is skipped when it is unset."""
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"{variable} is not set")
    path = Path(path)
    assert path.is_file(), f"{variable}={path} is not a file"
    return path


def _wheel():
    return _built("FASTLLM_WHEEL")


def _is_binary(name: str) -> bool:
    return name.endswith((".so", ".pyd", ".dylib", ".dll")) or ".so." in name


def test_wheel_holds_no_sources():
    with zipfile.ZipFile(_wheel()) as z:
        names = z.namelist()
    bad = [n for n in names if n.endswith(SOURCE_SUFFIXES)]
    assert not bad, f"sources in the wheel: {bad}"
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "csrc/", "oracles/"))]
    exts = [n for n in names if n.startswith("fastllm/") and n.rsplit("/", 1)[1].startswith("_") and _is_binary(n)]
    assert {n.rsplit("/", 1)[1].split(".")[0] for n in exts} == {"_core", "_bpe"}, exts
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)
    assert any(n.endswith("LICENSE") for n in names), "no LICENSE in the wheel's dist-info"


def test_wheel_holds_every_module():
    """Subpackages (fastllm.tokenizer) are listed in pyproject.toml by name:
    one left out there would be missing here."""
    with zipfile.ZipFile(_wheel()) as z:
        names = set(z.namelist())
    src = ROOT / "src"
    missing = [f.relative_to(src).as_posix() for f in src.glob("fastllm/**/*.py")
               if f.relative_to(src).as_posix() not in names]
    assert not missing, f"modules missing from the wheel: {missing}"


def test_wheel_binaries_name_no_build_paths():
    """fastllm's own extension modules; libraries the repair tools copy in
    (libgomp, libomp in fastllm/.dylibs, vcomp140) are built by others and
    not checked."""
    with zipfile.ZipFile(_wheel()) as z:
        for n in z.namelist():
            if n.startswith("fastllm/_") and _is_binary(n):
                hit = BUILD_PATH.search(z.read(n))
                assert hit is None, f"{n} contains the build path {hit.group(0)!r}"


def _elf_binaries(tmp_path):
    wheel = _wheel()
    with zipfile.ZipFile(wheel) as z:
        bins = [n for n in z.namelist() if _is_binary(n)]
        z.extractall(tmp_path, bins)
    elf = []
    for n in bins:
        with open(tmp_path / n, "rb") as f:
            if f.read(4) == b"\x7fELF":
                elf.append(tmp_path / n)
    if not elf:
        pytest.skip("no ELF binaries in the wheel (not a Linux wheel)")
    if not shutil.which("readelf"):
        pytest.skip("readelf is not installed")
    return elf


def test_wheel_elf_has_no_foreign_runpath(tmp_path):
    """Only $ORIGIN-relative RPATH/RUNPATH entries (auditwheel's own) allowed."""
    for so in _elf_binaries(tmp_path):
        out = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
        for kind, value in re.findall(r"\((RPATH|RUNPATH)\)\s+Library r\w*path: \[(.*)\]", out):
            for entry in value.split(":"):
                assert entry.startswith("$ORIGIN"), f"{so.name}: {kind} {entry!r}"


def test_wheel_elf_is_stripped(tmp_path):
    for so in _elf_binaries(tmp_path):
        out = subprocess.run(["readelf", "-S", "-W", str(so)], capture_output=True, text=True,
                             check=True).stdout
        debug = sorted(set(re.findall(r"\.debug_\w+", out)))
        assert not debug, f"{so.name} carries debug sections {debug}"
        if so.name.startswith("_"):
            assert ".symtab" not in out, f"{so.name} is not stripped (.symtab)"


# ------------------------------------------------------------------ sdist

SDIST_REQUIRED = (
    "pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE",
    "csrc/fastllm.h", "csrc/kernels.h", "csrc/fastllm.c", "csrc/gemm.c", "csrc/kernels.c",
    "csrc/kernels_generic.c", "csrc/kernels_x86.c", "csrc/kernels_arm64.c", "csrc/test_core.c",
    "src/fastllm/__init__.py", "src/fastllm/core/_core.pyx", "src/fastllm/tokenizer/_bpe.pyx",
    "src/fastllm/core/cfastllm.pxd",
    "tests/conftest.py", "tests/test_packaging.py", "tests/data/smoke.py",
    "tests/data/make_tiny_llama.py",
    *(f"tests/data/tiny-llama/{f}" for f in TINY_FILES),
    "oracles/__init__.py", "oracles/tiny_models.py", "oracles/hf_reference.py",
    "benchmarks/compare.py", "benchmarks/README.md",
)


def _sdist_names():
    path = _built("FASTLLM_SDIST")
    with tarfile.open(path) as t:
        names = [m.name for m in t.getmembers() if m.isfile()]
    tops = {n.split("/", 1)[0] for n in names}
    assert len(tops) == 1, f"the sdist has several top-level folders: {tops}"
    return {n.split("/", 1)[1] for n in names if "/" in n}


def test_sdist_holds_everything_to_build_and_test():
    names = _sdist_names()
    missing = [f for f in SDIST_REQUIRED if f not in names]
    assert not missing, f"missing from the sdist: {missing}"
    # Every C file and header of this checkout, and every test module.
    for pattern in ("csrc/*.c", "csrc/*.h", "tests/test_*.py", "oracles/*.py", "src/fastllm/**/*.py",
                    "src/fastllm/**/*.pyx", "src/fastllm/**/*.pxd"):
        for f in ROOT.glob(pattern):
            rel = f.relative_to(ROOT).as_posix()
            assert rel in names, f"{rel} is in the checkout but not in the sdist"


def test_sdist_holds_no_build_products():
    names = _sdist_names()
    bad = [n for n in names if n.endswith((".so", ".pyd", ".o", ".obj", ".pyc", ".whl"))
           or "__pycache__" in n or n in ("src/fastllm/core/_core.c", "src/fastllm/tokenizer/_bpe.c")
           or n.startswith(("build/", "dist/", "wheelhouse/"))]
    assert not bad, f"build products in the sdist: {bad}"
