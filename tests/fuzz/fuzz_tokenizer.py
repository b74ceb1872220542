"""Tokenizer.encode/decode and the streaming decoder on arbitrary strings
and id lists, for byte-level BPE tokenizers: the one in tests/data
(SmolLM2's pre-tokenizer and decoder over a small vocabulary), and any
tokenizer.json named in FASTLLM_FUZZ_TOKENIZERS (colon separated), such as
SmolLM2's or Qwen's own.

The first byte picks the tokenizer and the mode; the rest is the text
(UTF-8, invalid bytes as lone surrogates) or the ids (little-endian int32).
Where HF tokenizers is installed, ids and text must equal its own; the
streaming decoder must give what decode gives."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _target import ROOT, instrumented, main  # noqa: E402

with instrumented():
    import numpy as np
    from fastllm.tokenizer import Tokenizer, TokenizerError

PATHS = [os.path.join(ROOT, "tests", "data", "tiny-llama")]
PATHS += [p for p in os.environ.get("FASTLLM_FUZZ_TOKENIZERS", "").split(":") if p]
TOKENIZERS = [Tokenizer.from_pretrained(p) if os.path.isdir(p) else Tokenizer.from_file(p) for p in PATHS]
try:
    import tokenizers
    ORACLES = [tokenizers.Tokenizer.from_file(os.path.join(p, "tokenizer.json") if os.path.isdir(p) else p)
               for p in PATHS]
except ImportError:
    ORACLES = [None] * len(PATHS)


def TestOneInput(data: bytes):
    if not data:
        return
    tok, oracle = TOKENIZERS[data[0] % len(TOKENIZERS)], ORACLES[data[0] % len(TOKENIZERS)]
    mode = (data[0] // len(TOKENIZERS)) % 4
    rest = data[1:]
    if mode < 2:
        text = rest.decode("utf-8", "surrogateescape")
        try:
            ids = tok.encode(text, add_special_tokens=bool(mode))
        except TokenizerError:
            assert any(0xD800 <= ord(c) <= 0xDFFF for c in text)
            return
        if oracle is not None:
            assert ids == oracle.encode(text, add_special_tokens=bool(mode)).ids, (text, ids)
        return
    ids = np.frombuffer(rest[:len(rest) // 4 * 4], dtype="<i4").tolist()
    if mode == 2:
        text = tok.decode(ids, skip_special_tokens=True)
        if oracle is not None:
            known = [i for i in ids if 0 <= i < oracle.get_vocab_size(with_added_tokens=True)]
            assert text == oracle.decode(known, skip_special_tokens=True), (ids, text)
    else:
        decoder = tok.incremental_decoder(skip_special_tokens=False)
        text = "".join(decoder.add(i) for i in ids) + decoder.flush()
        assert text == tok.decode(ids), (ids, text)


if __name__ == "__main__":
    main(TestOneInput)
