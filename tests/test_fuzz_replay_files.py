"""Replay the committed corpora of the file-format fuzz targets
(tests/fuzz/fuzz_safetensors.py, fuzz_gguf.py, fuzz_gguf_load.py, fuzz_pack_cache.py,
fuzz_session_file.py) without atheris, so any input that once found a bug keeps being checked."""
import importlib.util
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent / "fuzz"
TARGETS = ("safetensors", "safetensors_header", "gguf", "gguf_load", "pack_cache", "session_file")


def _target(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "atheris", None)   # plain imports, no instrumentation
    monkeypatch.syspath_prepend(str(FUZZ))
    spec = importlib.util.spec_from_file_location(f"fuzz_{name}", FUZZ / f"fuzz_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", TARGETS)
def test_corpus_replays_cleanly(name, monkeypatch):
    target = _target(name, monkeypatch)
    inputs = sorted((FUZZ / "corpus" / name).iterdir())
    assert len(inputs) >= 4, name
    for path in inputs:
        target.TestOneInput(path.read_bytes())   # raises on anything but a clear ModelFileError


def test_safetensors_seeds_are_what_the_seed_builder_makes():
    # The seeds are reproducible (fastllm's own writer); other corpus files
    # are inputs that once found bugs.
    sys.path.insert(0, str(FUZZ))
    try:
        import file_seeds
    finally:
        sys.path.remove(str(FUZZ))
    for key, data in file_seeds.safetensors_seeds().items():
        assert (FUZZ / "corpus" / "safetensors" / key).read_bytes() == data, key
