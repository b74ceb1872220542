"""Fuzz the safetensors header as JSON values rather than bytes.

Byte mutations seldom turn a field into a list, an object, a float or a
huge integer while keeping the JSON valid, so this target starts from the
tiny checkpoint's header and replaces fields (or whole entries) with values
of every JSON type drawn from the input, then loads the file as
fuzz_safetensors does.

    python tests/fuzz/fuzz_safetensors_header.py CORPUS_COPY -runs=1000000 -rss_limit_mb=2048 -timeout=10
"""
import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzz_safetensors  # noqa: E402  (its config, scratch folder and loading)
from _target import instrumented, main  # noqa: E402
from file_seeds import tiny_tensors  # noqa: E402

with instrumented():
    from fastllm.formats.safetensors import save_file

_SEED = fuzz_safetensors._TMP / "seed.safetensors"
save_file(_SEED, tiny_tensors())
_RAW = _SEED.read_bytes()
_N = struct.unpack("<Q", _RAW[:8])[0]
_HEADER = json.loads(_RAW[8:8 + _N])
_DATA = _RAW[8 + _N:]
_NAMES = sorted(_HEADER)
_FIELDS = ("dtype", "shape", "data_offsets")


class _Bytes:
    """Values drawn from the input, in order; zeros once it runs out."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def int(self, n: int = 1) -> int:
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return int.from_bytes(chunk.ljust(n, b"\0"), "little")

    def value(self, depth: int = 0):
        kind = self.int() % 10
        if kind == 0:
            return self.int(8) - (1 << 63)
        if kind == 1:
            return [self.int(2) for _ in range(self.int() % 5)]
        if kind == 2:
            return struct.unpack("<d", self.int(8).to_bytes(8, "little"))[0] if self.int() % 2 else 2.5
        if kind == 3:
            return bool(self.int() % 2)
        if kind == 4:
            return None
        if kind == 5:
            return ["F32", "BF16", "F16", "I64", "U8", "BOOL", "F64", "X"][self.int() % 8]
        if kind == 6 and depth < 3:
            return [self.value(depth + 1) for _ in range(self.int() % 4)]
        if kind == 7 and depth < 3:
            return {str(self.int()): self.value(depth + 1) for _ in range(self.int() % 3)}
        if kind == 8:
            return 1 << (self.int() % 130)
        return self.int(4)


def TestOneInput(data: bytes) -> None:
    src = _Bytes(data)
    header = json.loads(json.dumps(_HEADER))
    for _ in range(1 + src.int() % 4):
        name = _NAMES[src.int() % len(_NAMES)]
        what = src.int() % 5
        if what < 3 and isinstance(header[name], dict):
            header[name][_FIELDS[what]] = src.value()
        elif what == 3:
            header[name] = src.value()
        else:
            header["__metadata__"] = src.value()
    try:
        blob = json.dumps(header).encode()
    except ValueError:   # NaN or infinity: not JSON, not a file anyone can write
        return
    tail = _DATA[: src.int(4) % (len(_DATA) + 1)] if src.int() % 4 == 0 else _DATA
    fuzz_safetensors.TestOneInput(struct.pack("<Q", len(blob)) + blob + tail)


if __name__ == "__main__":
    main(TestOneInput, instrument_all=True)
