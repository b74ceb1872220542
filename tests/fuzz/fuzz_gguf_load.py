"""Fuzz the native GGUF load: Model.from_pretrained(file.gguf), the path the
default model takes. The file's own tensors go to C as they are (quantized
blocks included) and its tokenizer and config are written into the cache;
then the model runs two tokens and its tokenizer encodes and decodes a text.

A clear ModelFileError (or TokenizerError) is the expected
outcome of a bad file; any other exception, a crash, a hang or unbounded
memory is a bug.

    python tests/fuzz/fuzz_gguf_load.py CORPUS_COPY -runs=1000000 -rss_limit_mb=2048 -timeout=10
"""
import atexit
import contextlib
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _target import instrumented, main  # noqa: E402

with instrumented():
    from fastllm import Model
    from fastllm.spec.errors import ModelFileError
    from fastllm.tokenizer import TokenizerError

_TMP = Path(tempfile.mkdtemp(prefix="fuzz-gguf-load-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
atexit.register(shutil.rmtree, _TMP, True)
_IN = _TMP / "x.gguf"
_HOME = _TMP / "home"
_inputs = 0


@contextlib.contextmanager
def _scratch_cache():
    """FASTLLM_HOME in the scratch folder while one input runs (and emptied
    after it), the caller's own restored: the replay test runs this in
    pytest's process."""
    before = os.environ.get("FASTLLM_HOME")
    os.environ["FASTLLM_HOME"] = str(_HOME)
    try:
        yield
    finally:
        shutil.rmtree(_HOME, ignore_errors=True)
        if before is None:
            del os.environ["FASTLLM_HOME"]
        else:
            os.environ["FASTLLM_HOME"] = before


def _load_and_run(path: Path) -> None:
    # A small context: the file's own context length may ask for half the
    # RAM, which the default (n_ctx=None) grants, with a warning.
    model = Model.from_pretrained(path, n_ctx=8, threads=1)
    model.logits([0, model.config.vocab_size - 1])
    if model.tokenizer is not None:
        model.tokenizer.decode(model.tokenizer.encode("Hello world, <|im_start|> héllo 日本"))


def TestOneInput(data: bytes) -> None:
    global _inputs
    _IN.write_bytes(data)
    # The metadata cache is keyed by path, size and modification time: each
    # input gets a time of its own, so none is served another's metadata.
    _inputs += 1
    os.utime(_IN, ns=(_inputs, _inputs))
    try:
        with _scratch_cache(), contextlib.redirect_stderr(io.StringIO()):   # the cache's line about each new file
            _load_and_run(_IN)
    except (ModelFileError, TokenizerError):
        pass


if __name__ == "__main__":
    main(TestOneInput, instrument_all=True)
