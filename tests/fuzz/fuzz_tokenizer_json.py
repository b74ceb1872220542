"""tokenizer.json bytes -> Tokenizer, then a few encodes and decodes with
what was built."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _target import instrumented, main  # noqa: E402

with instrumented():
    from fastllm.spec.errors import ModelFileError
    from fastllm.tokenizer import Tokenizer, TokenizerError

_DIR = tempfile.mkdtemp(prefix="fuzz-tokenizer-json-")
_PATH = os.path.join(_DIR, "tokenizer.json")
TEXTS = ["Hello world", " héllo\n\n wörld 日本語 123 <|im_start|>", "", "  \t"]


def TestOneInput(data: bytes):
    with open(_PATH, "wb") as f:
        f.write(data)
    try:
        tok = Tokenizer.from_file(_PATH)
        tok.validate()
        for text in TEXTS:
            ids = tok.encode(text)
            tok.decode(ids)
            tok.decode(ids, skip_special_tokens=True)
            decoder = tok.incremental_decoder()
            for i in ids:
                decoder.add(i)
            decoder.flush()
        tok.decode(list(range(-2, 40)))
    except (ModelFileError, TokenizerError):
        return


if __name__ == "__main__":
    main(TestOneInput)
