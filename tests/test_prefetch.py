"""How far ahead the kernels ask for the weights they stream is the CPU's
choice, or FASTLLM_PREFETCH's; it changes speed only, never a bit of what
is computed."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.core import _core

DATA = Path(__file__).parent / "data" / "llama-family"
IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]

needs_prefetch = pytest.mark.skipif(_core.stream_prefetch() is None,
                                    reason="this CPU's kernels leave prefetching to the hardware")


def started(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FASTLLM_PREFETCH=value)
    return subprocess.run([sys.executable, "-c", "from fastllm.core import _core; print(_core.stream_prefetch())"],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def restore_prefetch():
    before = _core.stream_prefetch()
    yield
    if before is not None:
        _core.set_stream_prefetch(*before)


@needs_prefetch
def test_the_cpus_choice_is_a_valid_one():
    ahead, level = _core.stream_prefetch()
    assert 0 <= ahead <= 65536 and ahead % 64 == 0 and level in (1, 2)


@needs_prefetch
@pytest.mark.parametrize("value, want", [("512:2", "(512, 2)"), ("0:1", "(0, 1)"), ("4096", "(4096, 1)")])
def test_the_environment_sets_it(value, want):
    out = started(value)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


@pytest.mark.parametrize("value", ["100:1", "1024:3", "-64:1", "65600:2", "fast", "1024:2:1", "1024:",
                                   "99999999999:1", "1024:99999999999"])
def test_a_bad_setting_is_refused_when_fastllm_starts(value):
    out = started(value)
    assert out.returncode != 0
    assert f"FASTLLM_PREFETCH={value!r}" in out.stderr


@needs_prefetch
@pytest.mark.parametrize("name", ["llama2-256-Q4_K_M.gguf", "llama2-256-Q8_0.gguf", "llama2.gguf"])
def test_logits_are_the_same_bits_whatever_the_prefetch(name, restore_prefetch):
    model = Model.from_pretrained(DATA / name, threads=2, n_ctx=64, pack_cache=False)
    want = model.logits(IDS)
    for ahead, level in [(0, 1), (64, 2), (2048, 1), (65536, 2)]:
        _core.set_stream_prefetch(ahead, level)
        assert np.array_equal(model.logits(IDS), want), (ahead, level)


def test_info_shows_it(capsys):
    from fastllm.cli.main import main
    assert main(["info", "-m", str(DATA / "llama2-256-Q4_K_M.gguf"), "--ctx", "64", "--no-cache"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("weight prefetch"))
    prefetch = _core.stream_prefetch()
    assert line.endswith("left to the CPU" if prefetch is None
                         else f"{prefetch[0]} bytes ahead, into L{prefetch[1]}")
