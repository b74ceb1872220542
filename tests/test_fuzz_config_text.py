"""The committed seed corpora of the config, tokenizer and chat template
fuzz targets (tests/fuzz/), replayed through each target without atheris,
so that what fuzzing once found stays fixed."""
import importlib
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).parent / "fuzz"
TARGETS = ["config", "tokenizer_json", "tokenizer", "chat_template"]


@pytest.mark.parametrize("name", TARGETS)
def test_seed_corpus_replays_cleanly(name):
    sys.path.insert(0, str(FUZZ))
    try:
        target = importlib.import_module(f"fuzz_{name}")
    finally:
        sys.path.remove(str(FUZZ))
    inputs = sorted((FUZZ / "corpus" / name).iterdir())
    assert inputs, f"no seed inputs for {name}"
    for path in inputs:
        target.TestOneInput(path.read_bytes())
