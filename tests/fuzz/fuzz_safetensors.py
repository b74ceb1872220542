"""Fuzz the safetensors reader and the weight loader behind it.

Each input is written as model.safetensors beside a fixed tiny config and
loaded as fastllm loads a model (load_weights, in f32 and bf16), after
every tensor has been read both as a copy and as a memory-mapped view.
A clear ModelFileError is the expected outcome of a bad file; any other
exception, a crash, a hang or unbounded memory is a bug.

    python tests/fuzz/fuzz_safetensors.py CORPUS_COPY -runs=1000000 -rss_limit_mb=2048 -timeout=10
"""
import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _target import instrumented, main  # noqa: E402
from file_seeds import TINY_CONFIG  # noqa: E402

with instrumented():
    from fastllm.spec.config import ModelConfig
    from fastllm.spec.errors import ModelFileError
    from fastllm.formats.safetensors import Checkpoint
    from fastllm.load.weights import load_weights

_TMP = Path(tempfile.mkdtemp(prefix="fuzz-st-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
atexit.register(shutil.rmtree, _TMP, True)
(_TMP / "config.json").write_text(json.dumps(TINY_CONFIG))
_CFG = ModelConfig.from_dict(TINY_CONFIG, _TMP / "config.json")


def TestOneInput(data: bytes) -> None:
    (_TMP / "model.safetensors").write_bytes(data)
    try:
        ck = Checkpoint(_TMP)
        for f in ck.files.values():
            for name in f.keys():
                f.read(name)
                f.raw(name)
    except ModelFileError:
        return
    for bf16 in (False, True):
        try:
            load_weights(_CFG, _TMP, bf16=bf16)
        except ModelFileError:
            pass


if __name__ == "__main__":
    main(TestOneInput, instrument_all=True)
