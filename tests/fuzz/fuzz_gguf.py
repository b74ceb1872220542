"""Fuzz the GGUF importer: header, metadata and tensor info, then the
conversion of whatever passes into a model folder.

Each input is written as a .gguf file and converted (convert_gguf) into a
scratch folder. A clear ModelFileError (ConversionError) is the expected
outcome of a bad file; any other exception, a crash, a hang or unbounded
memory is a bug.

    python tests/fuzz/fuzz_gguf.py CORPUS_COPY -runs=1000000 -rss_limit_mb=2048 -timeout=10
"""
import atexit
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

try:
    import atheris
except ImportError:  # the corpus replay test runs without atheris
    atheris = None

with atheris.instrument_imports() if atheris else contextlib.nullcontext():
    from fastllm.spec.errors import ModelFileError
    from fastllm.formats.gguf import convert_gguf

_TMP = Path(tempfile.mkdtemp(prefix="fuzz-gguf-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
atexit.register(shutil.rmtree, _TMP, True)
_IN = _TMP / "x.gguf"
_OUT = _TMP / "out"


def TestOneInput(data: bytes) -> None:
    _IN.write_bytes(data)
    try:
        convert_gguf(_IN, _OUT, progress=False, overwrite=True)
    except ModelFileError:
        pass
    finally:
        shutil.rmtree(_OUT, ignore_errors=True)


if __name__ == "__main__":
    atheris.instrument_all()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
