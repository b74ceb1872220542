"""Tokenizer for HuggingFace ``tokenizer.json`` files (BPE and Unigram models).

This reimplements the encode/decode pipeline of the HuggingFace ``tokenizers``
library (added tokens -> normalizer -> pre-tokenizer -> model ->
post-processor, and the decoder chain) so that token ids match it exactly.
Each stage has its module (added_tokens, normalizers with precompiled,
pre_tokenizers, the models bpe and unigram, post_processors, decoders;
incremental streams decode); this one loads the files and runs the stages.

Both families of files in use are covered: byte-level BPE (GPT-2, Llama 3,
Qwen, SmolLM) and SentencePiece-style vocabularies converted by
transformers (Llama 2, Mistral, TinyLlama, Gemma, Phi-3, T5): BPE with
``byte_fallback`` and ``<0xXX>`` tokens, the Unigram model, the Precompiled
normalizer of SentencePiece's own rules, Metaspace with every
``prepend_scheme``, and the Replace/ByteFallback/Fuse/Strip/Metaspace
decoders.  Any other component is refused with an error naming it, because
an approximation would silently produce different ids.

Usage::

    tok = Tokenizer.from_pretrained("path/to/model")   # tokenizer.json + tokenizer_config.json
    ids = tok.encode("Hello world")
    text = tok.decode(ids)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    stream = tok.incremental_decoder()
    for i in generated_ids:
        print(stream.add(i), end="")
    print(stream.flush())

Hot paths: pre-tokens are cached (raw piece -> ids), and BPE merging runs in
the Cython module ``_bpe`` (for byte-level models directly on UTF-8 bytes).
The Unigram search is Python over a dictionary of piece prefixes.

Known limits of exactness:

* Character classes (``\\p{L}``, ``\\s`` ...) and grapheme clusters (which
  the Precompiled normalizer works on) come from the ``regex`` package and
  ``unicodedata``, whose Unicode versions differ from the Rust crates used
  by ``tokenizers``.  Text that contains characters assigned only in the newest
  Unicode versions may tokenize differently.
* Offsets are not tracked (only ids are produced), except for the one place
  where ``tokenizers`` lets offsets change ids: Metaspace with
  ``prepend_scheme="first"``, where the needed alignment is approximated for
  normalizers that rewrite the first character.
* A Replace normalizer whose regex matches the empty string at the start of
  a piece: ``tokenizers`` inserts the replacement twice there (and can then
  crash); fastllm inserts it once.
"""
import contextlib
import gc
import json
import numbers
import os
import re

from . import _bpe, compact
from ..spec.errors import ModelFileError
from ..spec.files import read_bounded
from . import decoders, normalizers, post_processors, pre_tokenizers
from .added_tokens import AddedToken, Matcher
from .bpe import BPE
from .chars import byte_level
from .chars import bytes_to_unicode as _bytes_to_unicode  # noqa: F401  (tests import it from here)
from .errors import TokenizerError, UnsupportedTokenizerError
from .incremental import IncrementalDecoder
from .unigram import Unigram

__all__ = ["Tokenizer", "TokenizerError", "UnsupportedTokenizerError", "IncrementalDecoder"]

_CACHE_LIMIT = 200_000   # pre-tokens whose ids are cached
_CACHED_PIECE_CHARS = 256   # longer pre-tokens are encoded afresh each time

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


def _token_str(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


# Bounds on what is read; the largest tokenizer.json files in use are
# tens of megabytes, their configs and templates far less.
TOKENIZER_JSON_LIMIT = 256 << 20
CONFIG_JSON_LIMIT = 32 << 20


@contextlib.contextmanager
def _collector_paused():
    """No garbage collection while a tokenizer is read: parsing a large
    tokenizer.json makes millions of objects, none of them garbage, and the
    collector's passes over them as they are made cost as much as the parse."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read_json(path, what, limit=CONFIG_JSON_LIMIT):
    data = read_bounded(path, limit, what)
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(path, f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise ModelFileError(path, f"{what} is nested too deeply") from None
    bad = _lone_surrogate(data, value)
    if bad is not None:
        raise ModelFileError(path, f"{what} holds the string {bad!r} with a lone surrogate "
                                   "(a \\uD800-\\uDFFF escape without its pair), which is not text")
    return value


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(data: bytes, value):
    """A string of value that holds a lone surrogate, else None. JSON can
    write one as an escape; only files with such escapes are walked."""
    if not _SURROGATE_ESCAPE.search(data):
        return None
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return v[:40]
    return None


def _read_text(path, what):
    data = read_bounded(path, CONFIG_JSON_LIMIT, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelFileError(path, f"{what} is not UTF-8 text: {e}") from None


def _check_text(text, what="text"):
    if not isinstance(text, str):
        raise TypeError(f"{what} must be str, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise TokenizerError(
            f"{what} contains the lone surrogate U+{ord(bad):04X} at index {e.start}; "
            "surrogates are not Unicode characters and cannot be tokenized "
            "(decode the source bytes with errors='replace' or fix the string)") from None


def _build_model(d, where):
    kind = d.get("type", "BPE")
    if kind == "Unigram":
        return Unigram(d, where)
    if kind == "BPE":
        return BPE(d, where)
    raise UnsupportedTokenizerError(
        f"{where}: model type {kind!r} is not supported; fastllm implements BPE and Unigram models")


def _normalizers(norm):
    yield norm
    for item in getattr(norm, "items", ()):
        yield from _normalizers(item)


def _max_chars_per_token(tok):
    if tok.model.fuse_unk or any(isinstance(n, (normalizers.Strip, normalizers.Replace))
                                 for n in _normalizers(tok.normalizer)):
        return None
    longest = max(max(map(len, tok.model.vocab), default=1), max(map(len, tok._added), default=1))
    # A Unicode normalization composes at most a few characters into one.
    return longest * (4 if tok.normalizer is not None else 1)


class Tokenizer:
    """A tokenizer loaded from a HuggingFace ``tokenizer.json``.

    Encoding and decoding give the same ids and text as the ``tokenizers``
    library on the same file; ``from_pretrained`` also applies what
    transformers takes from ``tokenizer_config.json`` (special-token names,
    add_bos_token/add_eos_token, the chat template).
    """

    def __init__(self, spec, path=None):
        where = str(path) if path is not None else "tokenizer.json"
        try:
            self._build(spec, where)
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise TokenizerError(f"{where}: malformed tokenizer definition ({type(e).__name__}: {e})") from None
        self.path = path
        self.chat_template = None
        self.bos_token = None
        self.eos_token = None
        self.special_tokens_map = {}
        self.config = {}

    # ---- construction -------------------------------------------------

    def _build(self, spec, where):
        if not isinstance(spec, dict):
            raise TokenizerError(f"{where}: top level must be a JSON object")
        version = spec.get("version", "1.0")
        if version != "1.0":
            raise UnsupportedTokenizerError(f"{where}: unknown tokenizer.json version {version!r}")
        if "model" not in spec or not isinstance(spec["model"], dict):
            raise TokenizerError(f"{where}: no 'model' section")
        self.model = _build_model(spec["model"], f"{where}: model")
        self.normalizer = normalizers.build(spec.get("normalizer"), f"{where}: normalizer")
        steps = pre_tokenizers.build(spec.get("pre_tokenizer"), f"{where}: pre_tokenizer")
        self.post_processor = post_processors.build(spec.get("post_processor"), f"{where}: post_processor")
        self.decoder = decoders.build(spec.get("decoder"), f"{where}: decoder")
        self._truncation = spec.get("truncation")
        self._padding = spec.get("padding")
        self._check_truncation_padding(where)

        # When ByteLevel is the last pre-tokenizer step its character mapping
        # is left to the model, which then works on UTF-8 bytes and caches by
        # the unmapped piece; other ByteLevel steps map their pieces themselves.
        self._deferred_byte_level = bool(steps) and isinstance(steps[-1], pre_tokenizers.ByteLevel)
        self._steps = steps
        self._byte_maps = {i for i, s in enumerate(steps) if isinstance(s, pre_tokenizers.ByteLevel)
                           and not (i == len(steps) - 1 and self._deferred_byte_level)}
        self._need_z = any(isinstance(s, pre_tokenizers.Metaspace) and s.prepend_scheme == "first"
                           for s in steps)
        self._cache = {}
        self._miss = None

        self._build_added(spec.get("added_tokens") or [], where)

    def _check_truncation_padding(self, where):
        t = self._truncation
        if t is not None:
            if not isinstance(t, dict) or "max_length" not in t:
                raise TokenizerError(f"{where}: malformed truncation {t!r}")
            if t.get("direction", "Right") not in ("Right", "Left"):
                raise TokenizerError(f"{where}: unknown truncation direction {t.get('direction')!r}")
        p = self._padding
        if p is not None:
            if not isinstance(p, dict):
                raise TokenizerError(f"{where}: malformed padding {p!r}")
            strat = p.get("strategy", "BatchLongest")
            if not (strat == "BatchLongest" or (isinstance(strat, dict) and "Fixed" in strat)):
                raise TokenizerError(f"{where}: unknown padding strategy {strat!r}")

    def _build_added(self, entries, where):
        self._added = {}          # content -> AddedToken, in insertion order
        self._added_by_id = {}
        self._max_added_id = None
        self._special_contents = set()
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or not isinstance(e.get("content"), str):
                raise TokenizerError(f"{where}: added_tokens[{i}] is malformed: {e!r}")
            self._add_token(e["content"], bool(e.get("special", False)), e)
        self._refresh_added()

    def _add_token(self, content, special, flags=None):
        """Add a token; flags: its object in tokenizer.json or tokenizer_config.json."""
        flags = flags or {}
        single_word, lstrip, rstrip = (bool(flags.get(k, False)) for k in ("single_word", "lstrip", "rstrip"))
        normalized = bool(flags.get("normalized", not special))
        if not content:
            return
        # Ids are assigned the way tokenizers does when it loads a file: an
        # existing (added or model) id is reused, otherwise the next id after
        # the model vocabulary and previous added tokens.  The "id" field in
        # the file is not consulted, exactly as in tokenizers.
        tid = self._added[content].id if content in self._added else self.model.vocab.get(content)
        if tid is None:
            model_size = len(self.model.vocab)
            mx = self._max_added_id
            if mx is None:
                tid = model_size
            else:
                tid = mx + 1 if (mx >= model_size or model_size == 0) else model_size
        tok = AddedToken(content, tid, single_word, lstrip, rstrip, normalized, special)
        if normalized and self.normalizer is not None:
            tok.text = self.normalizer.normalize(content)
        self._added[content] = tok
        self._added_by_id[tid] = tok
        if self._max_added_id is None or tid > self._max_added_id:
            self._max_added_id = tid
        if special:
            self._special_contents.add(content)

    def _refresh_added(self):
        toks = list(self._added.values())
        self._raw_matcher = Matcher([(t.content, t) for t in toks if not t.normalized])
        norm = self.normalizer
        self._norm_matcher = Matcher(
            [(t.text if norm else t.content, t) for t in toks if t.normalized])
        self.special_token_ids = {t.id for t in toks if t.special}

    @classmethod
    def from_file(cls, path):
        """Load a tokenizer.json file.

        A merge naming a token that is not in the vocabulary is reported by
        the first encode(), or by validate().
        """
        path = os.fspath(path)
        with _collector_paused():
            spec = compact.read_spec(path, lambda: _read_json(path, "tokenizer.json", TOKENIZER_JSON_LIMIT))
            return cls(spec, path)

    @classmethod
    def from_str(cls, json_text):
        """Build a tokenizer from the text of a tokenizer.json."""
        try:
            spec = json.loads(json_text)
        except ValueError as e:
            raise TokenizerError(f"tokenizer.json text is not valid JSON: {e}") from None
        except RecursionError:
            raise TokenizerError("tokenizer.json text is nested too deeply") from None
        if _lone_surrogate(json_text.encode("utf-8", "surrogatepass") if isinstance(json_text, str)
                           else json_text, spec) is not None:
            raise TokenizerError("tokenizer.json text holds a lone surrogate (a \\uD800-\\uDFFF escape "
                                 "without its pair), which is not text")
        return cls(spec)

    @classmethod
    def from_pretrained(cls, folder):
        """Load tokenizer.json, tokenizer_config.json and chat templates from a folder.

        Follows transformers: special-token names come from
        tokenizer_config.json (or the legacy special_tokens_map.json), named
        special tokens missing from tokenizer.json are added, and a
        chat_template.jinja file overrides the config's template.  Whether
        BOS/EOS are added is up to tokenizer.json's post-processor (transformers
        ignores add_bos_token/add_eos_token when tokenizer.json exists).
        """
        folder = os.fspath(folder)
        if os.path.isfile(folder) and folder.endswith(".json"):
            return cls.from_file(folder)
        if not os.path.isdir(folder):
            raise ModelFileError(folder, "tokenizer folder not found")
        tj = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(tj):
            if os.path.exists(os.path.join(folder, "tokenizer.model")):
                raise ModelFileError(tj, "tokenizer.json not found: fastllm reads the HuggingFace tokenizer.json, "
                                         "not SentencePiece's tokenizer.model; transformers writes one with "
                                         "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)")
            raise ModelFileError(tj, "tokenizer.json not found (fastllm needs the HuggingFace "
                                     "tokenizer.json file; vocab.json/merges.txt alone are not supported)")
        tok = cls.from_file(tj)
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        cfg = {}
        if os.path.exists(cfg_path):
            cfg = _read_json(cfg_path, "tokenizer_config.json")
            if not isinstance(cfg, dict):
                raise ModelFileError(cfg_path, "tokenizer_config.json must contain a JSON object")
        tok._apply_config(cfg, folder, cfg_path)
        return tok

    def _apply_config(self, cfg, folder, cfg_path):
        self.config = cfg
        named = {k: cfg.get(k) for k in _NAMED_SPECIALS if cfg.get(k) is not None}
        stm = os.path.join(folder, "special_tokens_map.json")
        if "added_tokens_decoder" not in cfg and os.path.exists(stm):
            m = _read_json(stm, "special_tokens_map.json")
            if isinstance(m, dict):
                for k in _NAMED_SPECIALS:
                    if m.get(k) is not None:
                        named[k] = m[k]

        # transformers adds the added_tokens_decoder entries and the named
        # special tokens that tokenizer.json lacks.
        changed = False
        atd = cfg.get("added_tokens_decoder") or {}
        if not isinstance(atd, dict):
            raise ModelFileError(cfg_path, "added_tokens_decoder must be an object")
        try:
            entries = sorted(atd.items(), key=lambda kv: int(kv[0]))
        except (TypeError, ValueError):
            raise ModelFileError(cfg_path, "added_tokens_decoder keys must be token ids") from None
        for _, t in entries:
            if isinstance(t, dict) and t.get("content") and t["content"] not in self._added:
                self._add_token(t["content"], bool(t.get("special", False)), t)
                changed = True
        self.special_tokens_map = {}
        for k, v in named.items():
            s = _token_str(v)
            if not isinstance(s, str):
                raise ModelFileError(cfg_path, f"{k} must be a string or a token object, got {v!r}")
            self.special_tokens_map[k] = s
            if s not in self._added:
                self._add_token(s, True, v if isinstance(v, dict) else None)
                changed = True
        if changed:
            self._refresh_added()
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token = self.special_tokens_map.get("eos_token")

        # add_bos_token/add_eos_token are deliberately not applied: when a
        # tokenizer.json exists, transformers (5.x) drops them and lets the
        # file's post-processor decide which special tokens encode() adds.

        template = cfg.get("chat_template")
        if isinstance(template, list):
            try:
                template = {t["name"]: t["template"] for t in template}
            except (KeyError, TypeError):
                raise ModelFileError(cfg_path, "chat_template list entries need 'name' and 'template'") from None
        templates = {}
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.exists(jinja):
            templates["default"] = _read_text(jinja, "chat_template.jinja")
        extra_dir = os.path.join(folder, "additional_chat_templates")
        if os.path.isdir(extra_dir):
            for name in sorted(os.listdir(extra_dir)):
                if name.endswith(".jinja"):
                    templates[name[:-len(".jinja")]] = _read_text(os.path.join(extra_dir, name), name)
        if len(templates) == 1 and "default" in templates:
            template = templates["default"]
        elif templates:
            template = templates
        self.chat_template = template

    def validate(self):
        """Build the lazily built structures now, raising on a broken merges list."""
        self.model.validate()
        return self

    # ---- vocabulary ---------------------------------------------------

    @property
    def vocab_size(self):
        """Size of the vocabulary including added tokens (len(tokenizer) in transformers)."""
        n = len(self.model.vocab)
        vocab = self.model.vocab
        for content in self._added:
            if content not in vocab:
                n += 1
        return n

    def __len__(self):
        return self.vocab_size

    @property
    def max_chars_per_token(self):
        """An upper bound on the characters of input text one token stands
        for, so that a caller can refuse text that cannot fit some number of
        tokens without tokenizing it; None where no bound holds (a
        normalizer that deletes text, fused unknown tokens)."""
        if getattr(self, "_max_chars", 0) == 0:
            self._max_chars = _max_chars_per_token(self)
        return self._max_chars

    def get_vocab(self):
        v = dict(self.model.vocab)
        for content, t in self._added.items():
            v[content] = t.id
        return v

    def token_to_id(self, token):
        t = self._added.get(token)
        if t is not None:
            return t.id
        return self.model.vocab.get(token)

    def id_to_token(self, id):
        t = self._added_by_id.get(id)
        if t is not None:
            return t.text
        return self.model.vocab_r.get(id)

    def convert_ids_to_tokens(self, ids):
        return [self.id_to_token(i) for i in ids]

    @property
    def added_tokens(self):
        """Added tokens by id."""
        return dict(sorted(self._added_by_id.items()))

    @property
    def bos_token_id(self):
        return self.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_id(self):
        return self.token_to_id(self.eos_token) if self.eos_token is not None else None

    # ---- encoding -----------------------------------------------------

    def _piece_encoder(self):
        if self._miss is None:
            model = self.model
            if self._deferred_byte_level and model.byte_ids() is not None:
                self._miss = model.byte_miss()
            elif self._deferred_byte_level:
                tokenize = model.tokenize
                self._miss = lambda piece: tokenize(byte_level(piece))
            else:
                self._miss = model.tokenize
        return self._miss

    def _pre_tokenize(self, segs):
        """Pieces (model input strings) of normalized text segments."""
        z = self._need_z
        pieces = segs
        for i, step in enumerate(self._steps):
            pieces = step.split_z(pieces) if z else step.split(pieces)
            if i in self._byte_maps:
                pieces = step.map_z(pieces) if z else step.map(pieces)
        return [p for p, _ in pieces] if z else pieces

    def _encode_text(self, text):
        """Ids of text without post-processing (add_special_tokens=False)."""
        if not text:
            return []
        need_z = self._need_z
        # 1. added tokens matched on the raw text
        raw = self._raw_matcher.split(text) if self._raw_matcher.active else None
        if raw is None:
            segs = [(text, 1 if need_z else 0)]
        else:
            segs = [(tok if tok is not None else text[a:b], 1 if (need_z and a == 0) else 0)
                    for a, b, tok in raw if b > a]
        # 2. normalize text segments, then match normalized added tokens
        norm = self.normalizer
        nm = self._norm_matcher if self._norm_matcher.active else None
        items = []   # AddedToken or (text, z)
        for seg, z in segs:
            if isinstance(seg, AddedToken):
                items.append(seg)
                continue
            if norm is not None:
                if need_z:
                    seg, z = norm.normalize_z(seg, z)
                else:
                    seg = norm.normalize(seg)
            if not seg:
                continue
            sp = nm.split(seg) if nm is not None else None
            if sp is None:
                items.append((seg, z))
            else:
                for a, b, tok in sp:
                    if b > a:
                        items.append(tok if tok is not None else (seg[a:b], z - a if a < z else 0))
        # 3. pre-tokenize and run the model on each run of text segments
        ids = []
        miss = self._piece_encoder()
        run = []
        for it in items:
            if isinstance(it, AddedToken):
                if run:
                    ids.extend(self._encode_run(run, miss))
                    run = []
                ids.append(it.id)
            else:
                run.append(it)
        if run:
            ids.extend(self._encode_run(run, miss))
        return ids

    def _encode_run(self, run, miss):
        segs = run if self._need_z else [s for s, _ in run]
        pieces = self._pre_tokenize(segs)
        if not pieces or max(map(len, pieces)) <= _CACHED_PIECE_CHARS:
            return _bpe.encode_pieces(pieces, self._cache, miss, _CACHE_LIMIT)
        # Without a splitting pre-tokenizer (SentencePiece-style files) a
        # piece is a whole text: such pieces rarely repeat, and caching them
        # would hold every prompt.
        ids = []
        short = []
        for p in pieces:
            if len(p) <= _CACHED_PIECE_CHARS:
                short.append(p)
                continue
            if short:
                ids.extend(_bpe.encode_pieces(short, self._cache, miss, _CACHE_LIMIT))
                short = []
            ids.extend(miss(p))
        if short:
            ids.extend(_bpe.encode_pieces(short, self._cache, miss, _CACHE_LIMIT))
        return ids

    def _post(self, ids, add_special_tokens):
        t = self._truncation
        if t is not None:
            added = self.post_processor.added() if (add_special_tokens and self.post_processor) else 0
            room = int(t["max_length"]) - added
            # tokenizers subtracts in unsigned arithmetic: a max_length below
            # the number of special tokens wraps around and truncates nothing.
            if 0 <= room < len(ids):
                ids = ids[len(ids) - room:] if t.get("direction", "Right") == "Left" else ids[:room]
        if add_special_tokens and self.post_processor is not None:
            ids = self.post_processor.process(ids)
        return list(ids)

    def _pad(self, seqs, batch):
        p = self._padding
        if p is None:
            return seqs
        strat = p.get("strategy", "BatchLongest")
        if isinstance(strat, dict):
            target = int(strat["Fixed"])
        else:
            target = max((len(s) for s in seqs), default=0)
        multiple = p.get("pad_to_multiple_of")
        if multiple:
            target = ((target + multiple - 1) // multiple) * multiple
        pad_id = int(p.get("pad_id", 0))
        left = p.get("direction", "Right") == "Left"
        out = []
        for s in seqs:
            n = target - len(s)
            if n > 0:
                s = [pad_id] * n + s if left else s + [pad_id] * n
            out.append(s)
        return out

    def encode(self, text, add_special_tokens=True):
        """Token ids of text, as tokenizers' Tokenizer.encode(text).ids."""
        _check_text(text)
        ids = self._post(self._encode_text(text), add_special_tokens)
        if self._padding is not None:
            ids = self._pad([ids], False)[0]
        return ids

    def encode_batch(self, texts, add_special_tokens=True):
        """encode() for each text; padding from tokenizer.json applies across the batch."""
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a list of strings, not a single string")
        out = []
        for i, text in enumerate(texts):
            _check_text(text, f"texts[{i}]")
            out.append(self._post(self._encode_text(text), add_special_tokens))
        return self._pad(out, True)

    def tokenize(self, text, add_special_tokens=False):
        """Token strings of text."""
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens=add_special_tokens))

    def __call__(self, text, add_special_tokens=True):
        return self.encode(text, add_special_tokens=add_special_tokens)

    # ---- decoding -----------------------------------------------------

    def _tokens_for_decode(self, ids, skip_special_tokens, keep=()):
        """The token texts decode() joins; with skip_special_tokens, the
        special tokens whose texts are in keep are kept all the same."""
        out = []
        added = self._added_by_id
        vocab_r = self.model.vocab_r
        specials = self._special_contents
        for i in ids:
            t = added.get(i)
            s = t.text if t is not None else vocab_r.get(i)
            if s is None:
                continue   # unknown ids are dropped, as tokenizers does
            if skip_special_tokens and s in specials and s not in keep:
                continue
            out.append(s)
        return out

    def decode(self, ids, skip_special_tokens=False):
        """Text of token ids, as tokenizers' Tokenizer.decode."""
        if isinstance(ids, numbers.Integral):
            ids = [ids]
        bad = next((i for i in ids if not isinstance(i, numbers.Integral)), None)
        if bad is not None:
            raise TypeError(f"token ids must be integers, got {bad!r}")
        ids = [int(i) for i in ids]   # unknown ids, negative ones too, are dropped below
        return self._join_tokens(self._tokens_for_decode(ids, skip_special_tokens))

    def _join_tokens(self, tokens):
        if self.decoder is None:
            return " ".join(tokens)
        return "".join(self.decoder.decode_chain(tokens))

    def decode_batch(self, seqs, skip_special_tokens=False):
        return [self.decode(s, skip_special_tokens) for s in seqs]

    def incremental_decoder(self, skip_special_tokens=True, keep=()):
        """A streaming decoder: .add(token_id) returns newly completed text.
        keep: texts of special tokens decoded even when the others are
        skipped (the markers of a tool call)."""
        return IncrementalDecoder(self, skip_special_tokens, keep)

    # ---- chat templates -----------------------------------------------

    def apply_chat_template(self, messages, add_generation_prompt=False, tools=None, tokenize=False,
                            chat_template=None, documents=None, continue_final_message=False,
                            **template_kwargs):
        """Render a conversation with the chat template, as transformers does.

        Returns the text, or its ids when tokenize=True (encoded with
        add_special_tokens=False, so special tokens written by the template
        are recognised and nothing else is added).
        """
        # here: jinja2 is only loaded by the first conversation rendered
        from .chat_template import get_template, render_chat
        template = get_template(self.chat_template, chat_template, tools)
        text = render_chat(template, messages, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           special_tokens_map=self.special_tokens_map, **template_kwargs)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def __repr__(self):
        return (f"Tokenizer(vocab_size={self.vocab_size}, path={self.path!r}, "
                f"bos_token={self.bos_token!r}, eos_token={self.eos_token!r})")


