"""Byte-level BPE GGUF pre-tokenizers: llama.cpp's own tokenizer against
fastllm's rebuilt tokenizer.json, per tokenizer.ggml.pre name.

    LLAMA_LIB=/path/to/libllama.so python benchmarks/bpe_gguf_pretokenizers.py [n_strings]

For each name a small vocabulary is trained under the family's HF pipeline
(oracles.bpe_gguf_vocabs), written as a vocabulary-only GGUF, loaded into
llama.cpp (vocab_only, through ctypes) and tokenized without BOS. fastllm
follows the family's HF tokenizer.json; llama.cpp runs adapted regexes and
no normalizer, so the strings where the two differ are counted, and also
those among the strings that NFC leaves unchanged.
"""
import json
import sys
import tempfile
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spm_gguf_tokenizer import llama_library, llama_tokenizer  # noqa: E402  (also sets sys.path)

from fastllm.formats.gguf_tokenizer import tokenizer_files  # noqa: E402
from fastllm.tokenizer import Tokenizer  # noqa: E402
from oracles.bpe_gguf_vocabs import SPECIALS, gguf_keys_of, trained_family_tokenizer, write_vocab_gguf  # noqa: E402
from oracles.tokenizer_strings import EDGE_CASES, corpus  # noqa: E402

NAMES = ["gpt-2", "olmo", "qwen2", "deepseek-r1-qwen", "qwen35", "llama-bpe", "falcon3", "smaug-bpe", "tekken",
         "gpt-4o", "smollm"]


def main():
    import os
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    lib = llama_library(os.environ["LLAMA_LIB"])
    texts = EDGE_CASES + corpus(n - len(EDGE_CASES), seed=11, specials=tuple(SPECIALS))
    with tempfile.TemporaryDirectory() as tmp:
        for pre in NAMES:
            md = gguf_keys_of(json.loads(trained_family_tokenizer(pre).to_str()), pre,
                              **{"tokenizer.ggml.add_bos_token": False})
            path = Path(tmp) / f"{pre}.gguf"
            write_vocab_gguf(path, md)
            tok_json, _ = tokenizer_files(md, path)
            ours = Tokenizer.from_str(json.dumps(tok_json))
            llama = llama_tokenizer(lib, path, add_special=False)
            differ = differ_nfc = n_nfc = 0
            example = None
            for text in texts:
                nfc = unicodedata.normalize("NFC", text) == text
                n_nfc += nfc
                if ours.encode(text, add_special_tokens=False) != llama(text):
                    differ += 1
                    differ_nfc += nfc
                    if example is None or len(text) < len(example):
                        example = text
            print(f"{pre}: differs from llama.cpp on {differ} of {len(texts)} strings "
                  f"({differ_nfc} of the {n_nfc} NFC ones); shortest: {example!r}")


if __name__ == "__main__":
    main()
