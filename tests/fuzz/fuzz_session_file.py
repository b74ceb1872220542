"""Fuzz the session-file reader (Session.load_file, the server's prompt
cache on disk): each input is a session file of a tiny GGUF model, which
load_file must either take (and then the session runs on from it) or
refuse with a ModelFileError naming the file, leaving the session usable.
Nothing else is acceptable: another exception, a crash, a hang.

Inputs whose header byte 63 (padding, read by nothing) is odd are first
"resealed", as in fuzz_pack_cache.py: their checksums recomputed, so that
mutations reach the manifest (the tokens, the checkpoints) and the arrays,
which the checksums would otherwise turn away first.

The file key is fixed, so that the seeds stay valid while the code changes.

    python tests/fuzz/fuzz_session_file.py CORPUS_COPY -runs=100000 -rss_limit_mb=2048 -timeout=10
"""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _target import instrumented, main  # noqa: E402

_TMP = Path(tempfile.mkdtemp(prefix="fuzz-session-file-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
atexit.register(shutil.rmtree, _TMP, True)
os.environ["FASTLLM_HOME"] = str(_TMP / "home")

with instrumented():
    from fastllm import Model
    from fastllm.generate import session_file
    from fastllm.spec.errors import ModelFileError

import file_seeds  # noqa: E402
from fuzz_pack_cache import reseal  # noqa: E402

_SOURCE = _TMP / "tiny.gguf"
_PATH = _TMP / "input.flmsession"
KEY = {"kind": "session", "format": session_file.FORMAT, "fuzz": "tiny-f32"}


def _setup():
    _SOURCE.write_bytes(file_seeds.tiny_gguf(lambda name: None))
    return Model.from_pretrained(_SOURCE, n_ctx=64, threads=1, pack_cache=False)


_MODEL = _setup()


def TestOneInput(data: bytes) -> None:
    if len(data) >= 64 and data[63] & 1:
        data = reseal(data)
    if _PATH.exists():
        _PATH.chmod(0o644)
    _PATH.write_bytes(data)
    session = _MODEL.new_session()
    try:
        session.load_file(_PATH, KEY)
    except ModelFileError as e:
        assert str(_PATH) in str(e), e
    # loaded or not, the session runs on
    held = list(session.tokens)
    if len(held) < session.n_ctx:
        session.prefill(held + [1])
    session.reset()
    session.prefill([1, 2, 3])


def seeds() -> dict:
    """A session file of 20 tokens, the same to be resealed, one cut short,
    and one of 60 tokens with a reply."""
    out = {}
    for name, n in (("tiny-20", 20), ("tiny-60", 60)):
        s = _MODEL.new_session()
        s.prefill([(i * 7) % 13 + 1 for i in range(n)])
        path = _TMP / f"{name}.flmsession"
        s.save_file(path, KEY)
        out[name] = path.read_bytes()
    resealed = bytearray(out["tiny-20"])
    resealed[63] |= 1
    out["tiny-20-resealed"] = bytes(resealed)
    out["tiny-20-cut"] = out["tiny-20"][:len(out["tiny-20"]) // 2]
    return out


if __name__ == "__main__":
    main(TestOneInput, instrument_all=True)
