"""config.json and generation_config.json from a GGUF file's metadata: the
llama.cpp hyperparameters of each architecture mapped back to the HF
config keys that transformers' own classes read.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from ..spec import schema
from ..spec.config import yarn_scaling
from ..spec.families import FAMILIES, GGUF_ARCHITECTURES
from ..spec.family import GgufMetadata, require
from ..spec.values import MAX_HEAD_DIM, shortest_float32
from .gguf_file import ConversionError


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
    if kind == "int or bool list":
        return type(value) is int or (isinstance(value, list) and all(type(v) is bool for v in value))
    if kind == "int list":
        return isinstance(value, list) and all(type(v) is int for v in value)
    if kind == "bool list":
        return isinstance(value, list) and all(type(v) is bool for v in value)
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
    "rope.scaling.original_context_length": "int", "rope.scaling.attn_factor": "number",
    "attention.sliding_window": "int", "nextn_predict_layers": "int",
    "rope.dimension_sections": "int list", "full_attention_interval": "int",
    "attention.recurrent_layers": "bool list", "ssm.conv_kernel": "int", "ssm.state_size": "int",
    "ssm.group_count": "int", "ssm.time_step_rank": "int", "ssm.inner_size": "int",
    "attention.scale": "number", "embedding_scale": "number", "residual_scale": "number", "logit_scale": "number",
    "attn_logit_softcapping": "number", "final_logit_softcapping": "number", "rope.freq_base_swa": "number",
    "attention.sliding_window_pattern": "int or bool list",
    "rope.scaling.yarn_beta_fast": "number", "rope.scaling.yarn_beta_slow": "number",
    "rope.scaling.yarn_log_multiplier": "number", "rope.scaling.yarn_ext_factor": "number",
    "attention.temperature_scale": "number",
    "expert_count": "int", "expert_used_count": "int", "expert_feed_forward_length": "int",
    "expert_shared_feed_forward_length": "int", "expert_gating_func": "int", "expert_weights_norm": "bool",
    "attention.key_length_swa": "int", "rope.dimension_count_swa": "int", "attention.shared_kv_layers": "int",
    "embedding_length_per_layer_input": "int",
}
# The hyperparameters every architecture has: config.json's key -> llama.cpp's
# (after "ARCH."), read here and written by gguf_writer.
GGUF_KEYS = {
    "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rope_theta": "rope.freq_base",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
}
# llama.cpp's expert_gating_func for a softmax router (the only one the families here have).
GGUF_SOFTMAX_GATING = 1


def check_metadata_types(md: dict, path: Path) -> None:
    """Refuse, naming the key, a value of the wrong type where the importer
    reads one (a string block count, a list where a name belongs)."""
    arch = md.get("general.architecture")
    rules = dict(_GENERAL_KEYS)
    if isinstance(arch, str):
        rules.update({f"{arch}.{k}": kind for k, kind in _ARCH_KEYS.items()})
    for key, value in md.items():
        kind = rules.get(key) or ("str" if key.startswith("tokenizer.chat_template.") else None)
        # None: an array of strings read without its strings (checked when
        # they are read, for the tokenizer).
        if kind and value is not None and not _kind_ok(value, kind):
            shown = repr(value) if not isinstance(value, list) else f"a list of {len(value)}"
            raise ConversionError(path, f"metadata {key!r} should be {kind}, not {shown[:80]}")


# --------------------------------------------------------------------------
# config.json


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
        return {"rope_type": "llama3", "factor": shortest_float32(factor),
                "low_freq_factor": shortest_float32(low), "high_freq_factor": shortest_float32(high),
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
        return {"rope_type": "linear", "factor": shortest_float32(factor)}
    if kind == "yarn":
        return _yarn_scaling(md, arch, factor, path)
    raise ConversionError(path, f"rope scaling type {kind!r} is not supported")


def _yarn_scaling(md: dict, arch: str, factor, path: Path) -> dict:
    """YaRN as llama.cpp runs a file: its ramp always truncated, and the
    attention factor from the factor and yarn_log_multiplier (transformers'
    mscale_all_dim) with mscale taken as 1, times rope.scaling.attn_factor
    where the file has one. llama.cpp reads neither yarn_attn_factor (the
    converter's copy of transformers' attention_factor) nor yarn_ext_factor
    (it extrapolates fully), and neither is read here."""
    if factor is None or not factor > 0:
        raise ConversionError(path, f"YaRN scaling needs a positive {arch}.rope.scaling.factor, got {factor!r}")
    orig = md.get(f"{arch}.rope.scaling.original_context_length", md.get(f"{arch}.context_length"))
    if type(orig) is not int or orig < 1:
        raise ConversionError(path, f"YaRN scaling needs a positive {arch}.rope.scaling.original_context_length, "
                                    f"got {orig!r}")
    scaling = {"rope_type": "yarn", "factor": shortest_float32(factor), "original_max_position_embeddings": orig,
               "truncate": True}
    for key, hf, default in (("yarn_beta_fast", "beta_fast", 32.0), ("yarn_beta_slow", "beta_slow", 1.0)):
        value = md.get(f"{arch}.rope.scaling.{key}", default)
        if not value > 0:
            raise ConversionError(path, f"{arch}.rope.scaling.{key} is {value}; it must be positive")
        scaling[hf] = shortest_float32(value)
    log_mul = md.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)
    if log_mul:
        scaling.update(mscale=1.0, mscale_all_dim=shortest_float32(log_mul))
    extra = md.get(f"{arch}.rope.scaling.attn_factor", 1.0)
    if not extra > 0:
        raise ConversionError(path, f"{arch}.rope.scaling.attn_factor is {extra}; it must be positive")
    if extra != 1.0:
        derived = yarn_scaling(scaling, {"max_position_embeddings": orig}, path)["attention_factor"]
        scaling["attention_factor"] = derived * float(np.float32(extra))
    return scaling


def _experts_keys(md: dict, arch: str, family, a, path: Path) -> dict:
    """config.json keys of a mixture of experts, as llama.cpp runs the file:
    every layer routes, through a softmax, and the chosen experts' weights
    are always renormalised (llama.cpp reads no norm_topk_prob); a shared
    expert's size defaults to the MLP's."""
    gating = md.get(f"{arch}.expert_gating_func", GGUF_SOFTMAX_GATING)
    if gating != GGUF_SOFTMAX_GATING:
        raise ConversionError(path, f"{arch}.expert_gating_func is {gating}; only a softmax router "
                                    f"({GGUF_SOFTMAX_GATING}) is supported")
    n, used = int(a("expert_count")), int(a("expert_used_count"))
    if not 0 < used <= n:
        raise ConversionError(path, f"{arch}.expert_used_count is {used}; it must be from 1 to expert_count ({n})")
    keys = {family.experts_keys[0]: n, "num_experts_per_tok": used}
    if family.expert_size_key != "intermediate_size":
        keys[family.expert_size_key] = int(a("expert_feed_forward_length"))
    if isinstance(family.norm_topk_prob, str):
        keys[family.norm_topk_prob] = True
    if family.sparse_layer_keys:
        keys.update(mlp_only_layers=[], decoder_sparse_step=1)
    if family.shared_expert:
        keys["shared_expert_intermediate_size"] = int(md.get(f"{arch}.expert_shared_feed_forward_length",
                                                             md.get(f"{arch}.feed_forward_length", 0)))
    return keys


def model_config(md: dict, shapes: dict, path: Path, dtype: str, rope_freqs=None, rope_factors=None) -> dict:
    arch = md["general.architecture"]
    model_type = GGUF_ARCHITECTURES[arch]
    family = FAMILIES[model_type]
    if md.get(f"{arch}.expert_count") and not family.experts_keys:
        if not family.gguf_experts:
            raise ConversionError(path, f"{arch} files with experts are not supported")
        model_type = family.gguf_experts   # Mixtral: a llama file with experts
        family = FAMILIES[model_type]
    source_md, source_freqs = md, rope_freqs
    if family.gguf_prepare:
        md, rope_freqs = family.gguf_prepare(md, arch, shapes, rope_freqs, path)

    def a(key):
        value = require(md, f"{arch}.{key}", path)
        if isinstance(value, list):
            raise ConversionError(path, f"per-layer values of {arch}.{key} are not supported")
        return value

    if "token_embd.weight" not in shapes:
        raise ConversionError(path, "no token_embd.weight tensor")
    for name in ("token_embd.weight", "blk.0.attn_q.weight"):
        if name in shapes and len(shapes[name]) != 2:
            raise ConversionError(path, f"tensor {name} has shape {list(shapes[name])}, not two dimensions")
    vocab_size, hidden = shapes["token_embd.weight"]
    # llama.cpp counts a checkpoint's multi-token-prediction layers as blocks.
    n_layers = int(a(GGUF_KEYS["num_hidden_layers"])) - int(md.get(f"{arch}.nextn_predict_layers", 0))
    if not 0 < n_layers <= len(shapes):
        # Every layer has tensors: a count past them would only make the
        # tensor plan below loop over layers that cannot be there.
        raise ConversionError(path, f"{arch}.block_count is {n_layers}, but the file has "
                                    f"{len(shapes)} tensors")
    n_heads = int(a(GGUF_KEYS["num_attention_heads"]))
    if n_heads < 1:
        raise ConversionError(path, f"{arch}.attention.head_count is {n_heads}; it must be at least 1")
    n_kv = md.get(f"{arch}.{GGUF_KEYS['num_key_value_heads']}", n_heads)
    if isinstance(n_kv, list):
        raise ConversionError(path, "per-layer key/value head counts are not supported")
    n_kv = int(n_kv)
    if int(a(GGUF_KEYS["hidden_size"])) != hidden:
        raise ConversionError(path, f"embedding_length {a(GGUF_KEYS['hidden_size'])} != token_embd width {hidden}")

    # The first layer with attention (a hybrid model's first layers may have none).
    first_attention = next((i for i in range(n_layers) if f"blk.{i}.attn_q.weight" in shapes), None)
    q_rows = shapes.get(f"blk.{first_attention}.attn_q.weight", (None,))[0]
    if q_rows is not None and family.attn_output_gate:
        q_rows //= 2   # attn_q holds each head's query and its output gate
    head_dim = md.get(f"{arch}.{GGUF_KEYS['head_dim']}")
    if head_dim is None:
        head_dim = q_rows // n_heads if q_rows else hidden // n_heads
    head_dim = int(head_dim)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ConversionError(path, f"the head size comes out as {head_dim}; it must be 1 to {MAX_HEAD_DIM}")
    if q_rows is not None and q_rows != n_heads * head_dim:
        raise ConversionError(path, f"attn_q has {q_rows} rows, expected {n_heads} heads x {head_dim}")
    rope_dim = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim and not (family.gguf_partial_rotary and 0 < rope_dim < head_dim and rope_dim % 2 == 0):
        raise ConversionError(path, f"partial rotary embeddings (rope dim {rope_dim} of {head_dim}) are not supported")

    tied = schema.LM_HEAD.gguf not in shapes
    theta = float(md.get(f"{arch}.{GGUF_KEYS['rope_theta']}", 10000.0))

    experts = _experts_keys(md, arch, family, a, path) if family.experts_keys else {}
    cfg = {
        "architectures": [family.hf_class],
        "model_type": model_type,
        "hidden_size": int(hidden),
        # Where every layer routes, the MLP size only matters to a shared expert.
        "intermediate_size": int(md.get(f"{arch}.{GGUF_KEYS['intermediate_size']}", 0) if experts
                                 else a(GGUF_KEYS["intermediate_size"]))
        or experts.get("moe_intermediate_size", 0),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        **experts,
    }
    # transformers' own GGUF loader always sets head_dim where the config
    # has the field (llama, qwen3); qwen2's has none.
    if family.gguf_head_dim:
        cfg["head_dim"] = head_dim
    elif head_dim != hidden // n_heads:
        raise ConversionError(path, f"{arch} with head_dim {head_dim} != hidden/heads is not supported")
    cfg.update({
        "max_position_embeddings": int(a(GGUF_KEYS["max_position_embeddings"])),
        "rms_norm_eps": shortest_float32(a(GGUF_KEYS["rms_norm_eps"])),
        "rope_theta": shortest_float32(theta),
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
    if family.gguf_read:
        family.gguf_read(GgufMetadata(md, arch, path, shapes, source_md=source_md, rope_freqs=source_freqs,
                                      n_layers=n_layers, hidden=hidden, n_heads=n_heads, head_dim=head_dim,
                                      rope_dim=rope_dim, theta=theta, rope_factors=rope_factors), cfg)
    cfg["attention_dropout"] = 0.0
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        v = md.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[name] = int(v)
    cfg["torch_dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    cfg["use_cache"] = True
    return cfg


def generation_config(md: dict) -> dict:
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


