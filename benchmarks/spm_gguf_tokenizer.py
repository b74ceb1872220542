"""SentencePiece GGUF vocabularies: llama.cpp's own tokenizer against
fastllm's rebuilt tokenizer.json, oracles.llama_spm and `sentencepiece`.

    LLAMA_LIB=/path/to/libllama.so python benchmarks/spm_gguf_tokenizer.py [n_strings]

For every tests/data/spm-gguf/*.gguf it loads the vocabulary into
llama.cpp (vocab_only, through ctypes), tokenizes oracles.spm_vocabs.strings
with add_special and parse_special, and counts the strings where
  * fastllm's tokenizer, from the tokenizer.json convert_gguf writes,
  * oracles.llama_spm (the Python replay of llama.cpp the tests use),
  * sentencepiece on the .model the GGUF was made from (its segments
    between special tokens encoded one by one, as llama.cpp cuts them),
give other ids than llama.cpp. CI has no llama.cpp, so this is not a test.
"""
import ctypes
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

import sentencepiece as spm  # noqa: E402

from fastllm.formats.gguf_tensors import read_contents  # noqa: E402
from fastllm.formats.gguf_tokenizer import tokenizer_files  # noqa: E402
from fastllm.tokenizer import Tokenizer  # noqa: E402
from oracles import spm_vocabs  # noqa: E402
from oracles.llama_spm import LlamaSpm  # noqa: E402

DATA = ROOT / "tests" / "data" / "spm-gguf"


class ModelParams(ctypes.Structure):
    # struct llama_model_params of llama.h (this llama.cpp's version)
    _fields_ = [("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
                ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int), ("load_mode", ctypes.c_int),
                ("lazy_mode", ctypes.c_int), ("main_gpu", ctypes.c_int32), ("tensor_split", ctypes.c_void_p),
                ("progress_callback", ctypes.c_void_p), ("progress_callback_user_data", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("vocab_only", ctypes.c_bool),
                ("check_tensors", ctypes.c_bool), ("use_extra_bufts", ctypes.c_bool),
                ("no_host", ctypes.c_bool), ("no_alloc", ctypes.c_bool), ("load_mtp", ctypes.c_bool)]


def llama_library(path):
    lib = ctypes.CDLL(path)
    lib.llama_model_default_params.restype = ModelParams
    lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, ModelParams]
    lib.llama_model_load_from_file.restype = ctypes.c_void_p
    lib.llama_model_get_vocab.argtypes = [ctypes.c_void_p]
    lib.llama_model_get_vocab.restype = ctypes.c_void_p
    lib.llama_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                   ctypes.POINTER(ctypes.c_int32), ctypes.c_int32, ctypes.c_bool, ctypes.c_bool]
    lib.llama_tokenize.restype = ctypes.c_int32
    lib.llama_backend_init()
    return lib


def llama_tokenizer(lib, path, add_special=True):
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    vocab = lib.llama_model_get_vocab(model)

    def encode(text):
        data = text.encode("utf-8")
        buf = (ctypes.c_int32 * (len(data) + 8))()
        n = lib.llama_tokenize(vocab, data, len(data), buf, len(buf), add_special, True)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed on {text!r}")
        return list(buf[:n])
    return encode


def sentencepiece_segments(sp, specials, ids, bos):
    """sentencepiece on the stretches between special tokens, as llama.cpp
    cuts the text before tokenizing."""
    oracle = LlamaSpm([], [], [])
    oracle.specials = sorted(specials, key=len, reverse=True)
    oracle.ids = ids

    def encode(text):
        out = [bos]
        for frag, token in oracle._fragments(text):
            out.extend([token] if token is not None else sp.encode(frag))
        return out
    return encode


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    lib = llama_library(os.environ["LLAMA_LIB"])
    texts = spm_vocabs.strings(n)
    for path in sorted(DATA.glob("*.gguf")):
        md = read_contents(path).metadata
        tok_json, _ = tokenizer_files(md, path)
        ours = Tokenizer.from_str(json.dumps(tok_json))
        replay = LlamaSpm.from_metadata(md)
        sp = spm.SentencePieceProcessor(model_file=str(path.with_suffix(".model")))
        by_sp = sentencepiece_segments(sp, replay.specials, replay.ids, md["tokenizer.ggml.bos_token_id"])
        llama = llama_tokenizer(lib, path)
        wrong = {"fastllm": 0, "oracles.llama_spm": 0, "sentencepiece": 0}
        aborts = 0
        for text in texts:
            try:
                replayed = replay.encode(text)
            except KeyError:
                # A character with neither a token nor byte tokens: llama.cpp
                # throws std::out_of_range out of llama_tokenize and the
                # process ends, so it is not asked.
                aborts += 1
                continue
            want = llama(text)
            wrong["fastllm"] += ours.encode(text) != want
            wrong["oracles.llama_spm"] += replayed != want
            wrong["sentencepiece"] += by_sp(text) != want
        print(f"{path.name}: {len(texts) - aborts} strings ({aborts} more that llama.cpp cannot tokenize); "
              "differing from llama.cpp: " + ", ".join(f"{k} {v}" for k, v in wrong.items()))


if __name__ == "__main__":
    main()
