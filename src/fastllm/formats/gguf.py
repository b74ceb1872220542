"""Import a llama.cpp GGUF file as a HuggingFace model folder.

The folder holds config.json, generation_config.json, model.safetensors,
tokenizer.json and tokenizer_config.json, laid out so that both fastllm and
transformers load it without network access.

Only numpy, the standard library and the ``gguf`` package (for its
quantization tables and dequantizers) are used here, so importing a model
never needs torch or transformers. The container itself is read by
gguf_file, with every size checked against the file.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from .. import schema
from ..config import ModelConfig
from ..errors import FastLLMError, ModelFileError
from ..files import open_regular
from ..families import FAMILIES, GGUF_ARCHITECTURES
from .gguf_file import GGUFContents, GGUFError, GGUFTensor, read_gguf, read_tensor_bytes
from .safetensors import f32_to_bf16

__all__ = [
    "ConversionError",
    "OutputExistsError",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_PRE_TOKENIZERS",
    "MODEL_FILES",
    "convert_gguf",
    "is_complete_model_dir",
]

PathLike = Union[str, "os.PathLike[str]"]
ProgressFn = Callable[[int, int], None]

# Files a converted folder always has; a folder missing any of them is not
# a finished conversion.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
# convert_gguf's dtype for a folder of everything but the weights: what a
# GGUF file run at its own precision needs beside the file itself.
METADATA_ONLY = "metadata"


def folder_files(dtype: str) -> tuple:
    """The files a conversion to dtype writes."""
    return tuple(f for f in MODEL_FILES if dtype != METADATA_ONLY or f != "model.safetensors")

SUPPORTED_ARCHITECTURES = GGUF_ARCHITECTURES

_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4


class ConversionError(ModelFileError):
    """A GGUF file that cannot be imported; the message names the file."""


class OutputExistsError(FastLLMError, FileExistsError):
    """The output folder of a conversion already exists."""


# --------------------------------------------------------------------------
# Reading


def _gguf_module():
    try:
        import gguf  # noqa: F401
    except ImportError as exc:  # pragma: no cover - gguf is a dependency
        raise ImportError(
            "Importing GGUF files needs the 'gguf' package: pip install gguf"
        ) from exc
    return gguf


def _read_gguf(path: Path, string_arrays: bool = True) -> GGUFContents:
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return read_gguf(path, _gguf_module(), string_arrays)
    except GGUFError as e:
        raise ConversionError(path, e.problem) from None


def _kind_ok(value, kind: str) -> bool:
    # bool is an int in Python: a bool where a count belongs is refused.
    if kind == "str":
        return isinstance(value, str)
    if kind == "int":
        return type(value) is int
    if kind == "number":
        return type(value) in (int, float) and math.isfinite(value)
    if kind == "bool":
        return type(value) is bool
    if kind == "int or list":
        return type(value) is int or (isinstance(value, list) and all(type(v) is int for v in value))
    if kind == "str list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "int list":
        return isinstance(value, list) and all(type(v) is int for v in value)
    raise AssertionError(kind)


# What the importer reads, by key (an architecture's keys after its name),
# and the type it must have. Keys it does not read may hold anything.
_GENERAL_KEYS = {
    "general.architecture": "str", "split.count": "int",
    "tokenizer.ggml.model": "str", "tokenizer.ggml.pre": "str",
    "tokenizer.ggml.tokens": "str list", "tokenizer.ggml.token_type": "int list",
    "tokenizer.ggml.merges": "str list",
    "tokenizer.ggml.add_bos_token": "bool", "tokenizer.ggml.add_eos_token": "bool",
    "tokenizer.chat_template": "str", "tokenizer.chat_templates": "str list",
    **{f"tokenizer.ggml.{k}_token_id": "int"
       for k in ("bos", "eos", "eot", "eom", "padding", "unknown")},
}
_ARCH_KEYS = {
    "block_count": "int", "context_length": "int", "embedding_length": "int",
    "feed_forward_length": "int or list", "attention.head_count": "int or list",
    "attention.head_count_kv": "int or list", "attention.key_length": "int",
    "rope.dimension_count": "int", "rope.freq_base": "number",
    "attention.layer_norm_rms_epsilon": "number", "rope.scaling.type": "str",
    "rope.scaling.factor": "number",
}


def _check_metadata_types(md: dict, path: Path) -> None:
    """Refuse, naming the key, a value of the wrong type where the importer
    reads one (a string block count, a list where a name belongs)."""
    arch = md.get("general.architecture")
    rules = dict(_GENERAL_KEYS)
    if isinstance(arch, str):
        rules.update({f"{arch}.{k}": kind for k, kind in _ARCH_KEYS.items()})
    for key, value in md.items():
        kind = rules.get(key) or ("str" if key.startswith("tokenizer.chat_template.") else None)
        if kind and not _kind_ok(value, kind):
            shown = repr(value) if not isinstance(value, list) else f"a list of {len(value)}"
            raise ConversionError(path, f"metadata {key!r} should be {kind}, not {shown[:80]}")


# --------------------------------------------------------------------------
# config.json


def _shortest_float32(x) -> float:
    # GGUF stores hyperparameters as float32. The shortest decimal that maps
    # to the same float32 gives back what the original config.json said
    # (1e-05 rather than 9.999999747378752e-06) and computes identically.
    f = np.float32(x)
    for digits in range(1, 18):
        s = f"{float(f):.{digits}g}"
        if np.float32(float(s)) == f:
            return float(s)
    return float(f)


def _require(md: dict, key: str, path: Path):
    if key not in md:
        raise ConversionError(path, f"GGUF metadata lacks {key!r}")
    return md[key]


def _tensor_shapes(tensors) -> dict:
    return {t.name: t.shape for t in tensors}


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict:
    """Recover HF's llama3 rope_scaling from llama.cpp's rope_freqs tensor.

    llama.cpp bakes the llama3 frequency scaling into a per-frequency table.
    The table fixes only the two cutoff wavelengths (original length over
    low_freq_factor and over high_freq_factor), which is all the scaling
    depends on; the usual Llama 3 spelling (low_freq_factor 1, power-of-two
    original length) is preferred, then the exact fit with low_freq_factor 1.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32).astype(np.float64) / head_dim))
    if len(freqs) != len(factors):
        raise ConversionError(path, f"rope_freqs has {len(factors)} entries, expected {len(freqs)}")
    factor = float(np.max(factors))
    wavelen = 2 * math.pi / freqs

    def table(orig, low, high):
        smooth = (orig / wavelen - low) / (high - low)
        return np.where(wavelen < orig / high, 1.0,
                        np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))

    def result(orig, low, high):
        return {"rope_type": "llama3", "factor": _shortest_float32(factor),
                "low_freq_factor": _shortest_float32(low), "high_freq_factor": _shortest_float32(high),
                "original_max_position_embeddings": int(orig)}

    if factor > 1.0:
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 8.0, 2.0, 16.0):
                for orig in (2 ** k for k in range(4, 21)):
                    if np.allclose(table(orig, low, high), factors, rtol=1e-5, atol=1e-6):
                        return result(orig, low, high)
        # Entries strictly between the cutoffs satisfy 1/f linear in
        # 1/wavelength; two of them give both cutoffs.
        mid = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
        if mid.sum() >= 2:
            s = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
            slope, intercept = np.polyfit(1.0 / wavelen[mid], s, 1)
            if intercept < 0:
                high = 1.0 - 1.0 / intercept
                orig = round(-slope / intercept)
                if orig > 0 and np.allclose(table(orig, 1.0, high), factors, rtol=1e-5, atol=1e-6):
                    return result(orig, 1.0, high)
    raise ConversionError(path, "the rope_freqs tensor matches no llama3 rope scaling this importer knows")


def _rope_scaling(md: dict, arch: str, path: Path) -> Optional[dict]:
    kind = md.get(f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _shortest_float32(factor)}
    raise ConversionError(path, f"rope scaling type {kind!r} is not supported")


def _model_config(md: dict, shapes: dict, path: Path, dtype: str, rope_freqs=None) -> dict:
    arch = md["general.architecture"]

    def a(key):
        value = _require(md, f"{arch}.{key}", path)
        if isinstance(value, list):
            raise ConversionError(path, f"per-layer values of {arch}.{key} are not supported")
        return value

    if "token_embd.weight" not in shapes:
        raise ConversionError(path, "no token_embd.weight tensor")
    for name in ("token_embd.weight", "blk.0.attn_q.weight"):
        if name in shapes and len(shapes[name]) != 2:
            raise ConversionError(path, f"tensor {name} has shape {list(shapes[name])}, not two dimensions")
    vocab_size, hidden = shapes["token_embd.weight"]
    n_layers = int(a("block_count"))
    if not 0 < n_layers <= len(shapes):
        # Every layer has tensors: a count past them would only make the
        # tensor plan below loop over layers that cannot be there.
        raise ConversionError(path, f"{arch}.block_count is {n_layers}, but the file has "
                                    f"{len(shapes)} tensors")
    n_heads = int(a("attention.head_count"))
    if n_heads < 1:
        raise ConversionError(path, f"{arch}.attention.head_count is {n_heads}; it must be at least 1")
    n_kv = md.get(f"{arch}.attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise ConversionError(path, "per-layer key/value head counts are not supported")
    n_kv = int(n_kv)
    if int(a("embedding_length")) != hidden:
        raise ConversionError(path, f"embedding_length {a('embedding_length')} != token_embd width {hidden}")

    q_rows = shapes.get("blk.0.attn_q.weight", (None,))[0]
    head_dim = md.get(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = q_rows // n_heads if q_rows else hidden // n_heads
    head_dim = int(head_dim)
    if head_dim < 1:
        raise ConversionError(path, f"the head size comes out as {head_dim}; it must be at least 1")
    if q_rows is not None and q_rows != n_heads * head_dim:
        raise ConversionError(path, f"attn_q has {q_rows} rows, expected {n_heads} heads x {head_dim}")
    rope_dim = md.get(f"{arch}.rope.dimension_count", head_dim)
    if int(rope_dim) != head_dim:
        raise ConversionError(path, f"partial rotary embeddings (rope dim {rope_dim} of {head_dim}) are not supported")

    tied = schema.LM_HEAD.gguf not in shapes
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    family = FAMILIES[arch]

    cfg = {
        "architectures": [family.hf_class],
        "model_type": arch,
        "hidden_size": int(hidden),
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
    }
    # transformers' own GGUF loader always sets head_dim where the config
    # has the field (llama, qwen3); qwen2's has none.
    if family.gguf_head_dim:
        cfg["head_dim"] = head_dim
    elif head_dim != hidden // n_heads:
        raise ConversionError(path, f"{arch} with head_dim {head_dim} != hidden/heads is not supported")
    cfg.update({
        "max_position_embeddings": int(a("context_length")),
        "rms_norm_eps": _shortest_float32(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest_float32(theta),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
    })
    scaling = _rope_scaling(md, arch, path)
    if rope_freqs is not None:
        if scaling is not None:
            raise ConversionError(path, "a rope_freqs tensor beside rope scaling metadata is not understood")
        scaling = _llama3_rope_scaling(rope_freqs, theta, head_dim, path)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    # A bias switch that config.json holds is set by layer 0's tensors; the
    # tensor plan then checks every layer against the resulting config.
    for t in schema.LAYER:
        key = getattr(family, t.switch, None) if t.switch else None
        if isinstance(key, str) and key not in cfg:
            cfg[key] = f"blk.0.{t.gguf}" in shapes
    cfg["attention_dropout"] = 0.0
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        v = md.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[name] = int(v)
    cfg["torch_dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    cfg["use_cache"] = True
    return cfg


def _generation_config(md: dict) -> dict:
    gen = {}
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos = md.get("tokenizer.ggml.eos_token_id")
    pad = md.get("tokenizer.ggml.padding_token_id")
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    # llama.cpp stops at end-of-turn tokens as well as at eos; HF says so
    # with a list of eos ids.
    stops = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = md.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in stops:
            stops.append(int(v))
    if stops:
        gen["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    elif eos is not None:
        gen["pad_token_id"] = int(eos)
    return gen


# --------------------------------------------------------------------------
# Tokenizer

_GPT2_BYTELEVEL_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_GPT2_BYTELEVEL_POST = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
_GPT2_BYTELEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
_PLAIN_BYTELEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


# tokenizer.ggml.pre -> the pipeline of the HF tokenizer.json it came from:
# (normalizer, pre_tokenizer, post_processor, decoder, ignore_merges)
_PRE_TOKENIZERS = {
    # SmolLM / StarCoder style: every digit on its own, then GPT-2's regex.
    "smollm": (
        None,
        {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, _GPT2_BYTELEVEL_PRE]},
        _GPT2_BYTELEVEL_POST, _GPT2_BYTELEVEL_DECODER, False,
    ),
    "gpt2": (None, _GPT2_BYTELEVEL_PRE, _GPT2_BYTELEVEL_POST, _GPT2_BYTELEVEL_DECODER, False),
    # llama.cpp's own "default" splits differently, but a file that says
    # "default" names no HF pipeline; GPT-2's is what transformers uses too.
    "default": (None, _GPT2_BYTELEVEL_PRE, _GPT2_BYTELEVEL_POST, _GPT2_BYTELEVEL_DECODER, False),
    "qwen2": (
        {"type": "NFC"},
        {"type": "Sequence", "pretokenizers": [_split(_QWEN2_SPLIT), _PLAIN_BYTELEVEL]},
        _PLAIN_BYTELEVEL, _PLAIN_BYTELEVEL, False,
    ),
    "llama-bpe": (
        None,
        {"type": "Sequence", "pretokenizers": [
            _split(_LLAMA3_SPLIT),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        _GPT2_BYTELEVEL_DECODER, True,
    ),
}
_PRE_TOKENIZERS["llama3"] = _PRE_TOKENIZERS["llama-v3"] = _PRE_TOKENIZERS["llama-bpe"]

SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))


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


def _tokenizer_files(md: dict, path: Path) -> tuple:
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise ConversionError(path, "the GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    if model != "gpt2":
        raise ConversionError(
            path, f"tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2') is")
    pre = md.get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise ConversionError(
            path, f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})")
    normalizer, pre_tok, post, decoder, ignore_merges = _PRE_TOKENIZERS[pre]

    tokens = _require(md, "tokenizer.ggml.tokens", path)
    types = md.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ConversionError(path, f"{len(tokens)} tokens but {len(types)} token types")
    # A vocabulary of single bytes and specials has no merges, and a
    # writer may then leave the key out.
    merges = md.get("tokenizer.ggml.merges") or []

    vocab = {}
    for i, tok in enumerate(tokens):
        # llama.cpp resolves duplicate spellings to the last id; a JSON
        # object can only hold one of them anyway.
        vocab[tok] = i
    added = []
    for i, (tok, ttype) in enumerate(zip(tokens, types)):
        if ttype in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and vocab.get(tok) == i:
            added.append(_added_token(i, tok, ttype == _TOKEN_CONTROL))

    merge_pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ConversionError(path, f"malformed merge {m!r}")
        merge_pairs.append(parts)

    def tok_str(key: str) -> Optional[str]:
        v = md.get(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if not 0 <= int(v) < len(tokens):
            raise ConversionError(path, f"tokenizer.ggml.{key} = {v} is outside the vocabulary")
        return tokens[int(v)]

    bos, eos = tok_str("bos_token_id"), tok_str("eos_token_id")
    unk, pad = tok_str("unknown_token_id"), tok_str("padding_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise ConversionError(path, "add_bos/add_eos is set but the token id is missing")
    if add_bos or add_eos:
        template = _template_post_processor(
            bos if add_bos else None, md.get("tokenizer.ggml.bos_token_id"),
            eos if add_eos else None, md.get("tokenizer.ggml.eos_token_id"))
        post = {"type": "Sequence", "processors": [post, template]}

    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tok,
        "post_processor": post,
        "decoder": decoder,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merge_pairs,
        },
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


# --------------------------------------------------------------------------
# Tensors

def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of every head
    # (rows [x0..x(d/2-1), y0..] become [x0, y0, x1, y1, ...]) to suit its
    # own RoPE; this puts them back in HF's half-split order.
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Values converted at a time (1 MB of float32): a big tensor (a 49152 x 576
# embedding) is read, dequantized, converted and written in slices, so
# converting holds neither a whole tensor nor its dequantizer's temporaries.
_SLICE_VALUES = 1 << 18


def _decode(raw: np.ndarray, tensor: GGUFTensor, shape: tuple, path: Path) -> np.ndarray:
    """raw, the bytes of whole rows of tensor, as float32 of shape."""
    gguf = _gguf_module()
    qt = gguf.GGMLQuantizationType
    ttype = tensor.tensor_type
    if ttype == qt.F64:
        out = raw.view("<f8").astype(np.float32)
    else:
        # The dequantizers take whole rows of blocks, as bytes.
        rows = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape or (1,), ttype))
        try:
            out = gguf.quants.dequantize(rows, ttype)
        except NotImplementedError as exc:
            raise ConversionError(
                path, f"tensor {tensor.name} uses {getattr(ttype, 'name', ttype)}, which gguf "
                f"{getattr(gguf, '__version__', '')} cannot dequantize: {exc}") from exc
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


def slices(shape: tuple, step: int = 1) -> list:
    """(start, stop) of the slices along the first axis of shape that a
    tensor is converted in: about _SLICE_VALUES values each, and a whole
    multiple of step entries."""
    count = max(step, _SLICE_VALUES // max(1, math.prod(shape[1:])) // step * step)
    return [(start, min(start + count, shape[0])) for start in range(0, shape[0], count)]


def _dequantized_slices(tensor: GGUFTensor, path: Path, step: int = 1):
    """The tensor as float32, in slices along its first axis of a whole
    multiple of step entries each (the rows of a head, say, so that each
    slice can be unpermuted alone); a vector comes whole."""
    qt = _gguf_module().GGMLQuantizationType
    ttype, shape = tensor.tensor_type, tensor.shape
    if ttype in (qt.I8, qt.I16, qt.I32, qt.I64):
        raise ConversionError(path, f"tensor {tensor.name} has integer type {ttype.name}, not a weight")
    if 0 in shape:
        yield np.zeros(shape, np.float32)
        return
    if len(shape) < 2:
        yield _decode(read_tensor_bytes(path, tensor), tensor, shape, path)
        return
    # Every index of the first axis holds whole rows, so whole blocks.
    per_index = tensor.n_bytes // shape[0]
    with open_regular(path, "GGUF file") as f:
        for start, stop in slices(shape, step):
            n = stop - start
            raw = np.empty(n * per_index, np.uint8)
            f.seek(tensor.offset + start * per_index)
            if f.readinto(memoryview(raw)) != raw.nbytes:
                raise GGUFError(path, f"tensor {tensor.name!r}: the file ends before the tensor does; "
                                      f"it was truncated after it was opened")
            yield _decode(raw, tensor, (n, *shape[1:]), path)


def _dequantize(tensor: GGUFTensor, path: Path) -> np.ndarray:
    """The whole tensor as float32."""
    slices = _dequantized_slices(tensor, path)
    if len(tensor.shape) < 2 or 0 in tensor.shape:
        return next(slices)
    out = np.empty(tensor.shape, np.float32)
    start = 0
    for part in slices:
        out[start:start + len(part)] = part
        start += len(part)
    return out


def _slices_to_write(tensor: GGUFTensor, path: Path, n_heads: Optional[int], dtype: str):
    """The tensor's slices as the folder stores them: Q/K rows back in HF's
    order (n_heads: their heads, or None), in dtype."""
    rows_per_head = tensor.shape[0] // n_heads if n_heads else 1
    for w in _dequantized_slices(tensor, path, rows_per_head):
        if n_heads:
            w = unpermute(w, len(w) // rows_per_head)
        yield f32_to_bf16(w) if dtype == "bf16" else w


class _SafetensorsWriter:
    """Write a safetensors file one tensor at a time.

    The header needs every offset up front, and every shape is known from the
    GGUF tensor table before anything is dequantized, so a tensor is written
    slice by slice as it is dequantized, and no whole tensor is held.
    """

    _DTYPES = {"F32": 4, "BF16": 2, "F16": 2}

    def __init__(self, path: Path, entries: list, metadata: Optional[dict] = None):
        header = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._expected = []
        for name, dtype, shape in entries:
            nbytes = int(np.prod(shape, dtype=np.int64)) * self._DTYPES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, parts) -> None:
        """The next tensor, given as its consecutive slices (arrays)."""
        want_name, want_bytes = self._expected[self._next]
        written = 0
        for data in parts:
            # safetensors is little-endian whatever the host is.
            data = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<"))
            self._f.write(memoryview(data).cast("B"))
            written += data.nbytes
        if name != want_name or written != want_bytes:
            raise AssertionError(f"safetensors writer: got {name} ({written} B), "
                                 f"expected {want_name} ({want_bytes} B)")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            raise AssertionError("safetensors writer closed before all tensors were written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


def gguf_names(cfg: ModelConfig) -> dict:
    """GGUF name -> (HF name, schema.Tensor) of every tensor cfg implies."""
    names = {}
    for t in schema.MODEL:
        if t is not schema.LM_HEAD or not cfg.tie_word_embeddings:
            names[t.gguf] = (schema.hf_name(t, cfg), t)
    for i in range(cfg.num_hidden_layers):
        for t in schema.layer_tensors(cfg, cfg.layer_kind(i)):
            names[f"blk.{i}.{t.gguf}"] = (schema.hf_name(t, cfg, i), t)
    return names


def _plan_tensors(tensors: dict, shapes: dict, cfg: ModelConfig, path: Path) -> list:
    """(hf_name, gguf_tensor, schema tensor) in output order, once the file
    has exactly the tensors cfg implies, each of the shape it implies."""
    planned = gguf_names(cfg)
    missing = [name for name in planned if name not in tensors]
    unexpected = [name for name in tensors if name not in planned]
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing[:6])}"] if missing else []) + \
                ([f"unexpected {', '.join(unexpected[:6])}"] if unexpected else [])
        raise ConversionError(path, f"tensors do not fit the {cfg.model_type} architecture: {'; '.join(parts)}")
    for name, (_, t) in planned.items():
        if shapes[name] != schema.hf_shape(t, cfg):
            raise ConversionError(path, f"tensor {name} has shape {list(shapes[name])}, "
                                        f"the metadata implies {list(schema.hf_shape(t, cfg))}")
    # The embedding first, then the layers, then the final norm and the head.
    order = sorted(planned.items(), key=lambda item: item[1][1] is not schema.EMBED and
                   (2 if item[1][1] in schema.MODEL else 1))
    return [(hf, tensors[name], t) for name, (hf, t) in order]


# --------------------------------------------------------------------------
# Progress


class _StderrBar:
    def __init__(self, label: str):
        self.label = label
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tensors")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _progress_fn(progress, label: str) -> Optional[ProgressFn]:
    if callable(progress):
        return progress
    if progress is None:
        try:
            progress = sys.stderr is not None and sys.stderr.isatty()
        except (AttributeError, ValueError):
            progress = False
    return _StderrBar(label) if progress else None


# --------------------------------------------------------------------------
# Atomic output folder


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def _remove_stale_partials(out_dir: Path) -> None:
    # A conversion killed outright (SIGKILL, power loss) cannot clean up
    # after itself; the next one removes what it left, but only where its
    # process is known to be gone.
    prefix = f".{out_dir.name}.partial-"
    host = _host_tag()
    try:
        siblings = list(out_dir.parent.iterdir())
    except OSError:
        return
    for p in siblings:
        if not p.name.startswith(prefix):
            continue
        parts = p.name[len(prefix):].split("-")
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if not _pid_alive(int(parts[1])):
            shutil.rmtree(p, ignore_errors=True)


def _make_partial_dir(out_dir: Path) -> Path:
    while True:
        tmp = out_dir.parent / f".{out_dir.name}.partial-{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def _is_empty_dir(p: Path) -> bool:
    try:
        return p.is_dir() and not any(p.iterdir())
    except OSError:
        return False


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished folder into place in one rename."""
    if _is_empty_dir(out_dir):
        try:
            os.rmdir(out_dir)
        except OSError:
            pass
    try:
        os.rename(tmp, out_dir)
        return
    except OSError:
        if not out_dir.exists():
            raise
    if not overwrite:
        raise OutputExistsError(f"{out_dir} already exists (pass overwrite=True to replace it)")
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


def is_complete_model_dir(path: PathLike, dtype: str = "f32") -> bool:
    """Whether path holds every file a conversion to dtype writes."""
    p = Path(path)
    try:
        return all((p / f).is_file() for f in folder_files(dtype)) and (
            dtype == METADATA_ONLY or (p / "model.safetensors").stat().st_size > 8)
    except OSError:
        return False


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------
# Entry point

# The one default precision of converted folders: `fastllm convert`, the
# default model and GGUF files converted on first use all write float32,
# the dequantized values exactly, so results match a float32 reference.
DEFAULT_DTYPE = "f32"


def convert_gguf(gguf_path: PathLike, out_dir: PathLike, dtype: str = DEFAULT_DTYPE,
                 progress: Union[None, bool, ProgressFn] = None, *, overwrite: bool = False,
                 extra_files: Optional[dict] = None) -> Path:
    """Convert a GGUF file into a HuggingFace model folder at out_dir.

    dtype: "f32" (the exact dequantized values; the default, as for the
    default model and for GGUF files converted on first use) or "bf16"
    (weights rounded to bfloat16 as torch rounds: half the size), or
    METADATA_ONLY: config, generation config and tokenizer files only, for
    running the GGUF file's own weights.
    progress: a callable progress(done, total) called after each tensor,
    True/False to force the stderr progress bar on/off, or None for a bar
    only when stderr is a terminal.
    overwrite: replace an existing out_dir; otherwise OutputExistsError
    (a FileExistsError).
    extra_files: {file name: JSON-serialisable object} written into the
    folder as well, before it becomes visible and after everything else; a
    callable value is called with the finished folder and its result
    written (to record, say, the sizes of the files written).

    The folder is built beside out_dir under a hidden name and renamed into
    place at the end, so out_dir either appears complete or not at all.
    """
    if dtype not in ("bf16", "f32", METADATA_ONLY):
        raise ValueError(f"dtype must be 'bf16' or 'f32', not {dtype!r}")
    path = Path(gguf_path).expanduser()
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not overwrite and not _is_empty_dir(out_dir):
        raise OutputExistsError(f"{out_dir} already exists (pass overwrite=True to replace it)")

    contents = _read_gguf(path)
    md = contents.metadata
    _check_metadata_types(md, path)
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(
            path, f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if int(md.get("split.count", 1)) > 1:
        raise ConversionError(path, "split GGUF files are not supported; merge the parts first "
                              "(llama-gguf-split --merge)")
    shapes = _tensor_shapes(contents.tensors)
    tensors = {t.name: t for t in contents.tensors}
    rope_freqs = tensors.pop("rope_freqs.weight", None)
    config = _model_config(md, shapes, path, dtype,
                           None if rope_freqs is None else _dequantize(rope_freqs, path))
    try:
        cfg = ModelConfig.from_dict(config, path)
    except ModelFileError as e:
        raise ConversionError(path, e.problem) from None
    order = _plan_tensors(tensors, shapes, cfg, path)
    tokenizer_json, tokenizer_config = _tokenizer_files(md, path)
    if len(tokenizer_json["model"]["vocab"]) > config["vocab_size"]:
        raise ConversionError(path, f"{len(tokenizer_json['model']['vocab'])} tokens but only "
                              f"{config['vocab_size']} embedding rows")

    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    st_dtype = "BF16" if dtype == "bf16" else "F32"
    entries = [(hf, st_dtype, shapes[g.name]) for hf, g, _ in order]
    report = _progress_fn(progress, f"Converting {path.name}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out_dir)
    tmp = _make_partial_dir(out_dir)
    writer = None
    try:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(md))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        with open(tmp / "tokenizer.json", "w", encoding="utf-8") as f:
            json.dump(tokenizer_json, f, ensure_ascii=False, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())

        if dtype == METADATA_ONLY:
            order = []
        else:
            writer = _SafetensorsWriter(tmp / "model.safetensors", entries,
                                        {"format": "pt", "source": path.name})
        total = len(order)
        if report:
            report(0, total)
        heads = {"q": n_heads, "k": n_kv} if FAMILIES[arch].gguf_qk_interleaved else {}
        for i, (hf, g, t) in enumerate(order):
            writer.write(hf, _slices_to_write(g, path, heads.get(t.rope), dtype))
            if report:
                report(i + 1, total)
        if writer is not None:
            writer.close()
            writer = None
        for name, obj in (extra_files or {}).items():
            _write_json(tmp / name, obj(tmp) if callable(obj) else obj)
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        if writer is not None:
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(report, _StderrBar):
            sys.stderr.write("\n")
        raise
    return out_dir
