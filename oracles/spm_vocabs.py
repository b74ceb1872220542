"""SentencePiece vocabularies trained here, and their HF tokenizer.json files
made by transformers' own converters.

No SentencePiece vocabulary can be downloaded in the tests, so small ones are
trained with the `sentencepiece` library on text every machine with the test
extras has: the Lee corpus that gensim ships (English news), and strings built
in code (oracles.tokenizer_strings) with CJK, emoji, digits and whitespace
runs, so that rare characters end in byte fallback or the unknown token.

    model = train("bpe", byte_fallback=True, vocab_size=2000, out_dir=cache)
    folder = hf_folder(model, out_dir=cache, flavor="llama")
    texts = strings(20000)

train() writes <out_dir>/<name>.model once and reuses it (training a
Unigram model takes seconds, a BPE one a fraction); hf_folder() writes
<out_dir>/<name>-<flavor>/ with tokenizer.json, tokenizer_config.json and
special_tokens_map.json saved by transformers, and tokenizer.model. Both
are keyed by FORMAT_VERSION and every setting, so a cache folder can be
shared between tests and kept across runs.

Training styles (STYLES) set the normalizer spec and special ids as the
families that use these vocabularies do:

* "llama": Llama 2 / Mistral / TinyLlama: identity normalization, a dummy
  prefix, whitespace kept as is, digits split, <unk> <s> </s> at 0 1 2.
* "gemma": as "llama" but no dummy prefix; <pad> <eos> <bos> <unk> at 0 1 2 3,
  then user-defined pieces (turn markers, HTML tags, whitespace runs), which
  sentencepiece emits whole wherever they occur.
* "t5": T5 / ALBERT-style Unigram: NFKC-based "nmt_nfkc" rules (a
  precompiled charsmap in the .model), extra whitespace removed, a dummy
  prefix; <pad> </s> <unk> at 0 1 2 and no <s>.

Converter flavors (FLAVORS) are the tokenizer.json layouts transformers
produces, which the files on the hub carry:

* "llama": LlamaConverter, legacy=True (Llama 2, Mistral v0.1, TinyLlama):
  normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, decoder
  Replace + ByteFallback + Fuse + Strip.
* "llama-nonlegacy": LlamaConverter, legacy=False: no normalizer,
  Metaspace(prepend_scheme="first", split=False).
* "llama-hf5": transformers 5's LlamaTokenizer loaded from the .model alone
  (BPE merges from the vocabulary, Metaspace "first").
* "gemma": GemmaConverter: normalizer Replace(" ", "▁"), pre-tokenizer
  Split(" ", merged_with_previous), no dummy prefix.
* "t5": the base SpmConverter (T5, ALBERT, XLNet ...): Precompiled charsmap,
  Strip + Replace of space runs, Metaspace(prepend_scheme="always").
* "spm": transformers 5's generic loader of a bare .model
  (SpmConverter.build_tokenizer_from_spm_proto), which follows the .model's
  own normalizer spec.

The classic converters take BPE merges from SentencePieceExtractor, whose
API changed in transformers 5 (extract(model_type, ...) returns keyword
arguments); _Extractor gives them the (vocab, merges) they expect from
whichever version is installed, computed by transformers' own code.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import shutil
from pathlib import Path

# Bump when training or conversion changes, so stale caches are rebuilt.
FORMAT_VERSION = 2

KINDS = ("bpe", "unigram")

STYLES = {
    "llama": dict(normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
                  split_digits=True, allow_whitespace_only_pieces=True,
                  unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
    "gemma": dict(normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
                  split_digits=True, allow_whitespace_only_pieces=True,
                  pad_id=0, eos_id=1, bos_id=2, unk_id=3, eos_piece="<eos>", bos_piece="<bos>",
                  user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "<h1>", "</h1>", "\t\t", "\n\n",
                                        "\u2581\u2581"]),
    "t5": dict(normalization_rule_name="nmt_nfkc", add_dummy_prefix=True, remove_extra_whitespaces=True,
               split_digits=False, allow_whitespace_only_pieces=False,
               pad_id=0, eos_id=1, unk_id=2, bos_id=-1),
}

FLAVORS = ("llama", "llama-nonlegacy", "llama-hf5", "gemma", "t5", "spm")

# The vocabularies the tests use: name -> (train() arguments, flavors that
# convert it as transformers would for a family with that vocabulary).
VOCABS = {
    "llama-bpe-bf": (dict(kind="bpe", byte_fallback=True, style="llama"),
                     ("llama", "llama-nonlegacy", "llama-hf5", "spm")),
    "llama-bpe": (dict(kind="bpe", byte_fallback=False, style="llama"), ("llama", "spm")),
    "llama-unigram-bf": (dict(kind="unigram", byte_fallback=True, style="llama"),
                         ("llama", "llama-nonlegacy", "spm")),
    "gemma-bpe-bf": (dict(kind="bpe", byte_fallback=True, style="gemma"), ("gemma", "spm")),
    "t5-unigram": (dict(kind="unigram", byte_fallback=False, style="t5"), ("t5", "spm")),
}

DEFAULT_VOCAB_SIZE = 2000


# --------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------

def lee_corpus_lines() -> list[str]:
    """The non-empty lines of the Lee corpus that gensim ships."""
    from fastllm.cli.perplexity import corpus_text
    return [line for line in corpus_text().splitlines() if line.strip()]


def training_text() -> list[str]:
    """Sentences to train on: English news, multilingual prose and code,
    and seeded random mixed-script strings."""
    from oracles.tokenizer_strings import prose_and_code, random_strings
    return lee_corpus_lines() + prose_and_code() + random_strings(3000, seed=5)


# Characters no vocabulary here has a piece for: private use, CJK extension
# B, runes, Linear B, controls. With byte fallback they become <0xXX>
# tokens, without it the unknown token.
UNKNOWN_CHARS = ("\ue000\uf8ff\U00020000\U0002a6d6\u16a0\u16b1\U00010000\U00010080\x01\x07\x1b\x7f"
                 "\u0f00\u1200\u13a0\ua000\U0001f9ff\U0001fa70\u2e80\u31c0")

SPM_EDGE_CASES = [
    " ", "  ", "   ", " x", "  x", "   x", "x ", "x  ", " x ", "  x  y  ", "\u2581", "\u2581x", "x\u2581y",
    " \u2581", "\u2581 ", "\u2581\u2581", "\n", " \n", "\n ", "\n\n", " \n \n ", "\t", " \t", "\tx",
    "a\nb", "a \nb", "a\n b", "a\r\nb", "\r\n", "   \n\n   x", "x" + " " * 17 + "y", " " * 33,
    "0", "00", "007", "2024", " 2024", "3.14159", "1,000", "12 34 56", "\u0661\u0662\u0663", "\uff11\uff12",
    "\U0001f600", " \U0001f600", "\U0001f600\U0001f600", "\U0001f468\u200d\U0001f469\u200d\U0001f467",
    "\u4e2d\u6587", " \u4e2d\u6587 ", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\ud55c\uad6d\uc5b4", "caf\u00e9", "cafe\u0301", "\uff21\uff22\uff23", "\ufb01", "\u2460", "\u00bd",
    "x\u00a0y", "\u3000x", "x\u3000\u3000y", "\u200b", "x\u200by", "\ufeffx",
    "<s>", "</s>", "<unk>", "<pad>", "a<s>b", " <s> ", "<s></s>", "<0x41>", "<0xFF>", "<0x41><0x42>",
    "<start_of_turn>user\nhi<end_of_turn>\n", " <h1>x</h1> ", "a\t\t\tb", "\n\n\n", "x  y", "<h1><h1>",
] + list(UNKNOWN_CHARS) + [" " + c for c in UNKNOWN_CHARS] + ["ab" + c + "cd" for c in UNKNOWN_CHARS] + [
    UNKNOWN_CHARS, UNKNOWN_CHARS[:5] * 3]

_SPM_ATOMS = [" ", "  ", "   ", "    ", "\n", "\n\n", " \n", "\n ", "\t", "\r\n", "\u2581", "\u3000",
              "\u00a0", "0", "12", "345", "2024", "3.5", "\U0001f600", "\U0001f44d\U0001f3fd",
              "\u4e2d", "\u6587\u5b57", "\u65e5\u672c", "\ud55c", "\u00e9", "e\u0301", "\uff21",
              "\ufb01", "<s>", "</s>", "<unk>", "<0x41>", "<start_of_turn>", "<end_of_turn>", "<h1>", "</h1>"]


def spm_random_strings(n, seed=0):
    """Seeded strings of Lee-corpus words mixed with whitespace runs,
    digits, emoji, CJK and characters no vocabulary has."""
    rng = random.Random(seed)
    words = " ".join(lee_corpus_lines()).split()
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            k = rng.random()
            if k < 0.45:
                parts.append(rng.choice(words))
            elif k < 0.8:
                parts.append(rng.choice(_SPM_ATOMS))
            else:
                parts.append(rng.choice(UNKNOWN_CHARS))
        out.append("".join(parts))
    return out


def strings(n=20000, seed=0) -> list[str]:
    """At least n test strings: SPM_EDGE_CASES, then today's BPE test corpus
    (oracles.tokenizer_strings.corpus, with its special markers), then
    spm_random_strings for a third of the rest."""
    from oracles.tokenizer_strings import SPECIAL_MARKERS, corpus
    fixed = list(SPM_EDGE_CASES)
    rest = max(0, n - len(fixed))
    ours = rest // 3
    return fixed + corpus(rest - ours, seed=seed, specials=SPECIAL_MARKERS) + spm_random_strings(ours, seed=seed)


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------

def _name(kind, byte_fallback, vocab_size, style, options):
    name = f"{style}-{kind}{'-bf' if byte_fallback else ''}-{vocab_size}-v{FORMAT_VERSION}"
    if options:
        name += "-" + hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:8]
    return name


def train(kind="bpe", byte_fallback=True, vocab_size=DEFAULT_VOCAB_SIZE, out_dir=".", style="llama",
          **options) -> Path:
    """Path to a SentencePiece .model trained on training_text() (made once
    per out_dir and settings). kind: "bpe" or "unigram"; style: a key of
    STYLES; options: further SentencePieceTrainer options, which override
    the style's (e.g. normalization_rule_name="nfkc_cf")."""
    import sentencepiece as spm

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {tuple(STYLES)}, got {style!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = _name(kind, byte_fallback, vocab_size, style, options)
    path = out_dir / f"{name}.model"
    if path.exists():
        return path
    tmp = out_dir / f"{name}.{os.getpid()}.tmp"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()), model_prefix=str(tmp), model_type=kind,
        vocab_size=vocab_size, byte_fallback=byte_fallback, character_coverage=0.9995,
        max_sentence_length=1 << 16, num_threads=1, minloglevel=2, **{**STYLES[style], **options})
    # The trainer writes its output path into the .model; naming it alone
    # makes the file the same wherever and whenever it is trained.
    proto = model_proto(f"{tmp}.model")
    proto.trainer_spec.model_prefix = name
    Path(f"{tmp}.model").write_bytes(proto.SerializeToString())
    os.replace(f"{tmp}.model", path)
    os.remove(f"{tmp}.vocab")
    return path


def build(name, out_dir, vocab_size=DEFAULT_VOCAB_SIZE):
    """(model path, {flavor: HF folder}) of a vocabulary of VOCABS."""
    settings, flavors = VOCABS[name]
    model = train(vocab_size=vocab_size, out_dir=out_dir, **settings)
    return model, {f: hf_folder(model, out_dir, f) for f in flavors}


def model_proto(model_path):
    """The .model parsed with transformers' protobuf classes."""
    from transformers.convert_slow_tokenizer import import_protobuf
    proto = import_protobuf().ModelProto()
    proto.ParseFromString(Path(model_path).read_bytes())
    return proto


# --------------------------------------------------------------------------
# Conversion to tokenizer.json
# --------------------------------------------------------------------------

class _Original:
    """What the classic converters read from a slow tokenizer: the .model
    path, the special tokens and the legacy / add_prefix_space switches."""

    def __init__(self, model_path, legacy=True, add_prefix_space=True):
        import sentencepiece as spm
        self.vocab_file = str(model_path)
        self.legacy = legacy
        self.add_prefix_space = add_prefix_space
        self.sp = spm.SentencePieceProcessor(model_file=str(model_path))
        self.pad_token, self.eos_token, self.bos_token = (self._piece(self.sp.pad_id()), self._piece(
            self.sp.eos_id()), self._piece(self.sp.bos_id()))

    def _piece(self, i):
        return self.sp.id_to_piece(i) if i >= 0 else None

    def convert_ids_to_tokens(self, i):
        return self.sp.id_to_piece(i)


def _extractor(gemma):
    from transformers.convert_slow_tokenizer import GemmaSentencePieceExtractor, SentencePieceExtractor
    from transformers.tokenization_utils_base import generate_merges

    base = SentencePieceExtractor

    class Extractor(base):
        """SentencePieceExtractor with transformers 4's extract(vocab_scores)
        -> (vocab, merges), as the classic converters call it."""

        def extract(self, vocab_scores=None):
            if "model_type" not in inspect.signature(base.extract).parameters:
                return (GemmaSentencePieceExtractor if gemma else base).extract(self, vocab_scores)
            vocab = {p.piece: i for i, p in enumerate(self.proto.pieces)}
            if gemma and "\t" not in vocab:
                vocab["\t"] = vocab.get("<0x09>")
            return vocab, generate_merges(vocab, vocab_scores)

    if "model_type" not in inspect.signature(base.extract).parameters and gemma:
        import sentencepiece as spm

        class GemmaExtractor(Extractor):
            def __init__(self, model):
                super().__init__(model)
                self.sp = spm.SentencePieceProcessor(model_file=model)
        return GemmaExtractor
    return Extractor


def _converted(model_path, flavor):
    """The tokenizers.Tokenizer of a classic converter."""
    import importlib

    # transformers may have bound its name to the function of the same name.
    c = importlib.import_module("transformers.convert_slow_tokenizer")

    if flavor in ("llama", "llama-nonlegacy"):
        conv = type("Converter", (c.LlamaConverter,), {"SpmExtractor": _extractor(False)})
        return conv(_Original(model_path, legacy=flavor == "llama")).converted()
    if flavor == "gemma":
        conv = type("Converter", (c.GemmaConverter,), {"SpmExtractor": _extractor(True)})
        return conv(_Original(model_path)).converted()
    if flavor == "t5":
        conv = type("Converter", (c.SpmConverter,), {"SpmExtractor": _extractor(False)})
        return conv(_Original(model_path)).converted()
    raise ValueError(flavor)


def _special_tokens(proto):
    t = proto.trainer_spec
    out = {}
    for key, i, piece in (("unk_token", t.unk_id, t.unk_piece), ("bos_token", t.bos_id, t.bos_piece),
                          ("eos_token", t.eos_id, t.eos_piece), ("pad_token", t.pad_id, t.pad_piece)):
        if i >= 0:
            out[key] = proto.pieces[i].piece
    return out


def hf_folder(model_path, out_dir, flavor="llama") -> Path:
    """A folder with tokenizer.json, tokenizer_config.json and
    special_tokens_map.json saved by transformers for the .model converted
    as `flavor` (a member of FLAVORS) does, plus tokenizer.model. Made once
    per out_dir."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
    model_path = Path(model_path)
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()[:12]
    folder = Path(out_dir) / f"{model_path.stem}-{digest}-{flavor}"
    if (folder / "tokenizer.json").exists():
        return folder
    tmp = folder.with_name(folder.name + f".{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(model_path, tmp / "tokenizer.model")
    _save(model_path, flavor, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def _save(model_path, flavor, folder):
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    proto = model_proto(model_path)
    specials = _special_tokens(proto)
    # As the families add them: <s> first where there is one, else </s> last (T5).
    if "bos_token" in specials:
        specials["add_bos_token"] = True
    else:
        specials["add_eos_token"] = True
    if flavor in ("llama-hf5", "spm"):
        # transformers 5 builds these from the .model alone; PreTrainedTokenizerFast
        # is its TokenizersBackend, which follows the .model's normalizer spec.
        cls = LlamaTokenizer if flavor == "llama-hf5" else PreTrainedTokenizerFast
        tok = cls.from_pretrained(str(folder), **specials)
        if not getattr(tok, "is_fast", False):
            raise RuntimeError(f"the {flavor!r} flavor needs transformers 5, which builds a tokenizer.json "
                               "from a .model alone")
    else:
        # The classic converters were run by PreTrainedTokenizerFast on a
        # slow tokenizer; it takes the converted tokenizer as is.
        tok = PreTrainedTokenizerFast(tokenizer_object=_converted(model_path, flavor), **specials)
    tok.save_pretrained(str(folder))
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    if not spec.get("model"):
        raise RuntimeError(f"transformers saved no model for {model_path} as {flavor}")
