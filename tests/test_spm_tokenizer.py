"""SentencePiece vocabularies: fastllm.tokenizer against HF `tokenizers` and
against the `sentencepiece` library.

The vocabularies are trained here (oracles.spm_vocabs: BPE and Unigram, with
and without byte fallback, in the Llama, Gemma and T5 styles) and converted
to tokenizer.json by transformers' own converters, in every layout the hub's
files have (legacy Llama, non-legacy Metaspace "first", Gemma, T5's
Precompiled + Metaspace, transformers 5's generic loader).

HF tokenizers is the reference on a tokenizer.json, and fastllm matches it id
for id. Against sentencepiece on the .model the files agree except in these
cases, each checked below to be the whole story:

* Control pieces (<s>, </s>, <unk>, <pad>) written in the text: tokenizers
  matches them as added tokens, sentencepiece spells them out. Strings that
  hold one are left out of the comparison.
* Metaspace prepend_scheme "first" (LlamaConverter with legacy=False, and
  transformers 5's LlamaTokenizer): a text that starts with a space gets no
  dummy prefix, because it already starts with "▁"; sentencepiece always
  adds one. So HF on " x" gives sentencepiece's ids for "x".
* The text of a byte piece ("<0x41>"), in a Unigram model or a BPE one with
  ignore_merges (transformers 5 sets it when the .model has user-defined
  pieces): tokenizers matches it like any piece, sentencepiece never
  matches byte pieces in text.
* Unigram, segmentations of equal score (runs of "▁" pieces, mostly): both
  libraries find a best path, of the same total score (to 1e-4; the .model
  stores float32 scores), but pick different ones among equal paths.
* Precompiled normalizer (T5 style): tokenizers replaces each grapheme
  cluster under 6 bytes by the entry of its shortest prefix (dropping the
  rest of the cluster) and maps longer clusters character by character;
  sentencepiece replaces the longest prefix of the remaining text. Where
  the two normalized texts differ, so can the ids ("ẛ̣", "ᄀ" + "ᅡ").
"""
import base64
import json
import random
import re

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers as hf_normalizers

from fastllm.tokenizer import Tokenizer, TokenizerError, UnsupportedTokenizerError
from oracles import spm_vocabs
from oracles.tokenizer_strings import EDGE_CASES, random_strings

spm = pytest.importorskip("sentencepiece")

N_STRINGS = 20000
SMALL = spm_vocabs.SPM_EDGE_CASES + EDGE_CASES + spm_vocabs.spm_random_strings(300, seed=4) + random_strings(
    300, seed=4)

# (vocabulary, flavor) pairs run in the quick (not slow) tests: a Llama BPE
# in both Metaspace layouts, and a Unigram with byte fallback.
QUICK = [("llama-bpe-bf", "llama"), ("llama-bpe-bf", "llama-nonlegacy"), ("llama-unigram-bf", "llama")]
ALL = [(name, flavor) for name, (_, flavors) in spm_vocabs.VOCABS.items() for flavor in flavors]
# QUICK, then every other layout as a slow case.
EVERY = [pytest.param(n, f, id=f"{n}:{f}") for n, f in QUICK] + [
    pytest.param(n, f, id=f"{n}:{f}", marks=pytest.mark.slow) for n, f in ALL if (n, f) not in QUICK]
# The layouts whose only difference from sentencepiece is prepend_scheme "first".
FIRST_SCHEME = ("llama-nonlegacy", "llama-hf5")


@pytest.fixture(scope="session")
def vocabs(request):
    """vocabs(name) -> (.model path, {flavor: HF folder}), cached across runs."""
    cache = request.config.cache.mkdir("fastllm_spm_vocabs")
    made = {}

    def get(name):
        if name not in made:
            made[name] = spm_vocabs.build(name, cache)
        return made[name]
    return get


@pytest.fixture(scope="session")
def texts():
    return spm_vocabs.strings(N_STRINGS)


def _load(vocabs, name, flavor):
    model, folders = vocabs(name)
    folder = folders[flavor]
    return (Tokenizer.from_pretrained(folder), HFTokenizer.from_file(str(folder / "tokenizer.json")),
            spm.SentencePieceProcessor(model_file=str(model)), folder)


def _hf_ids(hf, texts, add_special_tokens=False):
    return [e.ids for e in hf.encode_batch(texts, add_special_tokens=add_special_tokens)]


def _check_against_hf(ours, hf, texts, decoded=2000):
    ref = _hf_ids(hf, texts)
    bad = [t for t, want in zip(texts, ref) if ours.encode(t, add_special_tokens=False) != want]
    assert not bad, bad[:5]
    with_specials = _hf_ids(hf, texts[:500], add_special_tokens=True)
    assert [ours.encode(t) for t in texts[:500]] == with_specials
    for ids in ref[:decoded]:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    return ref


# --------------------------------------------------------------------------
# Encode and decode, id for id, against HF tokenizers on the same file
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name,flavor", QUICK, ids=[f"{n}:{f}" for n, f in QUICK])
def test_matches_hf_tokenizers(vocabs, name, flavor):
    ours, hf, _, _ = _load(vocabs, name, flavor)
    _check_against_hf(ours, hf, SMALL, decoded=len(SMALL))


@pytest.mark.slow
@pytest.mark.parametrize("name,flavor", ALL, ids=[f"{n}:{f}" for n, f in ALL])
def test_matches_hf_tokenizers_on_the_corpus(vocabs, texts, name, flavor):
    ours, hf, _, _ = _load(vocabs, name, flavor)
    assert len(texts) >= N_STRINGS
    ref = _check_against_hf(ours, hf, texts)
    unk = hf.token_to_id("<unk>")
    byte_ids = {hf.token_to_id("<0x%02X>" % b) for b in range(256)} - {None}
    print(f"{name} as {flavor}: {len(texts)} strings, 0 id mismatches vs HF tokenizers; "
          f"{sum(any(i in byte_ids for i in ids) for ids in ref)} use byte fallback, "
          f"{sum(unk in ids for ids in ref)} an unknown token")


def _random_ids(hf, n, seed):
    """Id sequences mixing pieces, byte pieces (valid and broken UTF-8) and specials."""
    rng = random.Random(seed)
    size = hf.get_vocab_size(with_added_tokens=True)
    byte_ids = [i for i in (hf.token_to_id("<0x%02X>" % b) for b in range(256)) if i is not None]
    utf8 = [hf.token_to_id("<0x%02X>" % b) for b in "é中😀".encode("utf-8")]
    out = []
    for _ in range(n):
        ids = []
        for _ in range(rng.randint(1, 12)):
            k = rng.random()
            if k < 0.4 or not byte_ids:
                ids.append(rng.randrange(size))
            elif k < 0.7:
                ids.extend(rng.choice(byte_ids) for _ in range(rng.randint(1, 4)))
            else:
                ids.extend(utf8[rng.randrange(len(utf8)):][:rng.randint(1, 6)])
        out.append(ids)
    return out


@pytest.mark.parametrize("name,flavor", EVERY)
def test_decode_of_any_ids_matches_hf(vocabs, name, flavor):
    ours, hf, _, _ = _load(vocabs, name, flavor)
    for ids in _random_ids(hf, 1500, seed=7):
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def _stream(ours, ids):
    dec = ours.incremental_decoder(skip_special_tokens=True)
    parts = [dec.add(i) for i in ids]
    return parts, dec.flush()


@pytest.mark.parametrize("name,flavor", EVERY)
def test_streaming_decode_of_byte_fallback_runs(vocabs, name, flavor):
    """Streamed text adds up to HF's decode of the whole, and no part is
    ever taken back: a character spelled by <0xXX> tokens comes out whole,
    never as a U+FFFD that a later byte would have completed."""
    ours, hf, _, _ = _load(vocabs, name, flavor)
    byte_ids = {hf.token_to_id("<0x%02X>" % b) for b in range(256)} - {None}
    ref = _hf_ids(hf, SMALL)
    seqs = [ids for ids in ref if byte_ids & set(ids)] if byte_ids else ref
    assert len(seqs) > 100
    seqs += _random_ids(hf, 1000, seed=8)
    for ids in seqs:
        want = hf.decode(ids, skip_special_tokens=True)
        parts, tail = _stream(ours, ids)
        got = ""
        for p in parts:
            got += p
            assert want.startswith(got), (ids, got, want)
        assert got + tail == want, ids


def test_whole_texts_are_not_kept_in_the_piece_cache(vocabs):
    """A legacy Llama file has no pre-tokenizer: each text is one piece,
    which the cache of pre-token ids must not keep."""
    ours, hf, _, _ = _load(vocabs, "llama-bpe-bf", "llama")
    long_texts = [" ".join(SMALL[i:i + 40]) for i in range(0, 400, 40)]
    for t, want in zip(long_texts, _hf_ids(hf, long_texts)):
        assert ours.encode(t, add_special_tokens=False) == want
    assert ours._cache and max(map(len, ours._cache)) <= 256


_SCHEMES = [(scheme, split) for scheme in ("always", "first", "never") for split in (False, True)]
_LAYOUTS = [("llama-bpe-bf", "llama-nonlegacy"), ("llama-unigram-bf", "llama"),
            pytest.param("t5-unigram", "t5", marks=pytest.mark.slow),
            pytest.param("t5-unigram", "spm", marks=pytest.mark.slow)]
# Texts whose first characters a normalizer deletes, expands or merges:
# where the normalized text starts decides whether "first" prepends.
_STARTS = ["\x01x", "\ufb01x", "\x01\ufb01", "\u2460x", "\x01\x01 x", "\r\nx", "a\u0308x", "\u1100\u1161",
           "\x01<s>x", "<s>\x01x", "  \x01x", "\u3000\u031bx", "\x01", "\ufb01", "<s>\ufb01", "\xa0x", "\xa0\xa0x",
           " \xa0x", "\xa0\u2122x", " \u2122x", " \ufb01", "\x01\u2122x", "\u2581x", " \u2581x"]


@pytest.mark.parametrize("name,flavor", _LAYOUTS)
@pytest.mark.parametrize("scheme,split", _SCHEMES, ids=[f"{s}-split{int(p)}" for s, p in _SCHEMES])
def test_metaspace_variants_on_spm_vocabularies(vocabs, name, flavor, scheme, split):
    """Every prepend_scheme, split or not, after the normalizer of each
    layout, with control tokens inside the text (after one, "first" adds
    no prefix), encoded and decoded as HF does."""
    _, folders = vocabs(name)
    spec = json.loads((folders[flavor] / "tokenizer.json").read_text(encoding="utf-8"))
    meta = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": split}
    spec["pre_tokenizer"] = meta
    spec["decoder"] = {"type": "Sequence", "decoders": [meta, {"type": "ByteFallback"}, {"type": "Fuse"}]}
    js = json.dumps(spec)
    ours, hf = Tokenizer.from_str(js), HFTokenizer.from_str(js)
    texts = _STARTS + SMALL[:800] + ["<s>", "a<s> b", " <s>  x</s>y", "</s> lead", "x <unk> y", "<s><s> "]
    for t, want in zip(texts, _hf_ids(hf, texts)):
        assert ours.encode(t, add_special_tokens=False) == want, t
        assert ours.decode(want) == hf.decode(want, skip_special_tokens=False), t


# --------------------------------------------------------------------------
# Against sentencepiece on the .model
# --------------------------------------------------------------------------

_BYTE_PIECE_TEXT = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _path_score(scores, ids):
    return sum(scores[i] for i in ids)


def _explain(case, s, hf_ids, sp_ids, sp, hf, scores, whole_pieces):
    """Which documented differences explain HF and sentencepiece
    disagreeing on s (joined by " + "), or None."""
    causes = []
    sp_text = sp.normalize(s)
    if case == "first" and s[:1] in (" ", "\u2581"):
        # sentencepiece's ids for the text without its first character are
        # the ids of the text without the dummy prefix.
        causes.append("no dummy prefix before a leading space (prepend_scheme first)")
        if len(s) == 1:
            return causes[0] if "".join(hf.id_to_token(i) for i in hf_ids) == "\u2581" else None
        sp_ids, sp_text = sp.encode(s[1:]), sp_text[1:]
        if hf_ids == sp_ids:
            return causes[0]
    if whole_pieces and _BYTE_PIECE_TEXT.search(s):
        return " + ".join(causes + ["byte pieces written in the text are matched"])
    if scores is None:
        return None
    if hf.normalizer is not None:
        text = hf.normalizer.normalize_str(s)
        if hf.pre_tokenizer is not None:
            text = "".join(p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text))
        if text != sp_text:
            return " + ".join(causes + ["Precompiled normalizes grapheme clusters, sentencepiece longest prefixes"])
    if abs(_path_score(scores, hf_ids) - _path_score(scores, sp_ids)) < 1e-4 and \
            "".join(hf.id_to_token(i) for i in hf_ids) == "".join(sp.id_to_piece(sp_ids)):
        return " + ".join(causes + ["Unigram segmentations of equal score"])
    return None


@pytest.mark.slow
@pytest.mark.parametrize("name,flavor", ALL, ids=[f"{n}:{f}" for n, f in ALL])
def test_agrees_with_sentencepiece_but_for_documented_cases(vocabs, texts, name, flavor):
    ours, hf, sp, _ = _load(vocabs, name, flavor)
    spec = json.loads(hf.to_str())
    unigram = spec["model"]["type"] == "Unigram"
    scores = [s for _, s in spec["model"]["vocab"]] if unigram else None
    controls = [t.content for t in hf.get_added_tokens_decoder().values() if t.special]
    plain = [t for t in texts if not any(c in t for c in controls)]
    assert len(plain) > 0.9 * len(texts)
    hf_ids = _hf_ids(hf, plain)
    sp_ids = sp.encode(plain)
    case = "first" if flavor in FIRST_SCHEME else None
    causes = {}
    for s, h, p in zip(plain, hf_ids, sp_ids):
        if h == p:
            continue
        assert ours.encode(s, add_special_tokens=False) == h
        cause = _explain(case, s, h, p, sp, hf, scores, unigram or spec["model"].get("ignore_merges"))
        assert cause is not None, (s, sp.id_to_piece(p), [hf.id_to_token(i) for i in h])
        causes[cause] = causes.get(cause, 0) + 1
    print(f"{name} as {flavor}: {len(plain)} strings without control pieces, "
          f"{len(plain) - sum(causes.values())} identical to sentencepiece; {causes}")
    if not unigram and case is None:
        assert set(causes) <= {"byte pieces written in the text are matched"}
    # Ties are rare: the corpus is not one big tie.
    ties = sum(n for cause, n in causes.items() if cause.endswith("equal score"))
    assert ties < 0.01 * len(plain)


def test_llama_bpe_agrees_with_sentencepiece(vocabs):
    ours, hf, sp, _ = _load(vocabs, "llama-bpe-bf", "llama")
    plain = [t for t in SMALL if not any(c in t for c in ("<s>", "</s>", "<unk>"))]
    assert [ours.encode(t, add_special_tokens=False) for t in plain] == sp.encode(plain)
    assert [ours.encode(t) for t in plain] == [[sp.bos_id()] + ids for ids in sp.encode(plain)]


# --------------------------------------------------------------------------
# transformers on the same folder
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name,flavor", EVERY)
def test_from_pretrained_matches_transformers(vocabs, name, flavor):
    from transformers import AutoTokenizer

    ours, _, _, folder = _load(vocabs, name, flavor)
    tf = AutoTokenizer.from_pretrained(str(folder))
    assert ours.vocab_size == len(tf)
    assert (ours.bos_token_id, ours.eos_token_id) == (tf.bos_token_id, tf.eos_token_id)
    for text in SMALL[:600]:
        ids = tf(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == tf.decode(ids, skip_special_tokens=True)


def test_a_folder_with_only_tokenizer_model_says_how_to_make_tokenizer_json(vocabs, tmp_path):
    import shutil

    from fastllm.spec.errors import ModelFileError
    model, _ = vocabs("llama-bpe-bf")
    shutil.copy(model, tmp_path / "tokenizer.model")
    with pytest.raises(ModelFileError, match="save_pretrained"):
        Tokenizer.from_pretrained(tmp_path)


# --------------------------------------------------------------------------
# The Unigram model on hand-made vocabularies
# --------------------------------------------------------------------------

def _unigram_json(vocab, unk_id=0, byte_fallback=False, pre=True):
    from tokenizers import models, pre_tokenizers
    tok = HFTokenizer(models.Unigram(vocab, unk_id, byte_fallback))
    if pre:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return tok.to_str()


def _same_as_hf(js, texts):
    hf = HFTokenizer.from_str(js)
    ours = Tokenizer.from_str(js)
    for t in texts:
        assert ours.encode(t) == hf.encode(t).ids, t
    return ours, hf


def test_unigram_on_random_vocabularies_with_ties():
    """Scores from a small set make equal-score paths common: the path
    tokenizers picks among them is the one whose last piece starts first."""
    rng = random.Random(3)
    alphabet = "ab▁c\u00e9\u4e2d"
    for round_ in range(40):
        pieces = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(30)}
        pieces -= {"<unk>"}
        vocab = [("<unk>", 0.0)] + [(p, float(rng.choice([-1, -2, -3, -1.5]))) for p in sorted(pieces)]
        bf = round_ % 2 == 1
        if bf:
            vocab += [("<0x%02X>" % b, -5.0) for b in range(256) if rng.random() < 0.9]
        texts = ["".join(rng.choice(alphabet + "xy ") for _ in range(rng.randint(0, 14))) for _ in range(150)]
        _same_as_hf(_unigram_json(vocab, 0, bf), texts)


def test_unigram_fuses_unknown_characters_and_spells_them_in_bytes():
    vocab = [("<unk>", 0.0), ("▁", -1.0), ("a", -2.0), ("b", -2.0), ("ab", -3.0)]
    ours, _ = _same_as_hf(_unigram_json(vocab), ["a xyz b", "xy", "ab☃☃ab"])
    assert ours.encode("xyz", add_special_tokens=False) == [1, 0]
    with_bytes = vocab + [("<0x%02X>" % b, -4.0) for b in range(256)]
    ours, _ = _same_as_hf(_unigram_json(with_bytes, byte_fallback=True), ["a xyz b", "☃", "ab☃☃ab"])
    assert ours.tokenize("☃", add_special_tokens=False) == ["▁", "<0xE2>", "<0x98>", "<0x83>"]
    # A byte piece missing: the whole unknown run is one unknown token.
    partial = vocab + [("<0x%02X>" % b, -4.0) for b in range(256) if b != 0x83]
    ours, _ = _same_as_hf(_unigram_json(partial, byte_fallback=True), ["☃", "x☃y", "é"])
    assert ours.tokenize("x☃", add_special_tokens=False) == ["▁", "<unk>"]


def test_unigram_without_unk_id():
    vocab = [("▁", -1.0), ("a", -1.0)]
    js = _unigram_json(vocab, unk_id=None)
    hf = HFTokenizer.from_str(js)
    ours = Tokenizer.from_str(js)
    assert ours.encode("a a") == hf.encode("a a").ids
    with pytest.raises(Exception):
        hf.encode("b")
    with pytest.raises(TokenizerError, match="no piece covers"):
        ours.encode("b")


@pytest.mark.parametrize("model,message", [
    ({"type": "Unigram"}, "needs 'vocab'"),
    ({"type": "Unigram", "vocab": [["a", "x"]]}, r"vocab\[0\]"),
    ({"type": "Unigram", "vocab": [["a", -1.0, 3]]}, r"vocab\[0\]"),
    ({"type": "Unigram", "vocab": [["<unk>", 0.0], ["a", float("nan")]], "unk_id": 0}, r"vocab\[1\]"),
    ({"type": "Unigram", "vocab": [["a", -1.0]], "unk_id": 1}, "unk_id"),
    ({"type": "Unigram", "vocab": [["a", -1.0], ["a", -2.0]], "unk_id": 0}, "listed twice"),
    ({"type": "WordPiece", "vocab": {}}, "WordPiece"),
])
def test_malformed_unigram_models_are_refused(model, message):
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_str(json.dumps({"model": model}))


def test_other_model_types_are_refused_as_unsupported():
    with pytest.raises(UnsupportedTokenizerError, match="WordLevel"):
        Tokenizer.from_str(json.dumps({"model": {"type": "WordLevel", "vocab": {}, "unk_token": "x"}}))


# --------------------------------------------------------------------------
# The Precompiled normalizer
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def charsmaps(request):
    """Precompiled charsmaps of sentencepiece's built-in rules, taken from
    BPE models trained with each (a fraction of a second apiece)."""
    cache = request.config.cache.mkdir("fastllm_spm_vocabs")
    out = {}
    for rule in ("nmt_nfkc", "nfkc", "nfkc_cf", "nmt_nfkc_cf"):
        model = spm_vocabs.train("bpe", byte_fallback=False, out_dir=cache, style="t5",
                                 normalization_rule_name=rule)
        out[rule] = spm_vocabs.model_proto(model).normalizer_spec.precompiled_charsmap
    return out


def _precompiled(charsmap):
    js = json.dumps({"model": {"type": "Unigram", "vocab": [["<unk>", 0.0]], "unk_id": 0},
                     "normalizer": {"type": "Precompiled",
                                    "precompiled_charsmap": base64.b64encode(charsmap).decode()}})
    return Tokenizer.from_str(js).normalizer


@pytest.mark.parametrize("rule", ["nmt_nfkc", "nfkc", "nfkc_cf", "nmt_nfkc_cf"])
def test_precompiled_matches_hf(charsmaps, rule):
    ours = _precompiled(charsmaps[rule])
    hf = hf_normalizers.Precompiled(charsmaps[rule])
    # Grapheme clusters of each length, Hangul jamo, compatibility forms.
    extra = ["\u1100\u1161", "\u1100\u1161\u11a8", "\u1e9b\u0323", "a\u0308\u0304\u0301", "\ufb01", "\u2460",
             "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\r\n", "\x00x", "x\x00", "\u0915\u094d\u0937"]
    for s in extra + SMALL:
        assert ours.normalize(s) == hf.normalize_str(s), s


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["nmt_nfkc", "nfkc_cf"])
def test_precompiled_matches_hf_on_the_corpus(charsmaps, texts, rule):
    ours = _precompiled(charsmaps[rule])
    hf = hf_normalizers.Precompiled(charsmaps[rule])
    bad = [s for s in texts if ours.normalize(s) != hf.normalize_str(s)]
    assert not bad, bad[:5]


@pytest.mark.parametrize("charsmap,message", [
    (None, "base64"), ("not base64!", "not base64"), ("", "empty"),
    (base64.b64encode(b"\x01\x00").decode(), "header"),
    (base64.b64encode(b"\x40\x00\x00\x00abcd").decode(), "runs past"),
    (base64.b64encode(b"\x04\x00\x00\x00\x00\x00\x00\x00\xff\xfe").decode(), "not UTF-8"),
])
def test_malformed_charsmaps_are_refused(charsmap, message):
    spec = {"model": {"type": "Unigram", "vocab": [["<unk>", 0.0]], "unk_id": 0},
            "normalizer": {"type": "Precompiled", "precompiled_charsmap": charsmap}}
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_str(json.dumps(spec)).encode("abc")
