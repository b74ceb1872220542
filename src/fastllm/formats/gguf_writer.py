"""Export a HuggingFace model folder as a llama.cpp GGUF file.

The other direction of formats/gguf.py: config.json becomes the llama.cpp
hyperparameters, tokenizer.json the tokenizer.ggml.* keys, and every tensor
is written under its llama.cpp name (schema.py), in the type the
quantization mix gives it (quants.plan), with the Q/K rows of llama models
interleaved per head as llama.cpp's RoPE wants them.

Tensors are quantized and written one at a time, so memory holds one
tensor, not the model. The file appears under its name only once complete.
"""
from __future__ import annotations

import math
import os
import re
import secrets
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import warnings

from ..spec import schema
from ..spec.config import ModelConfig, read_json, yarn_scaling
from ..spec.errors import ModelFileError
from ..spec.families import GGUF_ARCHITECTURES
from . import quants
from .gguf import OutputExistsError, progress_fn
from .gguf_config import GGUF_KEYS
from .gguf_file import ConversionError
from .gguf_tensors import gguf_names, reshaped, slices, to_gguf_values
from .gguf_tokenizer import (PRE_TOKENIZERS, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED,
                             TOKEN_USER_DEFINED)
from .safetensors import Checkpoint

__all__ = ["export_gguf", "permute", "MIXES"]

PathLike = Union[str, "os.PathLike[str]"]
MIXES = tuple(quants.MIXES)

# The llama.cpp name written for each HF pre-tokenizer pipeline the importer
# knows, in the order ties are broken: several names share one pipeline
# (deepseek-r1-qwen is qwen2's, falcon3 is llama-bpe's), and the first is the
# family's own.
_PRE_NAMES = ("smollm", "gpt-2", "olmo", "qwen2", "qwen35", "llama-bpe", "smaug-bpe", "tekken", "gpt-4o")
_MAX_TOKENIZER_JSON = 1 << 30


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's half-split rotary rows to llama.cpp's interleaved ones: the
    inverse of formats.gguf.unpermute."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------
# Hyperparameters


def _llama3_rope_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    # llama.cpp takes Llama 3's frequency scaling as a table of per-frequency
    # divisors (the rope_freqs tensor) rather than as parameters.
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32).astype(np.float64) / head_dim))
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    orig = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    table = np.where(wavelen < orig / high, 1.0,
                     np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return table.astype(np.float32)


def _hyperparameters(w, cfg: ModelConfig, folder: Path) -> dict:
    """Write the architecture's keys; returns the tensors that hold the
    rope scaling (llama3's rope_freqs, LongRoPE's factors), if any."""
    for hf, key in GGUF_KEYS.items():
        value = getattr(cfg, hf)
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{w.arch}.{key}", value)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rope_dim)
    w.add_vocab_size(cfg.vocab_size)
    tensors = cfg.family.gguf_write(w, cfg, folder) if cfg.family.gguf_write else {}
    if cfg.family.gguf_longrope:   # the family writes its rope scaling (as tensors)
        return tensors
    return {**tensors, **_rope_scaling(w, cfg, folder)}


def _rope_scaling(w, cfg: ModelConfig, folder: Path) -> dict:
    """Write the rope scaling's keys; returns llama3's rope_freqs tensor, if any."""
    scaling = cfg.rope_scaling
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return {}
    if kind == "linear":
        import gguf
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        return {}
    if kind == "llama3":
        return {"rope_freqs.weight": _llama3_rope_factors(scaling, float(cfg.rope_theta), cfg.head_dim)}
    if kind == "yarn":
        _yarn_keys(w, cfg, folder)
        return {}
    raise ConversionError(folder / "config.json", f"rope scaling {kind!r} cannot be written to GGUF "
                                                  f"(supported: linear, llama3, yarn)")


def _yarn_keys(w, cfg: ModelConfig, folder: Path) -> None:
    """YaRN's keys, as llama.cpp's converter writes them. llama.cpp derives
    the attention factor itself, taking mscale as 1; where transformers'
    differs (another mscale, an explicit attention_factor),
    rope.scaling.attn_factor carries the ratio, which llama.cpp multiplies
    in. It always truncates the ramp: a folder that does not is refused."""
    import gguf
    scaling = cfg.rope_scaling

    def refuse(what):
        raise ConversionError(folder / "config.json", f"{what} cannot be written to GGUF: llama.cpp would "
                                                      "run the file otherwise")
    if not scaling.get("truncate", True):
        refuse("YaRN without truncation (truncate: false)")
    log_mul = scaling.get("mscale_all_dim") or 0.0
    factor = float(scaling["factor"])
    as_read = {k: v for k, v in scaling.items() if k not in ("attention_factor", "mscale")}
    if log_mul:
        as_read["mscale"] = 1.0
    context = {"max_position_embeddings": cfg.max_position_embeddings}
    derived = yarn_scaling(as_read, context, folder)["attention_factor"]
    ratio = scaling["attention_factor"] / derived
    if np.float32(ratio) != np.float32(1.0):
        w.add_rope_scaling_attn_factors(ratio)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(factor)
    w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    w.add_rope_scaling_yarn_beta_fast(float(scaling.get("beta_fast") or 32.0))
    w.add_rope_scaling_yarn_beta_slow(float(scaling.get("beta_slow") or 1.0))
    if log_mul:
        w.add_rope_scaling_yarn_log_mul(float(log_mul))


# --------------------------------------------------------------------------
# Tokenizer


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _adds_bos(tok_config: dict, tok_json: dict) -> bool:
    if isinstance(tok_config.get("add_bos_token"), bool):
        return tok_config["add_bos_token"]
    # Llama 3 style: a post-processor template that starts with a special token.
    post = tok_json.get("post_processor") or {}
    for p in post.get("processors", [post]) if isinstance(post, dict) else []:
        single = p.get("single") if isinstance(p, dict) and p.get("type") == "TemplateProcessing" else None
        if single and "SpecialToken" in single[0]:
            return True
    return False


def _chat_template(folder: Path, tok_config: dict):
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return tok_config.get("chat_template")


def _tokenization_only(spec):
    """spec without the settings that change offsets but never ids
    (ByteLevel's trim_offsets), so equal pipelines compare equal."""
    if isinstance(spec, dict):
        return {k: _tokenization_only(v) for k, v in spec.items() if k != "trim_offsets"}
    if isinstance(spec, (list, tuple)):
        return [_tokenization_only(v) for v in spec]
    return spec


_SPACES_TO_METASPACE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
_LEGACY_SPM_NORMALIZER = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                             _SPACES_TO_METASPACE]}
# Gemma's converter splits on " " after the normalizer has replaced every " ": a no-op.
_GEMMA_SPLIT = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}


def _space_prefix(tok: dict) -> Optional[bool]:
    """add_space_prefix of a SentencePiece-style pipeline (the "▁" that
    llama.cpp puts before the text and after each special token), or None
    for a pipeline llama.cpp's SentencePiece tokenizer does not run.

    Metaspace's prepend_scheme "first" (transformers' legacy=False) prefixes
    neither text that already starts with a space nor what follows a special
    token in it; a GGUF cannot say so. llama.cpp's converter writes such a
    vocabulary from its tokenizer.model all the same, and llama.cpp then
    tokenizes it the legacy way; so does fastllm."""
    norm, pre = tok.get("normalizer"), tok.get("pre_tokenizer")
    if norm == _LEGACY_SPM_NORMALIZER and pre is None:
        return True
    if norm == _SPACES_TO_METASPACE and pre in (None, _GEMMA_SPLIT):
        return False
    if (norm is None and isinstance(pre, dict) and pre.get("type") == "Metaspace"
            and pre.get("replacement") == "\u2581" and pre.get("split") is False):
        return pre.get("prepend_scheme", "always") != "never"
    return None


def _vocabulary(tok: dict, cfg: ModelConfig, tj_path: Path, unk: Optional[str]) -> tuple:
    """(tokens, types) by id, as llama.cpp's converter lists them: added
    tokens CONTROL when special, USER_DEFINED otherwise; in a SentencePiece
    vocabulary (unk given) the unknown token UNKNOWN, and <0xXX> BYTE where
    it falls back to bytes."""
    model = tok["model"]
    byte_fallback = bool(model.get("byte_fallback"))
    by_id = {}
    for text, i in model.get("vocab", {}).items():
        kind = TOKEN_NORMAL
        if byte_fallback and re.fullmatch(r"<0x[0-9A-F]{2}>", text):
            kind = TOKEN_BYTE
        by_id[int(i)] = (text, kind)
    for added in tok.get("added_tokens", []):
        kind = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
        if unk is not None and added["content"] == unk:
            kind = TOKEN_UNKNOWN
        by_id[int(added["id"])] = (added["content"], kind)
    n = max(cfg.vocab_size, max(by_id) + 1 if by_id else 0)
    if n > cfg.vocab_size:
        raise ConversionError(tj_path, f"token ids run to {n - 1}, but the embedding has {cfg.vocab_size} rows")
    # Embedding rows without a token (padding to a round size) get unused names, as llama.cpp's converter does.
    tokens, types = [], []
    for i in range(n):
        text, kind = by_id.get(i, (f"[PAD{i}]", TOKEN_UNUSED))
        if text == f"[PAD{i}]":
            kind = TOKEN_UNUSED  # a padding row that came in from such a converter goes back as one
        tokens.append(text)
        types.append(kind)
    return tokens, types


def _scores_from_merges(tokens: list, types: list, merges: list) -> list:
    """SentencePiece scores that make llama.cpp's merging by score replay
    the merges: the normal tokens ranked by the first merge that makes them
    (those no merge makes after them, by id), scored 0, -1, -2, ...; the
    others 0, as sentencepiece scores them. For a vocabulary that came from
    a sentencepiece BPE model these are that model's scores."""
    first_merge = {}
    for rank, pair in enumerate(merges):
        first_merge.setdefault("".join(pair), rank)
    normal = [i for i, kind in enumerate(types) if kind == TOKEN_NORMAL]
    normal.sort(key=lambda i: (first_merge.get(tokens[i], len(merges)), i))
    scores = [0.0] * len(tokens)
    for position, i in enumerate(normal):
        scores[i] = -float(position)
    for i, kind in enumerate(types):
        if kind == TOKEN_UNUSED:
            scores[i] = -1000.0
    return scores


def _tokenizer(w, folder: Path, cfg: ModelConfig) -> None:
    tj_path = folder / "tokenizer.json"
    if not tj_path.is_file():
        raise ConversionError(folder, "no tokenizer.json (GGUF needs the tokenizer)")
    tok = read_json(tj_path, _MAX_TOKENIZER_JSON, "tokenizer.json")
    tc_path = folder / "tokenizer_config.json"
    tok_config = read_json(tc_path, 1 << 26, "tokenizer_config.json") if tc_path.is_file() else {}
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise ConversionError(tj_path, f"tokenizer model {model.get('type')!r} cannot be written; "
                                       f"only BPE (byte-level, or SentencePiece-style) is supported")
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model.get("merges", [])]
    space_prefix = _space_prefix(tok)
    if space_prefix is not None:
        tokens, types = _vocabulary(tok, cfg, tj_path, model.get("unk_token"))
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(_scores_from_merges(tokens, types, merges))
        w.add_token_types(types)
        if not space_prefix:
            w.add_add_space_prefix(False)
    else:
        pipeline = _tokenization_only((tok.get("normalizer"), tok.get("pre_tokenizer"),
                                       bool(model.get("ignore_merges"))))
        pre = next((n for n in _PRE_NAMES if _tokenization_only(
            PRE_TOKENIZERS[n][:2] + (PRE_TOKENIZERS[n].ignore_merges,)) == pipeline), None)
        if pre is None:
            raise ConversionError(tj_path, "the pre-tokenizer matches none llama.cpp knows by name "
                                           f"({', '.join(_PRE_NAMES)}), nor SentencePiece's")
        tokens, types = _vocabulary(tok, cfg, tj_path, None)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        if merges:
            w.add_token_merges([" ".join(m) for m in merges])
    ids = {t: i for i, t in enumerate(tokens)}

    def token_id(key: str, fallback):
        text = _token_text(tok_config.get(key))
        if text is not None and text in ids:
            return ids[text]
        return fallback

    eos_cfg = cfg.eos_token_id[0] if cfg.eos_token_id else None
    bos = token_id("bos_token", cfg.bos_token_id)
    eos = token_id("eos_token", eos_cfg)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    unk = token_id("unk_token", None)
    if unk is not None:
        w.add_unk_token_id(unk)
    pad = token_id("pad_token", None)
    if pad is not None:
        w.add_pad_token_id(pad)
    w.add_add_bos_token(_adds_bos(tok_config, tok))
    template = _chat_template(folder, tok_config)
    if template:
        w.add_chat_template(template)


# --------------------------------------------------------------------------
# Entry point

def _gguf_rows(f, name: str, shape: tuple, qtype: str, n_heads: Optional[int], t: schema.Tensor,
               cfg: ModelConfig) -> np.ndarray:
    """Tensor name of safetensors file f as rows of qtype, as the GGUF file
    holds them: Q/K rows interleaved per head (n_heads: their heads, or
    None), and t's values as llama.cpp's converter stores them. It is read
    and quantized a slice at a time, so the output is the one whole tensor
    held, never the checkpoint's float copy or the quantizer's temporaries."""
    if reshaped(t, cfg):
        # Layer-sized: converted whole, as its rows move across slices.
        a = to_gguf_values(f.float32(name, f.read(name)), t, cfg)
        return quants.quantize(a.reshape(-1, shape[-1]), qtype)
    if len(shape) < 2:
        a = f.float32(name, f.read(name))
        a = permute(a, n_heads) if n_heads else a
        return quants.quantize(a.reshape(1, -1), qtype)
    rows_per_index = math.prod(shape[1:-1])
    out = np.empty((shape[0] * rows_per_index, quants.row_bytes(qtype, shape[-1])), np.uint8)
    step = shape[0] // n_heads if n_heads else 1
    for start, stop in slices(shape, step):
        a = f.float32(name, f.read(name, start, stop))
        a = permute(a, len(a) // step) if n_heads else a
        out[start * rows_per_index:(start + len(a)) * rows_per_index] = \
            quants.quantize(a.reshape(-1, shape[-1]), qtype)
    return out



def export_gguf(folder: PathLike, out_path: PathLike, mix: str = "f32",
                progress: Union[None, bool, Callable[[int, int], None]] = None, *,
                overwrite: bool = False) -> Path:
    """Write the HF model in folder as a GGUF file llama.cpp loads.

    mix: "f32", "f16", "bf16" (every matrix in that type) or a llama.cpp
    quantization mix (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k_m, q5_k_m, q6_k,
    and q4_k / q5_k for every matrix in that type); vectors stay float32.
    progress: as for formats.gguf.convert_gguf.
    """
    import gguf

    if mix not in quants.MIXES:
        raise ValueError(f"unknown dtype {mix!r} (known: {', '.join(quants.MIXES)})")
    folder = Path(folder).expanduser()
    out_path = Path(out_path).expanduser().absolute()
    if out_path.exists() and not overwrite:
        raise OutputExistsError(f"{out_path} already exists (pass overwrite=True to replace it)")
    cfg = ModelConfig.from_file(folder / "config.json")
    if cfg.num_experts:
        raise ConversionError(folder / "config.json", f"model_type {cfg.model_type!r}: writing a mixture of "
                                                      f"experts to GGUF is not supported (llama.cpp's converter "
                                                      f"writes such files)")
    arch = cfg.family.gguf_export or next(
        (a for a, model_type in GGUF_ARCHITECTURES.items() if model_type == cfg.model_type), None)
    if arch is None:
        raise ConversionError(folder / "config.json",
                              f"model_type {cfg.model_type!r} cannot be written to GGUF "
                              f"(supported: {', '.join(GGUF_ARCHITECTURES.values())})")
    for switch, why in cfg.family.gguf_refuse.items():
        if getattr(cfg, switch):
            raise ConversionError(folder / "config.json", f"{why}: this model cannot be written to GGUF")
    windowed = sum(1 for i in range(cfg.num_hidden_layers) if cfg.attention_window(i))
    if windowed and not cfg.family.gguf_sliding_window:
        warnings.warn(f"{folder}: the sliding window of {cfg.sliding_window} positions ({windowed} of "
                      f"{cfg.num_hidden_layers} layers) is not written: llama.cpp's {arch} architecture "
                      f"attends to the whole context, and its own converter writes such a model so too",
                      UserWarning, stacklevel=2)
    ckpt = Checkpoint(folder)
    names = gguf_names(cfg)  # GGUF name -> (HF name, schema tensor), embedding first
    shapes = {}
    for g, (hf, t, _) in names.items():
        want = schema.hf_shape(t, cfg)
        got = ckpt.file_of(hf).shape(hf)
        if tuple(got) != tuple(want):
            raise ModelFileError(ckpt.file_of(hf).path, f"tensor {hf!r} has shape {list(got)}, "
                                                        f"config.json implies {list(want)}")
        shapes[g] = schema.gguf_shape(t, cfg)
    types = quants.plan(shapes, mix)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.parent / f".{out_path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        w.add_name(folder.absolute().name)
        w.add_file_type(quants.FILE_TYPES[mix])
        if any(q in quants.QTYPES for q in types.values()):
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        rope_tensors = _hyperparameters(w, cfg, folder)
        _tokenizer(w, folder, cfg)

        order = [(g, hf, t) for g, (hf, t, _) in names.items()]
        for name, table in rope_tensors.items():
            w.add_tensor_info(name, table.shape, np.dtype(np.float32), table.nbytes)
        for g, _, _ in order:
            qtype, shape = types[g], shapes[g]
            k = shape[-1]
            nbytes = quants.row_bytes(qtype, k) * math.prod(shape[:-1])
            # The writer takes a raw tensor's shape in bytes, rows last.
            byte_shape = (*shape[:-1], quants.row_bytes(qtype, k))
            w.add_tensor_info(g, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=quants.ggml_type(qtype))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()

        report = progress_fn(progress, f"Writing {out_path.name}")
        total = len(order)
        if report:
            report(0, total)
        for table in rope_tensors.values():
            w.write_tensor_data(table)
        heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads} if cfg.family.gguf_qk_interleaved \
            else {}
        for i, (g, hf, t) in enumerate(order):
            w.write_tensor_data(_gguf_rows(ckpt.file_of(hf), hf, shapes[g], types[g], heads.get(t.rope), t, cfg))
            if report:
                report(i + 1, total)
        w.close()
        if out_path.exists() and not overwrite:
            raise OutputExistsError(f"{out_path} already exists (pass overwrite=True to replace it)")
        os.replace(tmp, out_path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path
