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
from .gguf_file import ConversionError, require


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
# llama.cpp's expert_gating_func for a softmax router (the only one the families here have).
GGUF_SOFTMAX_GATING = 1
# llama.cpp's smollm3 skips RoPE in every fourth layer; its GGUF files say nothing of it.
GGUF_NO_ROPE_INTERVAL = 4
# What llama.cpp's gemma2 and gemma3 take where a file says nothing: the
# window (gemma3: none) and how many layers make one local/global period;
# the soft-caps (gemma3 reads no attention cap); and the block count of the
# 27B size, whose attention scale is 1/sqrt(hidden/heads), not 1/sqrt(head_dim).
GEMMA_GGUF = {
    "gemma2": dict(window=4096, pattern=2, attn_softcap=50.0, final_softcap=30.0, width_scaled_layers=46,
                   local_rope=False),
    "gemma3": dict(window=None, pattern=6, attn_softcap=None, final_softcap=None, width_scaled_layers=62,
                   local_rope=True),
}


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
    scaling = {"rope_type": "yarn", "factor": _shortest_float32(factor), "original_max_position_embeddings": orig,
               "truncate": True}
    for key, hf, default in (("yarn_beta_fast", "beta_fast", 32.0), ("yarn_beta_slow", "beta_slow", 1.0)):
        value = md.get(f"{arch}.rope.scaling.{key}", default)
        if not value > 0:
            raise ConversionError(path, f"{arch}.rope.scaling.{key} is {value}; it must be positive")
        scaling[hf] = _shortest_float32(value)
    log_mul = md.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)
    if log_mul:
        scaling.update(mscale=1.0, mscale_all_dim=_shortest_float32(log_mul))
    extra = md.get(f"{arch}.rope.scaling.attn_factor", 1.0)
    if not extra > 0:
        raise ConversionError(path, f"{arch}.rope.scaling.attn_factor is {extra}; it must be positive")
    if extra != 1.0:
        derived = yarn_scaling(scaling, {"max_position_embeddings": orig}, path)["attention_factor"]
        scaling["attention_factor"] = derived * float(np.float32(extra))
    return scaling


# Granite's multipliers: llama.cpp's key (after "ARCH.") for each config.json
# key, read here and written by gguf_writer.
GGUF_MULTIPLIERS = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                    "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}


def _multipliers(md: dict, arch: str, head_dim: int, path: Path) -> dict:
    """Granite's multipliers from llama.cpp's scales, with llama.cpp's
    defaults where a key is absent (its converter leaves out zeros): no
    scaling, and the attention's 1/sqrt(head_dim)."""
    out = {}
    for hf, key in GGUF_MULTIPLIERS.items():
        default = head_dim ** -0.5 if hf == "attention_multiplier" else 1.0
        value = md.get(f"{arch}.{key}")
        if value is not None and not value > 0:
            raise ConversionError(path, f"{arch}.{key} is {value}; it must be positive")
        out[hf] = default if value is None else _shortest_float32(value)
    return out


def _phi3_keys(md: dict, arch: str, rope_dim: int, head_dim: int, factors: dict, path: Path) -> dict:
    """config.json keys of Phi-3's partial rotary, LongRoPE and sliding
    window, from llama.cpp's rope_factors_long/short tensors and metadata."""
    keys = {}
    if rope_dim != head_dim:
        keys["partial_rotary_factor"] = rope_dim / head_dim
    window = md.get(f"{arch}.attention.sliding_window")
    if window is not None and (type(window) is not int or window < 0):
        raise ConversionError(path, f"{arch}.attention.sliding_window should be a count, not {window!r}")
    if window:   # the converter writes 0 for none
        keys["sliding_window"] = window
    if not factors:
        return keys
    if set(factors) != {"long", "short"}:
        raise ConversionError(path, "a rope_factors_long tensor needs a rope_factors_short one, and back")
    orig = md.get(f"{arch}.rope.scaling.original_context_length")
    if type(orig) is not int or orig < 1:
        raise ConversionError(path, f"rope factors without a valid {arch}.rope.scaling.original_context_length "
                                    f"(got {orig!r})")
    scaling = {"rope_type": "longrope"}
    for kind in ("short", "long"):
        values = np.asarray(factors[kind], np.float32).reshape(-1)
        if values.size != rope_dim // 2 or not (np.isfinite(values).all() and (values > 0).all()):
            raise ConversionError(path, f"rope_factors_{kind} must hold {rope_dim // 2} positive numbers")
        scaling[f"{kind}_factor"] = [_shortest_float32(v) for v in values]
    # The attention factor transformers would derive, unless the file's differs.
    attn = md.get(f"{arch}.rope.scaling.attn_factor")
    factor = md[f"{arch}.context_length"] / orig
    default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    if attn is not None and np.float32(attn) != np.float32(default):
        scaling["attention_factor"] = _shortest_float32(attn)
    keys.update(original_max_position_embeddings=orig, rope_scaling=scaling)
    return keys


def _linear_attention(md: dict, arch: str, n_layers: int, a, path: Path) -> dict:
    """The Gated DeltaNet keys of a hybrid model (Qwen3.5: llama.cpp's
    ssm.* names) and its layer_types."""
    def positive(key):
        value = int(a(key))
        if value < 1:
            raise ConversionError(path, f"{arch}.{key} is {value}; it must be at least 1")
        return value
    hk, hv = positive("ssm.group_count"), positive("ssm.time_step_rank")
    inner = positive("ssm.inner_size")
    if inner % hv:
        raise ConversionError(path, f"{arch}.ssm.inner_size {inner} is not a whole number of "
                                    f"{hv} value heads (ssm.time_step_rank)")
    recurrent = md.get(f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        # One entry per block, the multi-token-prediction ones included.
        if len(recurrent) < n_layers:
            raise ConversionError(path, f"{arch}.attention.recurrent_layers has {len(recurrent)} entries "
                                        f"for {n_layers} layers")
        recurrent = recurrent[:n_layers]
    else:
        interval = int(md.get(f"{arch}.full_attention_interval", 4))
        if interval < 1:
            raise ConversionError(path, f"{arch}.full_attention_interval is {interval}; it must be at least 1")
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    return {
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "linear_conv_kernel_dim": positive("ssm.conv_kernel"),
        "linear_key_head_dim": positive("ssm.state_size"),
        "linear_num_key_heads": hk,
        "linear_num_value_heads": hv,
        "linear_value_head_dim": inner // hv,
    }


def _gemma_keys(md: dict, arch: str, n_layers: int, hidden: int, n_heads: int, head_dim: int, theta: float,
                scaling, path: Path) -> dict:
    """config.json keys of Gemma 2/3 from llama.cpp's metadata, as llama.cpp
    runs the file: which layers slide and how far, the local layers' RoPE
    base (Gemma 3), the soft-caps, and the attention scale llama.cpp
    derives from the shapes (its files hold no query_pre_attn_scalar)."""
    assumed = GEMMA_GGUF[arch]
    window = md.get(f"{arch}.attention.sliding_window", assumed["window"])
    if window is not None and (type(window) is not int or window < 0):
        raise ConversionError(path, f"{arch}.attention.sliding_window should be a count, not {window!r}")
    pattern = md.get(f"{arch}.attention.sliding_window_pattern", assumed["pattern"])
    if isinstance(pattern, list):
        if len(pattern) < n_layers:
            raise ConversionError(path, f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                                        f"for {n_layers} layers")
        sliding = [bool(v) for v in pattern[:n_layers]]
    else:
        if pattern < 0:
            raise ConversionError(path, f"{arch}.attention.sliding_window_pattern is {pattern}")
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    if not window:   # no window: every layer global
        sliding = [False] * n_layers
    keys = {"layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "sliding_window": window or None,
            "query_pre_attn_scalar": hidden // n_heads if n_layers == assumed["width_scaled_layers"] else head_dim,
            "hidden_activation": "gelu_pytorch_tanh"}
    # llama.cpp's gemma3 reads no attention cap, and a final cap of 0 (its default there) is none.
    attn = md.get(f"{arch}.attn_logit_softcapping", assumed["attn_softcap"]) if assumed["attn_softcap"] else None
    final = md.get(f"{arch}.final_logit_softcapping", assumed["final_softcap"])
    for name, value in (("attn_logit_softcapping", attn), ("final_logit_softcapping", final)):
        keys[name] = _shortest_float32(value) if value else None
    if assumed["local_rope"]:   # Gemma 3's local layers rotate with a base of their own
        swa_theta = md.get(f"{arch}.rope.freq_base_swa", 10000.0)
        keys["rope_parameters"] = {
            "full_attention": {**(scaling or {"rope_type": "default"}), "rope_theta": _shortest_float32(theta)},
            "sliding_attention": {"rope_type": "default", "rope_theta": _shortest_float32(swa_theta)}}
    return keys


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


def _gemma4_keys(md: dict, arch: str, shapes: dict, rope_freqs, path: Path) -> tuple:
    """(md with Gemma 4's per-layer lists read as its sliding layers' values,
    the config.json keys of its per-layer switches), as llama.cpp runs the
    file: the global layers' head size, KV heads and MLP width, values that
    are the keys where they have no attn_v, caches shared by the last
    shared_kv_layers, per-layer inputs, and the global layers' proportional
    RoPE from rope_freqs (factors of 1 rotated, the rest not)."""
    n_layers = int(require(md, f"{arch}.block_count", path))
    pattern = md.get(f"{arch}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n_layers:
        raise ConversionError(path, f"{arch}.attention.sliding_window_pattern should list each of the "
                                    f"{n_layers} layers")
    sliding = [bool(v) for v in pattern]
    if all(sliding) or not any(sliding):
        raise ConversionError(path, f"{arch}: both sliding and global layers are expected")
    swa, full = sliding.index(True), sliding.index(False)
    shared = int(md.get(f"{arch}.attention.shared_kv_layers", 0))
    if not 0 <= shared < n_layers:
        raise ConversionError(path, f"{arch}.attention.shared_kv_layers is {shared} of {n_layers} layers")

    first_shared = n_layers - shared
    if shared and (first_shared < 2 or sliding[first_shared - 2:first_shared] != [True, False]):
        # llama.cpp's gemma4 has layers from there on read the cache of the
        # last layer before them for the global ones and of the one before
        # that for the sliding ones; transformers' the last of each type.
        raise ConversionError(path, f"{arch}: the layers sharing caches start at {first_shared}, after layers "
                                    "that are not a sliding one then a global one: llama.cpp would run "
                                    "them with other layers' caches than transformers")

    def per_layer(key, default=None):
        v = md.get(f"{arch}.{key}", default)
        v = v if isinstance(v, list) else [v] * n_layers
        if len(v) != n_layers or any(type(x) is not int or x < 1 for x in v):
            raise ConversionError(path, f"{arch}.{key} should be a positive count, or one for each layer")
        return v
    ff = per_layer("feed_forward_length")
    double = ff[-1] == 2 * ff[0] and shared > 0
    want_ff = [ff[0] * (2 if double and i >= n_layers - shared else 1) for i in range(n_layers)]
    kv = per_layer("attention.head_count_kv", require(md, f"{arch}.attention.head_count", path))
    head_full = int(require(md, f"{arch}.attention.key_length", path))
    head_swa = int(md.get(f"{arch}.attention.key_length_swa", head_full))
    want_kv = [kv[swa] if s else kv[full] for s in sliding]
    if ff != want_ff or kv != want_kv:
        raise ConversionError(path, f"{arch}: feed_forward_length {ff} or head_count_kv {kv} differ otherwise "
                                    "than between sliding and global layers (and the MLP of the layers sharing "
                                    "a cache)")
    if int(md.get(f"{arch}.rope.dimension_count_swa", head_swa)) != head_swa or \
            int(md.get(f"{arch}.rope.dimension_count", head_full)) != head_full:
        raise ConversionError(path, f"{arch}: partial RoPE other than the global layers' proportional one "
                                    "is not supported")
    partial = 1.0
    if rope_freqs is not None:
        factors = np.asarray(rope_freqs, np.float64).reshape(-1)
        rotated = int(np.sum(factors == 1.0))
        if len(factors) != head_full // 2 or not (factors[:rotated] == 1.0).all() or \
                not (factors[rotated:] >= 1e30).all():
            raise ConversionError(path, "rope_freqs should hold factors of 1 for the rotated dims of the global "
                                        "layers' heads and 1e30 for the rest")
        partial = 2 * rotated / head_full
    window = md.get(f"{arch}.attention.sliding_window")
    if type(window) is not int or window < 1:
        raise ConversionError(path, f"{arch}.attention.sliding_window should be a positive count, not {window!r}")
    final = md.get(f"{arch}.final_logit_softcapping")
    ple = int(md.get(f"{arch}.embedding_length_per_layer_input", 0))
    vocab = shapes["token_embd.weight"][0]
    keys = {
        "head_dim": head_swa, "intermediate_size": ff[0], "num_key_value_heads": kv[swa],
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "per_layer_config": {str(i): {"head_dim": head_full, "num_key_value_heads": kv[full]}
                             for i, s in enumerate(sliding) if not s},
        "attention_k_eq_v": f"blk.{full}.attn_v.weight" not in shapes,
        "num_kv_shared_layers": shared, "use_double_wide_mlp": double,
        "hidden_size_per_layer_input": ple, "vocab_size_per_layer_input": vocab,
        "sliding_window": window, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": _shortest_float32(final) if final else None,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": partial,
                               "rope_theta": _shortest_float32(md.get(f"{arch}.rope.freq_base", 1000000.0))},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": _shortest_float32(md.get(f"{arch}.rope.freq_base_swa", 10000.0))}},
    }
    plain = dict(md)
    plain.update({f"{arch}.feed_forward_length": ff[0], f"{arch}.attention.head_count_kv": kv[swa],
                  f"{arch}.attention.key_length": head_swa, f"{arch}.rope.dimension_count": head_swa})
    return plain, keys


def model_config(md: dict, shapes: dict, path: Path, dtype: str, rope_freqs=None, rope_factors=None) -> dict:
    arch = md["general.architecture"]
    model_type = GGUF_ARCHITECTURES[arch]
    family = FAMILIES[model_type]
    if md.get(f"{arch}.expert_count") and not family.experts_keys:
        if not family.gguf_experts:
            raise ConversionError(path, f"{arch} files with experts are not supported")
        model_type = family.gguf_experts   # Mixtral: a llama file with experts
        family = FAMILIES[model_type]
    gemma4 = None
    if family.gemma4_layers:
        if "token_embd.weight" not in shapes:
            raise ConversionError(path, "no token_embd.weight tensor")
        md, gemma4 = _gemma4_keys(md, arch, shapes, rope_freqs, path)
        rope_freqs = None

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
    n_layers = int(a("block_count")) - int(md.get(f"{arch}.nextn_predict_layers", 0))
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

    linear = _linear_attention(md, arch, n_layers, a, path) if family.linear_attention else {}
    kinds = linear.get("layer_types", ["full_attention"])
    first_attention = kinds.index("full_attention") if "full_attention" in kinds else None
    q_rows = shapes.get(f"blk.{first_attention}.attn_q.weight", (None,))[0]
    if q_rows is not None and family.attn_output_gate:
        q_rows //= 2   # attn_q holds each head's query and its output gate
    head_dim = md.get(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = q_rows // n_heads if q_rows else hidden // n_heads
    head_dim = int(head_dim)
    if head_dim < 1:
        raise ConversionError(path, f"the head size comes out as {head_dim}; it must be at least 1")
    if q_rows is not None and q_rows != n_heads * head_dim:
        raise ConversionError(path, f"attn_q has {q_rows} rows, expected {n_heads} heads x {head_dim}")
    rope_dim = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    partial = family.gguf_longrope or family.linear_attention
    if rope_dim != head_dim and not (partial and 0 < rope_dim < head_dim and rope_dim % 2 == 0):
        raise ConversionError(path, f"partial rotary embeddings (rope dim {rope_dim} of {head_dim}) are not supported")

    tied = schema.LM_HEAD.gguf not in shapes
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))

    experts = _experts_keys(md, arch, family, a, path) if family.experts_keys else {}
    cfg = {
        "architectures": [family.hf_class],
        "model_type": model_type,
        "hidden_size": int(hidden),
        # Where every layer routes, the MLP size only matters to a shared expert.
        "intermediate_size": int(md.get(f"{arch}.feed_forward_length", 0) if experts else a("feed_forward_length"))
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
        "max_position_embeddings": int(a("context_length")),
        "rms_norm_eps": _shortest_float32(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest_float32(theta),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
    })
    if family.linear_attention:
        # Qwen3.5's rope: partial, and multimodal (its sections only matter
        # for images; text positions rotate as plain RoPE).
        sections = md.get(f"{arch}.rope.dimension_sections") or [11, 11, 10, 0]
        cfg["rope_parameters"] = {
            "rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
            "partial_rotary_factor": rope_dim / head_dim, "mrope_section": [int(x) for x in sections[:3]],
            "mrope_interleaved": True}
        cfg.update(linear)
    scaling = _rope_scaling(md, arch, path)
    if rope_freqs is not None:
        if scaling is not None:
            raise ConversionError(path, "a rope_freqs tensor beside rope scaling metadata is not understood")
        scaling = _llama3_rope_scaling(rope_freqs, theta, head_dim, path)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if family.query_position_scale:
        # Ministral 3's rope parameters hold the query scaling beside YaRN,
        # and say "default" outright (transformers' default is YaRN).
        params = dict(cfg.pop("rope_scaling", None) or {"rope_type": "default"}, rope_theta=cfg.pop("rope_theta"))
        beta = md.get(f"{arch}.attention.temperature_scale", 0.0)
        if beta:
            if not beta > 0:
                raise ConversionError(path, f"{arch}.attention.temperature_scale is {beta}; it must be positive")
            params["llama_4_scaling_beta"] = _shortest_float32(beta)
            params.setdefault("original_max_position_embeddings", md.get(
                f"{arch}.rope.scaling.original_context_length", cfg["max_position_embeddings"]))
        cfg["rope_parameters"] = params
    if family.gguf_longrope:
        cfg.update(_phi3_keys(md, arch, int(rope_dim), head_dim, rope_factors or {}, path))
    # A bias switch that config.json holds is set by layer 0's tensors; the
    # tensor plan then checks every layer against the resulting config.
    for t in schema.LAYER:
        key = getattr(family, t.switch, None) if t.switch else None
        if isinstance(key, str) and key not in cfg:
            cfg[key] = f"blk.0.{t.gguf}" in shapes
    if family.no_rope_layers:
        cfg["no_rope_layer_interval"] = GGUF_NO_ROPE_INTERVAL
    if family.multipliers:
        cfg.update(_multipliers(md, arch, head_dim, path))
    if arch in GEMMA_GGUF:
        cfg.pop("hidden_act")
        gemma = _gemma_keys(md, arch, n_layers, hidden, n_heads, head_dim, theta, cfg.get("rope_scaling"), path)
        if "rope_parameters" in gemma:   # Gemma 3: the RoPE of each layer type
            cfg.pop("rope_theta")
            cfg.pop("rope_scaling", None)
        cfg.update(gemma)
    if gemma4 is not None:
        for key in ("hidden_act", "rope_theta", "rope_scaling"):
            cfg.pop(key, None)
        cfg.update(gemma4)
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


