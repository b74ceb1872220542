"""Byte-level BPE vocabularies trained here under the HF pipeline a GGUF
pre-tokenizer name stands for, and the tokenizer.ggml.* keys llama.cpp's
converter would write for them.

    tok = trained_family_tokenizer("tekken")          # a tokenizers.Tokenizer
    md = gguf_keys_of(json.loads(tok.to_str()), "tekken")
    write_vocab_gguf("tekken.gguf", md)               # for llama.cpp itself

Used by tests/test_gguf_tokenizer.py and benchmarks/bpe_gguf_pretokenizers.py.
"""
from __future__ import annotations

import json

from fastllm.formats.gguf_tokenizer import (PRE_TOKENIZERS, TOKEN_CONTROL, TOKEN_NORMAL,
                                            TOKEN_USER_DEFINED)
from oracles.tokenizer_strings import corpus, prose_and_code

SPECIALS = ["<|endoftext|>", "<s>", "</s>", "<think>"]


def trained_family_tokenizer(pre: str, vocab_size: int = 1500):
    """A byte-level BPE trained with `tokenizers` under the pipeline pre
    stands for, with SPECIALS[:3] as special tokens and <think> as a plain
    added one."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    p = PRE_TOKENIZERS[pre]
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": p.normalizer, "pre_tokenizer": p.pre_tokenizer, "post_processor": None,
            "decoder": p.decoder,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": p.ignore_merges, "vocab": {}, "merges": []}}
    tok = Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS[:3], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(prose_and_code() + corpus(3000, seed=7), trainer)
    tok.add_tokens(["<think>"])
    return tok


def gguf_keys_of(tok_json: dict, pre: str, **extra) -> dict:
    """The tokenizer.ggml.* keys llama.cpp's converter writes for a
    byte-level BPE tokenizer.json (bos/eos where it has <s> and </s>),
    updated with extra."""
    vocab = tok_json["model"]["vocab"]
    tokens = [None] * (max([*vocab.values(), *(a["id"] for a in tok_json["added_tokens"])]) + 1)
    types = [TOKEN_NORMAL] * len(tokens)
    for text, i in vocab.items():
        tokens[i] = text
    for added in tok_json["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = TOKEN_CONTROL if added["special"] else TOKEN_USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    md = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.merges": merges}
    for key, text in (("bos", "<s>"), ("eos", "</s>")):
        if text in tokens:
            md[f"tokenizer.ggml.{key}_token_id"] = tokens.index(text)
    md.update(extra)
    return md


def write_vocab_gguf(path, md: dict) -> None:
    """A vocabulary-only GGUF file of a one-layer llama with md's keys."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(md["tokenizer.ggml.tokens"]))
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("add_bos_token", w.add_add_bos_token)):
        if f"tokenizer.ggml.{key}" in md:
            add(md[f"tokenizer.ggml.{key}"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
