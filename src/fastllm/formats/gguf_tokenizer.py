"""tokenizer.json and tokenizer_config.json from a GGUF file's
tokenizer.ggml.* metadata: the vocabulary, the merges, and the HF pipeline
(normalizer, pre-tokenizer, post-processor, decoder) that the file's
pre-tokenizer name stands for.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Optional

from ..spec.family import require
from .gguf_file import ConversionError

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


_GPT2_BYTELEVEL_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_GPT2_BYTELEVEL_POST = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
_GPT2_BYTELEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
_PLAIN_BYTELEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
_SPLIT_BYTELEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}

# The split regexes as the families' own tokenizer.json files spell them.
# llama.cpp runs its own adaptations of these (see PRE_TOKENIZERS below).
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_QWEN2_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Tekken and o200k: a word is an optional upper-case run then a lower-case
# run (or an upper-case run alone), so "CamelCase" splits at the capitals.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


class PreTokenizer(NamedTuple):
    """The HF pipeline a tokenizer.ggml.pre name stands for."""
    normalizer: Optional[dict]
    pre_tokenizer: Optional[dict]
    post_processor: Optional[dict]
    decoder: dict
    ignore_merges: bool
    # What llama.cpp assumes when the file has no tokenizer.ggml.add_bos_token.
    add_bos: bool = False


_GPT2 = PreTokenizer(None, _GPT2_BYTELEVEL_PRE, _GPT2_BYTELEVEL_POST, _GPT2_BYTELEVEL_DECODER, False)
_QWEN2 = PreTokenizer({"type": "NFC"}, {"type": "Sequence", "pretokenizers": [_split(_QWEN2_SPLIT), _PLAIN_BYTELEVEL]},
                      _PLAIN_BYTELEVEL, _PLAIN_BYTELEVEL, False)
_LLAMA3 = PreTokenizer(None, {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_SPLIT), _SPLIT_BYTELEVEL]},
                       _GPT2_BYTELEVEL_POST, _GPT2_BYTELEVEL_DECODER, True, add_bos=True)


def _tiktoken_style(regex: str, ignore_merges: bool, add_bos: bool = False) -> PreTokenizer:
    # The pipeline transformers' tiktoken converter writes (Mistral's tekken
    # files and Xenova's gpt-4o file have this shape).
    return PreTokenizer(None, {"type": "Sequence", "pretokenizers": [_split(regex), _SPLIT_BYTELEVEL]},
                        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
                        _GPT2_BYTELEVEL_DECODER, ignore_merges, add_bos)


# tokenizer.ggml.pre -> the pipeline of the HF tokenizer.json that llama.cpp's
# converter gives that name (convert_hf_to_gguf_update.py lists the source
# repositories). ignore_merges and the add_bos default are what llama.cpp's
# vocabulary code sets for the name. Where the HF file normalizes (NFC for
# Qwen and OLMo) the normalizer is kept, as transformers runs it; llama.cpp
# does not normalize. Nor does it run these regexes as written: its tekken
# and gpt-4o ones leave combining marks out of the letter classes.
# benchmarks/bpe_gguf_pretokenizers.py counts where llama.cpp parts from
# these pipelines: on non-NFC text, and for tekken and gpt-4o where marks
# follow letters; nowhere else on oracles.tokenizer_strings.
PRE_TOKENIZERS = {
    # SmolLM / StarCoder style: every digit on its own, then GPT-2's regex.
    "smollm": _GPT2._replace(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _GPT2_BYTELEVEL_PRE]}),
    "gpt-2": _GPT2,
    # llama.cpp's own "default" splits differently, but a file that says
    # "default" names no HF pipeline; GPT-2's is what transformers uses too.
    "default": _GPT2,
    # OLMo 1.x: GPT-NeoX's tokenizer, GPT-2's regex after NFC.
    "olmo": _GPT2._replace(normalizer={"type": "NFC"}),
    "qwen2": _QWEN2,
    # A qwen2 vocabulary with DeepSeek's special tokens.
    "deepseek-r1-qwen": _QWEN2,
    # Qwen3.5 keeps combining marks with their letters.
    "qwen35": _QWEN2._replace(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        _split(_QWEN35_SPLIT), _PLAIN_BYTELEVEL]}),
    "llama-bpe": _LLAMA3,
    # Falcon 3 has Llama 3's pipeline.
    "falcon3": _LLAMA3,
    # Smaug (a Llama 3 fine-tune) ships a tokenizer.json without ignore_merges.
    "smaug-bpe": _LLAMA3._replace(ignore_merges=False, add_bos=False),
    # Mistral Nemo, Ministral, Pixtral's text model.
    "tekken": _tiktoken_style(_TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
    # o200k (Phi-4).
    "gpt-4o": _tiktoken_style(_GPT4O_SPLIT, ignore_merges=False),
}
# Names llama.cpp treats as spellings of the same pipeline ("gpt2" is what
# older fastllm writers wrote for "gpt-2").
PRE_TOKENIZERS["llama3"] = PRE_TOKENIZERS["llama-v3"] = PRE_TOKENIZERS["llama-bpe"]
PRE_TOKENIZERS["gpt2"] = PRE_TOKENIZERS["gpt-2"]

SUPPORTED_PRE_TOKENIZERS = tuple(sorted(PRE_TOKENIZERS))


def _added_token(token_id: int, content: str, special: bool) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": special}


def _template_post_processor(bos: Optional[str], bos_id, eos: Optional[str], eos_id) -> dict:
    single, pair, specials = [], [], {}
    if bos is not None:
        single.append({"SpecialToken": {"id": bos, "type_id": 0}})
        pair.append({"SpecialToken": {"id": bos, "type_id": 0}})
        specials[bos] = {"id": bos, "ids": [bos_id], "tokens": [bos]}
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    pair.append({"Sequence": {"id": "A", "type_id": 0}})
    if eos is not None:
        single.append({"SpecialToken": {"id": eos, "type_id": 0}})
        pair.append({"SpecialToken": {"id": eos, "type_id": 0}})
        specials[eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
    if bos is not None:
        pair.append({"SpecialToken": {"id": bos, "type_id": 1}})
    pair.append({"Sequence": {"id": "B", "type_id": 1}})
    if eos is not None:
        pair.append({"SpecialToken": {"id": eos, "type_id": 1}})
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}


def _byte_level_bpe(md: dict, path: Path, vocab: dict) -> tuple:
    """(pipeline, model) of a tokenizer.ggml.model "gpt2" vocabulary."""
    pre = md.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise ConversionError(
            path, f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})")
    pipeline = PRE_TOKENIZERS[pre]
    merge_pairs = []
    # A vocabulary of single bytes and specials has no merges, and a
    # writer may then leave the key out.
    for m in md.get("tokenizer.ggml.merges") or []:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ConversionError(path, f"malformed merge {m!r}")
        merge_pairs.append(parts)
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "ignore_merges": pipeline.ignore_merges, "vocab": vocab, "merges": merge_pairs}
    return pipeline, model


def _spm_pipeline(add_space_prefix: bool) -> PreTokenizer:
    """The legacy Llama 2 / Mistral / TinyLlama tokenizer.json pipeline
    (Gemma's without the space prefix). Its normalizer prepends "▁" to every
    stretch of text between added tokens, as llama.cpp prefixes a space to
    every fragment after a special token."""
    spaces = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if not add_space_prefix:
        return PreTokenizer(spaces, None, None, {"type": "Sequence", "decoders": decoders}, False, add_bos=True)
    return PreTokenizer(
        {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, spaces]}, None, None,
        {"type": "Sequence", "decoders": decoders + [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        False, add_bos=True)


MAX_SPM_TOKEN_CHARS = 1024
# The merges rebuilt from a SentencePiece vocabulary hold at most this many
# times its characters (real vocabularies: about 2; pieces of 1 to 1000
# "▁" would give 666 times, half a million merges of 330 million characters).
MAX_SPM_MERGE_GROWTH = 16


def merges_by_score(tokens: list, scores: list, path=None) -> list:
    """BPE merges that replay llama.cpp's SentencePiece tokenizer: it joins
    the adjacent pair whose concatenation is the vocabulary token of highest
    score (leftmost first on a tie), so every split of a token into two
    tokens is a merge, ranked by the joined token's score. Equal scores of
    different tokens are ranked by id, where llama.cpp would go by position;
    SentencePiece BPE vocabularies give every piece its own score.
    ConversionError (naming path) past MAX_SPM_MERGE_GROWTH."""
    ids = {}
    for i, tok in enumerate(tokens):
        ids[tok] = i
    budget = MAX_SPM_MERGE_GROWTH * (sum(len(t) for t in ids) + 1024)
    ranked = []
    for i, tok in enumerate(tokens):
        if ids[tok] != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, cut, left, right))
                budget -= len(tok)
        if budget < 0:
            raise ConversionError(path, f"the SentencePiece vocabulary's tokens split into more merges than "
                                        f"{MAX_SPM_MERGE_GROWTH} times its characters (at token {i}, "
                                        f"{len(ranked)} merges): not a vocabulary fastllm can rebuild as BPE")
    ranked.sort(key=lambda r: r[:3])
    return [[left, right] for _, _, _, left, right in ranked]


def _sentencepiece_bpe(md: dict, path: Path, vocab: dict, tokens: list, types: list, unk: Optional[str]) -> tuple:
    """(pipeline, model) of a tokenizer.ggml.model "llama" vocabulary: an HF
    BPE with merges from the scores, and byte fallback where the vocabulary
    has <0xXX> tokens."""
    scores = require(md, "tokenizer.ggml.scores", path)
    if not isinstance(scores, list) or not all(type(x) in (int, float) and math.isfinite(x) for x in scores):
        raise ConversionError(path, "'tokenizer.ggml.scores' should be a list of finite numbers")
    if len(scores) != len(tokens):
        raise ConversionError(path, f"{len(tokens)} tokens but {len(scores)} scores")
    add_space_prefix = md.get("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(add_space_prefix, bool):
        raise ConversionError(path, "'tokenizer.ggml.add_space_prefix' should be bool")
    byte_tokens = {tokens[i] for i, t in enumerate(types) if t == TOKEN_BYTE}
    byte_fallback = bool(byte_tokens)
    if byte_fallback and byte_tokens != {f"<0x{b:02X}>" for b in range(256)}:
        raise ConversionError(path, f"the vocabulary has {len(byte_tokens)} byte tokens, not <0x00>..<0xFF>")
    # Every cut of every token is looked up: bound the work a file can ask
    # for (SentencePiece pieces are 16 characters by default).
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]), default=None)
    if longest is not None and len(tokens[longest]) > MAX_SPM_TOKEN_CHARS:
        raise ConversionError(path, f"token {longest} has {len(tokens[longest])} characters; a SentencePiece "
                                    f"vocabulary's are at most {MAX_SPM_TOKEN_CHARS} here")
    pipeline = _spm_pipeline(add_space_prefix)
    model = {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": byte_fallback,
             "ignore_merges": False, "vocab": vocab, "merges": merges_by_score(tokens, scores, path)}
    return pipeline, model


def _gemma4_bpe(md: dict, path: Path, vocab: dict, tokens: list, types: list, unk: Optional[str]) -> tuple:
    """(pipeline, model) of a tokenizer.ggml.model "gemma4" vocabulary, as
    llama.cpp runs it: spaces become "▁", the text is cut into runs of
    newlines and of everything else, and each run is merged by the file's
    BPE merges over its UTF-8 characters (with byte fallback where the
    vocabulary has <0xXX> tokens)."""
    pipeline, model = _byte_level_bpe(dict(md, **{"tokenizer.ggml.pre": "default"}), path, vocab)
    byte_tokens = {tokens[i] for i, t in enumerate(types) if t == TOKEN_BYTE}
    spm = _spm_pipeline(add_space_prefix=False)
    split = {"type": "Split", "pattern": {"Regex": "[^\\n]+|[\\n]+"}, "behavior": "Isolated", "invert": False}
    model.update(unk_token=unk, byte_fallback=bool(byte_tokens), ignore_merges=False)
    return spm._replace(pre_tokenizer=split), model


def check_vocabulary_size(contents, path: Path):
    """ConversionError when a GGUF file's vocabulary (its count, read
    without decoding it) has more tokens than its embedding has rows."""
    tokens = contents.array_lengths.get("tokenizer.ggml.tokens")
    embedding = next((t for t in contents.tensors if t.name == "token_embd.weight"), None)
    if tokens is not None and embedding is not None and len(embedding.dims) == 2 and tokens > embedding.dims[1]:
        raise ConversionError(path, f"{tokens} tokens but only {embedding.dims[1]} embedding rows")


def tokenizer_files(md: dict, path: Path) -> tuple:
    kind = md.get("tokenizer.ggml.model")
    if kind is None:
        raise ConversionError(path, "the GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    if kind not in ("gpt2", "llama", "gemma4"):
        raise ConversionError(
            path, f"tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2'), "
                  f"SentencePiece ('llama') and Gemma 4's BPE ('gemma4') are")

    tokens = require(md, "tokenizer.ggml.tokens", path)
    types = md.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ConversionError(path, f"{len(tokens)} tokens but {len(types)} token types")

    vocab = {}
    for i, tok in enumerate(tokens):
        # llama.cpp resolves duplicate spellings to the last id; a JSON
        # object can only hold one of them anyway.
        vocab[tok] = i
    # The tokens llama.cpp cuts out of the text before tokenizing the rest.
    added = []
    for i, (tok, ttype) in enumerate(zip(tokens, types)):
        if ttype in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) and vocab.get(tok) == i:
            added.append(_added_token(i, tok, ttype != TOKEN_USER_DEFINED))

    def tok_str(key: str) -> Optional[str]:
        v = md.get(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if not 0 <= int(v) < len(tokens):
            raise ConversionError(path, f"tokenizer.ggml.{key} = {v} is outside the vocabulary")
        return tokens[int(v)]

    bos, eos = tok_str("bos_token_id"), tok_str("eos_token_id")
    unk, pad = tok_str("unknown_token_id"), tok_str("padding_token_id")
    if kind == "gpt2":
        pipeline, model = _byte_level_bpe(md, path, vocab)
    elif kind == "gemma4":
        pipeline, model = _gemma4_bpe(md, path, vocab, tokens, types, unk)
    else:
        if unk is None:
            unk = next((tokens[i] for i, t in enumerate(types) if t == TOKEN_UNKNOWN), None)
        pipeline, model = _sentencepiece_bpe(md, path, vocab, tokens, types, unk)

    # Without the key llama.cpp goes by the pre-tokenizer's default, which
    # needs a bos token to mean anything.
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", pipeline.add_bos and bos is not None))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise ConversionError(path, "add_bos/add_eos is set but the token id is missing")
    post = pipeline.post_processor
    if add_bos or add_eos:
        template = _template_post_processor(
            bos if add_bos else None, md.get("tokenizer.ggml.bos_token_id"),
            eos if add_eos else None, md.get("tokenizer.ggml.eos_token_id"))
        post = template if post is None else {"type": "Sequence", "processors": [post, template]}

    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": pipeline.normalizer,
        "pre_tokenizer": pipeline.pre_tokenizer,
        "post_processor": post,
        "decoder": pipeline.decoder,
        "model": model,
    }

    arch = md.get("general.architecture")
    tokenizer_config = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in added
        },
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get(f"{arch}.context_length", 1 << 30)),
        # The generic class loads tokenizer.json exactly as written; the
        # model-specific ones may rebuild parts of the pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = md.get("tokenizer.chat_template")
    named = [n for n in (md.get("tokenizer.chat_templates") or []) if f"tokenizer.chat_template.{n}" in md]
    if named:
        # HF spells several templates as a list, the unnamed one as "default".
        templates = [{"name": "default", "template": template}] if template is not None else []
        templates += [{"name": n, "template": md[f"tokenizer.chat_template.{n}"]} for n in named]
        tokenizer_config["chat_template"] = templates
    elif template is not None:
        tokenizer_config["chat_template"] = template
    return tokenizer_json, tokenizer_config


