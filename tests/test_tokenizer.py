"""fastllm.tokenizer against HuggingFace `tokenizers` (and transformers) on the same files.

Every comparison loads one tokenizer.json into both libraries and requires
identical ids and decoded text.  Besides the real SmolLM2 tokenizer, small
BPE models are trained here with `tokenizers` and wrapped in many component
combinations (normalizers, pre-tokenizers, added-token flags, decoders,
post-processors) so that each feature is checked where it differs from the
others.
"""
import codecs
import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors, trainers
from tokenizers.decoders import DecodeStream

from fastllm.spec.errors import FastLLMError, ModelFileError
from fastllm.tokenizer import Tokenizer, TokenizerError, UnsupportedTokenizerError, _bytes_to_unicode
from oracles.tokenizer_strings import EDGE_CASES, SPECIAL_MARKERS, corpus, random_strings

# --------------------------------------------------------------------------
# SmolLM2
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(smollm2_dir):
    """SmolLM2's tokenizer.json + tokenizer_config.json, from the converted default model."""
    return Path(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2(smollm2_tokenizer_dir):
    return (Tokenizer.from_pretrained(smollm2_tokenizer_dir),
            HFTokenizer.from_file(str(smollm2_tokenizer_dir / "tokenizer.json")))


def _compare(ours, hf, texts, add_special_tokens):
    ref = [e.ids for e in hf.encode_batch(texts, add_special_tokens=add_special_tokens)]
    mine = [ours.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    bad = [i for i in range(len(texts)) if mine[i] != ref[i]]
    return ref, bad


def test_smollm2_pre_tokenizer_splits_digits(smollm2):
    ours, hf = smollm2
    steps = json.loads(hf.to_str())["pre_tokenizer"]["pretokenizers"]
    assert {"type": "Digits", "individual_digits": True} in steps
    digits = [ours.token_to_id(d) for d in "2024"]
    assert ours.encode("2024", add_special_tokens=False) == digits
    assert ours.encode("in 2024, 1234567.", add_special_tokens=False) == hf.encode(
        "in 2024, 1234567.", add_special_tokens=False).ids


@pytest.mark.slow
def test_smollm2_corpus_matches_hf_tokenizers(smollm2):
    ours, hf = smollm2
    texts = corpus(20000, seed=11, specials=SPECIAL_MARKERS)
    assert len(texts) >= 20000
    ref, bad = _compare(ours, hf, texts, add_special_tokens=False)
    print(f"SmolLM2: {len(texts)} strings, {len(bad)} id mismatches vs HF tokenizers")
    assert not bad, [(texts[i], ref[i]) for i in bad[:5]]
    # add_special_tokens=True runs the post-processor
    _, bad = _compare(ours, hf, texts[:2000], add_special_tokens=True)
    assert not bad

    # Decoding HF's ids gives HF's text, and round-trips wherever HF's does.
    round_trips = 0
    for text, ids in zip(texts, ref):
        want = hf.decode(ids, skip_special_tokens=False)
        got = ours.decode(ids)
        assert got == want, text
        round_trips += got == text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    print(f"SmolLM2: decode round-trips exactly on {round_trips}/{len(texts)} strings (as HF's does)")
    # The vocabulary has no tokens for a few control bytes (U+001C..U+001F),
    # so neither library can round-trip the edge case that uses them.
    assert round_trips >= len(texts) - 1


def test_smollm2_matches_transformers(smollm2_tokenizer_dir, smollm2):
    from transformers import AutoTokenizer

    ours, _ = smollm2
    tf = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    assert ours.vocab_size == len(tf)
    assert ours.bos_token_id == tf.bos_token_id
    assert ours.eos_token_id == tf.eos_token_id
    assert ours.special_token_ids == {i for i, t in tf.added_tokens_decoder.items() if t.special}
    for text in EDGE_CASES + random_strings(300, seed=3, specials=SPECIAL_MARKERS):
        assert ours.encode(text) == tf(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == tf(text, add_special_tokens=False)["input_ids"]


def test_api_surface(smollm2):
    ours, hf = smollm2
    assert ours.vocab_size == hf.get_vocab_size(with_added_tokens=True) == len(ours)
    assert ours.get_vocab() == hf.get_vocab(with_added_tokens=True)
    for i in list(range(300)) + random.Random(0).sample(range(ours.vocab_size), 500):
        assert ours.id_to_token(i) == hf.id_to_token(i)
        tok = hf.id_to_token(i)
        assert ours.token_to_id(tok) == hf.token_to_id(tok)
    assert ours.id_to_token(10 ** 9) is None and ours.token_to_id("no such token \u2603") is None
    texts = ["Hello", "", "<|im_start|>x", "12 34"]
    assert ours.encode_batch(texts) == [ours.encode(t) for t in texts]
    assert isinstance(ours.encode("x"), list) and all(type(i) is int for i in ours.encode("ab c"))
    assert ours.decode(ours.encode("round trip")) == "round trip"
    with pytest.raises(TypeError):
        ours.encode(b"bytes")
    with pytest.raises(TypeError):
        ours.encode_batch("not a list")


def test_lone_surrogates_are_refused(smollm2):
    ours, hf = smollm2
    for text in ["a\ud800b", "\udfff", "ok \ud83d"]:
        with pytest.raises(TokenizerError, match="surrogate"):
            ours.encode(text)
        with pytest.raises(TokenizerError, match="surrogate"):
            ours.encode_batch(["fine", text])
        with pytest.raises(Exception):   # HF's binding refuses them too (TypeError)
            hf.encode(text)


def _random_id_streams(ours, n, seed):
    rng = random.Random(seed)
    streams = []
    texts = random_strings(n, seed=seed, specials=SPECIAL_MARKERS)
    for t in texts:
        ids = ours.encode(t, add_special_tokens=False)
        if rng.random() < 0.3:   # random ids too: broken UTF-8, specials anywhere
            ids = ids + [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 12))]
            rng.shuffle(ids)
        streams.append(ids)
    return streams


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_decoder_keeps_up_with_decode_stream(smollm2, skip_special_tokens):
    # HF's DecodeStream holds back all new text while it ends in U+FFFD;
    # fastllm holds back only an incomplete character.  So fastllm's text is
    # never behind DecodeStream's, is the same whenever DecodeStream releases
    # text, and never has to be taken back.
    ours, hf = smollm2
    for ids in _random_id_streams(ours, 300, seed=5):
        ref_stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        inc = ours.incremental_decoder(skip_special_tokens=skip_special_tokens)
        full = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        got = want = ""
        for i in ids:
            got += inc.add(i)
            released = ref_stream.step(hf, i)
            want += released or ""
            assert got.startswith(want) and full.startswith(got), ids
            assert got == want or not released, ids
        assert got + inc.flush() == full


def test_incremental_decoder_never_splits_a_character(smollm2):
    ours, _ = smollm2
    text = "héllo 😀👍🏽 日本語 👨‍👩‍👧 ok"
    ids = ours.encode(text, add_special_tokens=False)
    inc = ours.incremental_decoder()
    out = [inc.add(i) for i in ids] + [inc.flush()]
    assert "".join(out) == text
    assert all("\ufffd" not in p for p in out)
    assert any(p == "" for p in out)   # multi-byte characters were held back


def _stream_lone_continuation_bytes(tok, token, monkeypatch, n=8000):
    """Streams n random lone UTF-8 continuation bytes, each a token made by
    token(byte); returns the ids, the texts released and how many ids were
    decoded."""
    rng = random.Random(3)
    ids = [tok.token_to_id(token(rng.randrange(0x80, 0xC0))) for _ in range(n)]
    decoded = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw))
    inc = tok.incremental_decoder()
    pieces = [inc.add(i) for i in ids]
    pieces.append(inc.flush())
    monkeypatch.undo()
    assert "".join(pieces) == tok.decode(ids) == "\ufffd" * n
    return ids, pieces, sum(decoded)


def test_incremental_decoder_releases_bytes_that_cannot_complete(smollm2, monkeypatch):
    # Each lone continuation byte is a U+FFFD of its own in decode(), so none
    # is held back; before, all were, and each add() decoded all of them.
    byte_char = _bytes_to_unicode()
    _, pieces, decoded = _stream_lone_continuation_bytes(smollm2[0], lambda b: byte_char[b], monkeypatch)
    assert pieces[:-1] == ["\ufffd"] * (len(pieces) - 1)
    assert decoded == 0


def test_incremental_decoder_holds_back_only_an_incomplete_character(smollm2):
    ours, _ = smollm2
    byte_char = _bytes_to_unicode()
    data = "a\u65e5\u672c\u00e9\U0001f600!".encode()
    inc = ours.incremental_decoder()
    got = ""
    for k, b in enumerate(data, 1):
        got += inc.add(ours.token_to_id(byte_char[b]))
        assert got == data[:k].decode("utf-8", "ignore")


# --------------------------------------------------------------------------
# Synthetic tokenizers covering each component
# --------------------------------------------------------------------------

_TRAIN = corpus(2500, seed=21)


def _train(kind):
    if kind == "bytelevel":
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tr = trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                 show_progress=False)
    elif kind == "spm":       # SentencePiece-style: Metaspace, byte fallback, unk
        tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tr = trainers.BpeTrainer(vocab_size=1200, limit_alphabet=300, show_progress=False,
                                 special_tokens=["<unk>"] + ["<0x%02X>" % i for i in range(256)])
    else:                     # continuing-subword prefix and end-of-word suffix
        tok = HFTokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix="##",
                                     end_of_word_suffix="</w>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tr = trainers.BpeTrainer(vocab_size=1200, limit_alphabet=200, show_progress=False,
                                 special_tokens=["[UNK]"], continuing_subword_prefix="##",
                                 end_of_word_suffix="</w>")
    tok.train_from_iterator(_TRAIN, tr)
    return json.loads(tok.to_str())


@pytest.fixture(scope="session")
def base_models():
    return {k: _train(k) for k in ("bytelevel", "spm", "suffix")}


def _spec(base, kind, normalizer=None, pre=None, post=None, decoder=None, model=None):
    d = json.loads(json.dumps(base[kind]))
    d.update(normalizer=normalizer, pre_tokenizer=pre, post_processor=post, decoder=decoder, added_tokens=[])
    if model:
        d["model"].update(model)
    return d


def _hf_json(spec, added=(), post=None, truncation=None, padding=None):
    hf = HFTokenizer.from_str(json.dumps(spec))
    if added:
        hf.add_tokens(list(added))
    if post is not None:
        hf.post_processor = post
    if truncation:
        hf.enable_truncation(**truncation)
    if padding is not None:
        hf.enable_padding(**padding)
    return hf.to_str()


_TEXTS = list(EDGE_CASES) + random_strings(
    250, seed=9, specials=("<mask>", "[SEP]", "hello", "Hello", " <x> ", "<|im_end|>", "é"))


def _check_same(js, texts=_TEXTS):
    hf = HFTokenizer.from_str(js)
    ours = Tokenizer.from_str(js)
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add).ids, \
                (text, add)
        ids = hf.encode(text).ids
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    return ours, hf


_BL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BL_DEC = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}


def _bl(prefix, use_regex):
    return {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": False, "use_regex": use_regex}


_NORMALIZERS = [
    None, {"type": "NFC"}, {"type": "NFD"}, {"type": "NFKC"}, {"type": "NFKD"}, {"type": "Lowercase"},
    {"type": "Replace", "pattern": {"String": "  "}, "content": " "},
    {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "},
    # (a Replace regex that can match the empty string at the start of a
    # piece makes tokenizers insert the content twice and can crash it, so
    # zero-width replacements are only checked inside Split, where it is sane)
    {"type": "Replace", "pattern": {"Regex": "\\d+|b"}, "content": "<>"},
    {"type": "Prepend", "prepend": " "},
    {"type": "Strip", "strip_left": True, "strip_right": True},
    {"type": "Strip", "strip_left": False, "strip_right": True},
    {"type": "Sequence", "normalizers": [{"type": "NFKD"}, {"type": "Lowercase"},
                                         {"type": "Replace", "pattern": {"Regex": "[0-9]"}, "content": "#"}]},
]


@pytest.mark.parametrize("normalizer", _NORMALIZERS, ids=lambda n: json.dumps(n))
def test_normalizers(base_models, normalizer):
    _check_same(json.dumps(_spec(base_models, "bytelevel", normalizer=normalizer, pre=_BL, decoder=_BL_DEC)))


_QWEN_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizers():
    out = [_bl(True, True), _bl(True, False), _bl(False, False), _bl(False, True)]
    for behavior in ["Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"]:
        for invert in (False, True):
            for pattern in [{"Regex": _QWEN_RE}, {"Regex": "\\s+"}, {"String": " "}, {"Regex": "\\d*|b"},
                            {"Regex": "\\w+"}, {"Regex": "[\\h_]+"}, {"Regex": "(a)(b)?"}, {"Regex": "$"}]:
                out.append({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": pattern, "behavior": behavior, "invert": invert}, _bl(False, False)]})
    out += [{"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": d}, _bl(False, True)]}
            for d in (True, False)]
    out += [{"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, _bl(True, False)]},
            {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, _bl(False, False)]},
            # ByteLevel before another step: the byte mapping happens early
            {"type": "Sequence", "pretokenizers": [_bl(False, False), {
                "type": "Split", "pattern": {"String": "\u0120"}, "behavior": "MergedWithNext", "invert": False}]},
            {"type": "Sequence", "pretokenizers": [_bl(True, True), _bl(False, False)]},
            {"type": "Sequence", "pretokenizers": [{"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": True}]}, _bl(False, True)]}]
    return out


@pytest.mark.parametrize("pre", _pre_tokenizers(), ids=lambda p: json.dumps(p)[:120])
def test_pre_tokenizers(base_models, pre):
    texts = EDGE_CASES + random_strings(60, seed=4)
    _check_same(json.dumps(_spec(base_models, "bytelevel", pre=pre, decoder=_BL_DEC)), texts)


def _ms(scheme, split=True):
    return {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": split}


_LLAMA_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
    {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}

_SPM_CONFIGS = [(f"metaspace-{s}-{sp}", dict(pre=_ms(s, sp), decoder=_ms(s)))
                for s in ("always", "first", "never") for sp in (True, False)] + [
    ("llama-normalizer", dict(normalizer={"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        decoder=_LLAMA_DECODER)),
    # Metaspace "first" depends on where a piece sits in the original text
    ("prepend+first", dict(normalizer={"type": "Prepend", "prepend": "\u2581"}, pre=_ms("first"), decoder=_ms("first"))),
    ("strip+first", dict(normalizer={"type": "Strip", "strip_left": True, "strip_right": False},
                         pre=_ms("first"), decoder=_ms("first"))),
    ("wsplit+first", dict(pre={"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, _ms("first")]},
                          decoder=_ms("first"))),
    ("split+first", dict(pre={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\d"}, "behavior": "Isolated", "invert": False}, _ms("first")]},
        decoder=_ms("first"))),
    ("nfkd+digits+first", dict(normalizer={"type": "NFKD"}, pre={"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _ms("first")]}, decoder=_ms("first"))),
    ("replace+first", dict(normalizer={"type": "Replace", "pattern": {"Regex": "^\\s+"}, "content": "\u2581\u2581"},
                           pre={"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"String": "\u2581"},
                                                                       "behavior": "Isolated", "invert": False},
                                                                      _ms("first")]}, decoder=_ms("first"))),
    ("no-byte-fallback", dict(pre=_ms("always"), decoder=_ms("always"), model={"byte_fallback": False})),
    ("fuse-unk", dict(pre=_ms("always"), decoder=_ms("always"), model={"byte_fallback": False, "fuse_unk": True})),
    ("no-unk", dict(pre=_ms("always"), decoder=_ms("always"), model={"byte_fallback": False, "unk_token": None})),
    ("ignore-merges", dict(pre=_ms("always"), decoder=_ms("always"), model={"ignore_merges": True})),
    ("llama-decoder", dict(pre=_ms("first"), decoder=_LLAMA_DECODER)),
    ("strip-decoder", dict(pre=_ms("always"), decoder={"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Strip", "content": "\u2581", "start": 2, "stop": 0}, {"type": "Fuse"}]})),
    ("strip-stop-decoder", dict(pre=_ms("always"), decoder={"type": "Sequence", "decoders": [
        {"type": "Strip", "content": "a", "start": 0, "stop": 1}, {"type": "ByteFallback"}]})),
    ("replace-regex-decoder", dict(pre=_ms("always"), decoder={"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"Regex": "\u2581+"}, "content": "_"}, {"type": "ByteFallback"}]})),
    ("no-decoder", dict(pre=_ms("always"), decoder=None)),
]


@pytest.mark.parametrize("name,cfg", _SPM_CONFIGS, ids=[c[0] for c in _SPM_CONFIGS])
def test_sentencepiece_style_models(base_models, name, cfg):
    _check_same(json.dumps(_spec(base_models, "spm", **cfg)))


_SUFFIX_CONFIGS = [
    ("whitespace", dict(pre={"type": "Whitespace"})),
    ("whitespace-split+fuse", dict(pre={"type": "WhitespaceSplit"}, decoder={"type": "Fuse"})),
    ("ignore-merges", dict(pre={"type": "Whitespace"}, model={"ignore_merges": True})),
    ("no-unk", dict(pre={"type": "Whitespace"}, model={"unk_token": None})),
    ("fuse-unk", dict(pre={"type": "Whitespace"}, model={"fuse_unk": True})),
]


@pytest.mark.parametrize("name,cfg", _SUFFIX_CONFIGS, ids=[c[0] for c in _SUFFIX_CONFIGS])
def test_prefix_and_suffix_models(base_models, name, cfg):
    _check_same(json.dumps(_spec(base_models, "suffix", **cfg)))


def test_merges_in_both_forms(base_models):
    spec = _spec(base_models, "bytelevel", pre=_BL, decoder=_BL_DEC)
    as_lists = json.loads(json.dumps(spec))
    as_lists["model"]["merges"] = [list(m) if isinstance(m, list) else m.split(" ")
                                   for m in spec["model"]["merges"]]
    as_strings = json.loads(json.dumps(spec))
    as_strings["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    a, _ = _check_same(json.dumps(as_lists), EDGE_CASES)
    b, _ = _check_same(json.dumps(as_strings), EDGE_CASES)
    for text in EDGE_CASES:
        assert a.encode(text) == b.encode(text)


def _added_tokens(variant):
    tokens = [("<mask>", False), ("[SEP]", True), ("hello", False), (" <x> ", False), ("<|im_end|>", True),
              ("<|im", False), ("Hello", True), ("\u00e9", False), ("ab", False), ("\n", False)]
    out = []
    for i, (content, special) in enumerate(tokens):
        normalized = bool(variant & 8 and not special) if not variant & 16 else bool(i % 2)
        out.append(AddedToken(content, special=special, single_word=bool(variant & 1 and i % 2 == 0),
                              lstrip=bool(variant & 2 and i % 3 != 1), rstrip=bool(variant & 4 and i % 3 != 2),
                              normalized=normalized))
    return out


@pytest.mark.parametrize("variant", range(32))
def test_added_token_flags(base_models, variant):
    texts = EDGE_CASES[::3] + random_strings(
        80, seed=variant, specials=("<mask>", "[SEP]", "hello", "Hello", " <x> ", "<|im_end|>", "\u00e9", "ab"))
    for normalizer in (None, {"type": "Lowercase"}, {"type": "NFD"}):
        spec = _spec(base_models, "bytelevel", normalizer=normalizer, pre=_BL, decoder=_BL_DEC)
        ours, hf = _check_same(_hf_json(spec, added=_added_tokens(variant)), texts)
        for t in _added_tokens(variant):
            assert ours.token_to_id(t.content) == hf.token_to_id(t.content)
            i = hf.token_to_id(t.content)
            assert ours.id_to_token(i) == hf.id_to_token(i)


def test_added_token_ids_follow_tokenizers_assignment(base_models):
    # The "id" fields in the file are not authoritative: tokenizers assigns
    # ids itself (reusing vocabulary ids), and so must we.
    spec = _spec(base_models, "bytelevel", pre=_BL, decoder=_BL_DEC)
    n = len(spec["model"]["vocab"])
    spec["added_tokens"] = [
        {"id": n + 50, "content": "<a>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True},
        {"id": 3, "content": "<b>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False},
        {"id": 0, "content": "the", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": True},
        {"id": 7, "content": "", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}]
    ours, hf = _check_same(json.dumps(spec), EDGE_CASES + ["<a><b>the x", "the<a>"])
    for t in ("<a>", "<b>", "the"):
        assert ours.token_to_id(t) == hf.token_to_id(t)


_POSTS = [
    processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B </s>",
                                  special_tokens=[("<s>", 1), ("</s>", 2)]),
    processors.TemplateProcessing(single="<s>:1 $A:0", special_tokens=[("<s>", 1)]),
    processors.TemplateProcessing(single="$A <eos> <eos>", special_tokens=[("<eos>", 7)]),
    processors.Sequence([processors.ByteLevel(trim_offsets=False),
                         processors.TemplateProcessing(single="[BOS] $0", special_tokens=[("[BOS]", 5)])]),
    processors.ByteLevel(), processors.RobertaProcessing(("</s>", 2), ("<s>", 0)),
    processors.BertProcessing(("[SEP]", 3), ("[CLS]", 4)),
]


@pytest.mark.parametrize("post", _POSTS, ids=[f"post{i}" for i in range(len(_POSTS))])
def test_post_processors(base_models, post):
    spec = _spec(base_models, "bytelevel", pre=_BL, decoder=_BL_DEC)
    _check_same(_hf_json(spec, post=post), _TEXTS[:200])


@pytest.mark.parametrize("truncation", [dict(max_length=5), dict(max_length=7, direction="left"),
                                        dict(max_length=2), dict(max_length=1)])
@pytest.mark.parametrize("padding", [None, dict(), dict(length=12, direction="left", pad_id=9, pad_token="[P]"),
                                     dict(pad_to_multiple_of=8, pad_id=3)])
def test_truncation_and_padding(base_models, truncation, padding):
    spec = _spec(base_models, "bytelevel", pre=_BL, decoder=_BL_DEC)
    js = _hf_json(spec, post=_POSTS[0], truncation=truncation, padding=padding)
    ours, hf = _check_same(js, _TEXTS[:60])
    for batch in (_TEXTS[:7], _TEXTS[300:311], ["a"], []):
        for add in (True, False):
            assert ours.encode_batch(batch, add_special_tokens=add) == [
                e.ids for e in hf.encode_batch(batch, add_special_tokens=add)]


@pytest.mark.parametrize("decoder", [_LLAMA_DECODER, _ms("always")], ids=["llama", "metaspace"])
def test_incremental_decoder_with_byte_fallback(base_models, decoder):
    # HF's DecodeStream raises "Invalid prefix" here, because one more byte
    # can turn an already valid byte run into replacement characters; the
    # property checked instead is that text, once emitted, stays a prefix of
    # the full decode, and that the pieces add up to it.
    js = json.dumps(_spec(base_models, "spm", pre=_ms("first"), decoder=decoder))
    ours = Tokenizer.from_str(js)
    byte_ids = [ours.token_to_id("<0x%02X>" % b) for b in range(256)]
    rng = random.Random(8)
    streams = _random_id_streams(ours, 150, seed=8)
    for _ in range(100):   # byte runs that are valid, then broken by one more byte
        ch = rng.choice(["\u0c40", "\u00e9", "\U0001f600", "\u65e5"]).encode("utf-8")
        streams.append([ours.token_to_id("\u2581a")] + [byte_ids[b] for b in ch]
                       + [byte_ids[rng.randrange(128, 256)]] * rng.randint(0, 2) + [ours.token_to_id("b")])
    for ids in streams:
        for skip in (True, False):
            inc = ours.incremental_decoder(skip_special_tokens=skip)
            full = ours.decode(ids, skip_special_tokens=skip)
            emitted = ""
            for i in ids:
                emitted += inc.add(i)
                assert full.startswith(emitted), (ids, emitted, full)
            emitted += inc.flush()
            assert emitted == full


def test_incremental_decoder_releases_byte_fallback_runs_that_cannot_be_valid(base_models, monkeypatch):
    ours = Tokenizer.from_str(json.dumps(_spec(base_models, "spm", pre=_ms("first"), decoder=_LLAMA_DECODER)))
    _, pieces, decoded = _stream_lone_continuation_bytes(ours, lambda b: "<0x%02X>" % b, monkeypatch)
    assert pieces[:-1] == ["\ufffd"] * (len(pieces) - 1)
    assert decoded <= 3   # the run when it turns invalid, its last byte as the prefix, flush()


_BYTE_CHAR = _bytes_to_unicode()


def _byte_char(b):
    return _BYTE_CHAR[b]


def _byte_fallback_token(b):
    return "<0x%02X>" % b


def _byte_tokenizers(decoder):
    """(ours, HF's) tokenizer whose ids 0..255 are ByteLevel's byte characters
    and 256..511 the <0xXX> tokens, with the given decoder."""
    vocab = {_byte_char(b): b for b in range(256)}
    vocab.update({_byte_fallback_token(b): 256 + b for b in range(256)})
    js = json.loads(HFTokenizer(models.BPE(vocab, [])).to_str())
    js["decoder"] = decoder
    return Tokenizer.from_str(json.dumps(js)), HFTokenizer.from_str(json.dumps(js))


_BYTE_DECODERS = {   # name: (decoder, the token of a byte)
    "bytelevel": (_BL_DEC, _byte_char),
    "sequence-bytelevel": ({"type": "Sequence", "decoders": [_BL_DEC]}, _byte_char),
    "replace-then-bytelevel": ({"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "a"}, "content": "b"}, _BL_DEC]}, _byte_char),
    # A step after ByteLevel: decoded as DecodeStream does, a window of ids
    "bytelevel-then-replace": ({"type": "Sequence", "decoders": [
        _BL_DEC, {"type": "Replace", "pattern": {"String": "a"}, "content": "b"}]}, _byte_char),
    "bytefallback": (_LLAMA_DECODER, _byte_fallback_token),
}


@pytest.mark.parametrize("name", list(_BYTE_DECODERS))
def test_incremental_decoder_holds_no_invalid_bytes(name, monkeypatch):
    # 100,000 lone continuation bytes: each can never be part of a character,
    # so each is one U+FFFD, released at once, and the work is linear (a
    # ByteLevel step inside a Sequence held them all and decoded them again
    # on every add).
    decoder, byte_token = _BYTE_DECODERS[name]
    ours, hf = _byte_tokenizers(decoder)
    n = 100_000
    ids, pieces, decoded = _stream_lone_continuation_bytes(ours, byte_token, monkeypatch, n)
    assert pieces == ["\ufffd"] * n + [""]
    assert decoded <= 4 * n
    assert "".join(pieces) == hf.decode(ids)


@pytest.mark.parametrize("name", ["sequence-bytelevel", "replace-then-bytelevel", "bytelevel-then-replace"])
def test_incremental_decoder_holds_at_most_an_incomplete_character(name):
    # Valid characters, lone lead and continuation bytes (runs of lead bytes,
    # each breaking the one before, too), ASCII: after each id
    # all text is out but an incomplete character's bytes (at most 3), and the
    # pieces add up to HF's decode of the whole.
    ours, hf = _byte_tokenizers(_BYTE_DECODERS[name][0])
    rng = random.Random(13)
    data = bytearray()
    while len(data) < 20_000:
        kind = rng.randrange(4)
        if kind == 0:
            data += rng.choice(["\u00e9", "\u65e5", "\U0001f600", "\u0c40"]).encode()
        elif kind == 1:
            data.append(rng.randrange(0x80, 0xC0))
        elif kind == 2:
            data += bytes(rng.choice([0xC3, 0xE6, 0xF0, 0xF4, 0xFF]) for _ in range(rng.randint(1, 30)))
        else:
            data.append(rng.choice(b" !09AZbz~"))   # no "a", which the Replace steps rewrite
    inc = ours.incremental_decoder()
    ref = codecs.getincrementaldecoder("utf-8")("replace")
    got = want = ""
    for b in data:
        got += inc.add(b)
        want += ref.decode(bytes([b]))
        assert got == want
    got += inc.flush()
    assert got == hf.decode(list(data)) == data.decode("utf-8", "replace")


def test_incremental_decoder_with_a_step_that_reads_bytelevel_text_as_one_token():
    # A ByteFallback after ByteLevel turns a text that is all "<0x50>" into
    # "P" and leaves a longer one as it is, so the text is not cut at
    # ByteLevel's characters: it is held while it ends in U+FFFD.
    ours, hf = _byte_tokenizers({"type": "Sequence", "decoders": [_BL_DEC, {"type": "ByteFallback"}]})
    for ids in ([256 + 0x50, 0xF0, 0x41], [256 + 0x50, 0xC3, 0xC3, 0x41], [256 + 0xFF, 0x80, 256 + 0x41, 0xE6]):
        full = hf.decode(ids)
        inc = ours.incremental_decoder()
        got = ""
        for i in ids:
            got += inc.add(i)
            assert full.startswith(got), ids
        assert got + inc.flush() == full == ours.decode(ids)


# --------------------------------------------------------------------------
# tokenizer_config.json handling (transformers is the reference)
# --------------------------------------------------------------------------

def test_from_pretrained_reads_config_like_transformers(base_models, tmp_path):
    from transformers import AutoTokenizer

    spec = _spec(base_models, "bytelevel", pre=_BL, decoder=_BL_DEC)
    (tmp_path / "tokenizer.json").write_text(_hf_json(spec, added=[AddedToken("<|end|>", special=True)]),
                                             encoding="utf-8")
    # transformers ignores add_bos_token/add_eos_token when tokenizer.json
    # exists; the post-processor (none here) decides.
    config = {"tokenizer_class": "TokenizersBackend", "add_bos_token": True, "add_eos_token": True,
              "bos_token": "<|begin|>",                     # not in tokenizer.json: gets added
              "eos_token": {"content": "<|end|>", "__type": "AddedToken"},
              "chat_template": "ignored, chat_template.jinja wins"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}", encoding="utf-8")
    ours = Tokenizer.from_pretrained(tmp_path)
    tf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.bos_token == "<|begin|>" and ours.eos_token == "<|end|>"
    assert (ours.bos_token_id, ours.eos_token_id) == (tf.bos_token_id, tf.eos_token_id)
    assert ours.vocab_size == len(tf)
    for text in EDGE_CASES[:80] + ["<|begin|>x<|end|>"]:
        assert ours.encode(text) == tf(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == tf(text, add_special_tokens=False)["input_ids"]
    assert ours.encode("x") == ours.encode("x", add_special_tokens=False)
    # with a post-processor that adds BOS/EOS, both add them (even to "")
    spec["post_processor"] = json.loads(_hf_json(spec, post=processors.TemplateProcessing(
        single="<|begin|> $A <|end|>", special_tokens=[("<|begin|>", 1), ("<|end|>", 2)])))["post_processor"]
    (tmp_path / "tokenizer.json").write_text(_hf_json(spec, added=[AddedToken("<|end|>", special=True)]),
                                             encoding="utf-8")
    ours = Tokenizer.from_pretrained(tmp_path)
    tf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in EDGE_CASES[:40] + ["<|begin|>x<|end|>"]:
        assert ours.encode(text) == tf(text)["input_ids"], text
    assert ours.encode("")[0] == 1
    assert ours.chat_template == "{{ messages[0].content }}"
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_from_pretrained_accepts_a_tokenizer_json_path(smollm2_tokenizer_dir):
    tok = Tokenizer.from_pretrained(smollm2_tokenizer_dir / "tokenizer.json")
    assert tok.encode("hi", add_special_tokens=False) == Tokenizer.from_file(
        smollm2_tokenizer_dir / "tokenizer.json").encode("hi", add_special_tokens=False)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------

def test_missing_and_malformed_files(tmp_path, base_models):
    with pytest.raises(ModelFileError, match="not found"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelFileError, match="tokenizer.json not found"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ModelFileError, match="not found"):
        Tokenizer.from_file(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelFileError, match="not valid JSON") as e:
        Tokenizer.from_file(bad)
    assert str(bad) in str(e.value)
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(TokenizerError, match="JSON object"):
        Tokenizer.from_file(bad)
    bad.write_text(json.dumps({"version": "1.0", "added_tokens": []}), encoding="utf-8")
    with pytest.raises(TokenizerError, match="model"):
        Tokenizer.from_file(bad)
    spec = _spec(base_models, "bytelevel", pre=_BL, decoder=_BL_DEC)
    spec["model"]["merges"] = list(spec["model"]["merges"]) + [["\u0120zzqq", "x"]]
    bad.write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(TokenizerError, match="zzqq") as e:
        Tokenizer.from_file(bad).validate()
    assert str(bad) in str(e.value)
    with pytest.raises(TokenizerError, match="zzqq"):     # the merge table is built on first use
        Tokenizer.from_file(bad).encode("hello")
    spec["model"]["merges"][-1] = "a b c"
    bad.write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(TokenizerError, match="not a pair"):
        Tokenizer.from_file(bad).encode("hello")
    (tmp_path / "tokenizer.json").write_text(json.dumps(_spec(base_models, "bytelevel", pre=_BL)),
                                             encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text("{", encoding="utf-8")
    with pytest.raises(ModelFileError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(tmp_path)
    assert issubclass(TokenizerError, (ValueError, FastLLMError))


def _unsupported_cases():
    from tokenizers import decoders, normalizers
    return [
        ("normalizer", normalizers.BertNormalizer(), "BertNormalizer"),
        ("normalizer", normalizers.StripAccents(), "StripAccents"),
        ("pre_tokenizer", pre_tokenizers.Punctuation(), "Punctuation"),
        ("pre_tokenizer", pre_tokenizers.CharDelimiterSplit("x"), "CharDelimiterSplit"),
        ("decoder", decoders.WordPiece(), "WordPiece"),
        ("decoder", decoders.CTC(), "CTC"),
    ]


@pytest.mark.parametrize("slot,component,name", _unsupported_cases(), ids=[c[2] for c in _unsupported_cases()])
def test_unsupported_components_are_refused(base_models, slot, component, name):
    hf = HFTokenizer.from_str(json.dumps(_spec(base_models, "bytelevel", pre=_BL)))
    setattr(hf, slot, component)
    with pytest.raises(UnsupportedTokenizerError, match=name):
        Tokenizer.from_str(hf.to_str())


def test_unsupported_models_and_options_are_refused(base_models):
    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    with pytest.raises(UnsupportedTokenizerError, match="WordPiece"):
        Tokenizer.from_str(wordpiece.to_str())
    spec = _spec(base_models, "bytelevel", pre=_BL, model={"dropout": 0.1})
    with pytest.raises(UnsupportedTokenizerError, match="dropout"):
        Tokenizer.from_str(json.dumps(spec))
    spec = _spec(base_models, "bytelevel", pre=_BL, model={"dropout": 0.0})
    _check_same(json.dumps(spec), EDGE_CASES[:20])
    spec = _spec(base_models, "bytelevel", pre={"type": "Split", "pattern": {"Regex": "[[:alpha:]]+"},
                                                "behavior": "Isolated", "invert": False})
    with pytest.raises(UnsupportedTokenizerError, match="POSIX"):
        Tokenizer.from_str(json.dumps(spec))
    spec = _spec(base_models, "bytelevel", pre=_BL)
    spec["version"] = "2.0"
    with pytest.raises(UnsupportedTokenizerError, match="version"):
        Tokenizer.from_str(json.dumps(spec))


def test_missing_unk_token_is_reported(base_models):
    spec = _spec(base_models, "spm", pre=_ms("always"), model={"byte_fallback": False, "unk_token": "<nope>"})
    ours = Tokenizer.from_str(json.dumps(spec))
    with pytest.raises(TokenizerError, match="<nope>"):
        ours.encode("\u2603 snowman not in the alphabet")


def test_cache_does_not_change_results(smollm2):
    ours, hf = smollm2
    texts = random_strings(200, seed=77)
    first = [ours.encode(t) for t in texts]
    ours._cache.clear()
    assert [ours.encode(t) for t in reversed(texts)][::-1] == first
