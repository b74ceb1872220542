"""Gemma 4's dense text model: Gemma 3 with x * w norms and per-layer
switches: per-layer inputs, value norms, layer scalars, the global layers'
own head size (and KV heads with attention_k_eq_v, values being the keys),
KV caches shared by the last num_kv_shared_layers (their MLP twice as wide
with use_double_wide_mlp); softmax scale 1."""
from pathlib import Path

import numpy as np

from ..errors import ConversionError, ModelFileError
from ..family import Family, require
from ..values import MAX_HEAD_DIM, head_dim_ok, positive_int, shortest_float32
from .gemma import GEMMA

# transformers' Gemma4TextConfig defaults.
DEFAULTS = dict(
    vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, global_head_dim=512, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=512,
    sliding_window_pattern=6, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
    rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                         full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                             rope_theta=1000000.0)),
    pad_token_id=0, eos_token_id=1, bos_token_id=2)


def gemma4_layers(raw: dict, n_layers: int, heads: int, layer_types: list, path) -> dict:
    """Gemma 4's per-layer switches from config.json, checked (see
    ModelConfig.layer_config for what they do)."""
    def count(key, default, minimum=0):
        v = raw.get(key, default)
        if not (isinstance(v, int) and not isinstance(v, bool) and minimum <= v < 2**31):
            raise ModelFileError(path, f"{key} must be an integer of at least {minimum}, got {v!r}")
        return v

    def flag(key):
        v = raw.get(key, False)
        if not isinstance(v, bool):
            raise ModelFileError(path, f"{key} must be true or false, got {v!r}")
        return v
    out = dict(hidden_size_per_layer_input=count("hidden_size_per_layer_input", 0),
               attention_k_eq_v=flag("attention_k_eq_v"), num_kv_shared_layers=count("num_kv_shared_layers", 0),
               use_double_wide_mlp=flag("use_double_wide_mlp"))
    if out["hidden_size_per_layer_input"] and raw.get("vocab_size_per_layer_input") != raw.get("vocab_size"):
        raise ModelFileError(path, "vocab_size_per_layer_input must equal vocab_size (per-layer inputs of "
                                   f"another vocabulary are not supported), got "
                                   f"{raw.get('vocab_size_per_layer_input')!r}")
    out["layer_sizes"] = layer_sizes(raw, n_layers, heads, layer_types, out["attention_k_eq_v"], path)
    shared = out["num_kv_shared_layers"]
    if shared > n_layers:
        raise ModelFileError(path, f"num_kv_shared_layers ({shared}) exceeds num_hidden_layers ({n_layers})")
    if shared and shared < n_layers and set(layer_types[:n_layers - shared]) != set(layer_types):
        raise ModelFileError(path, "num_kv_shared_layers: every layer type sharing a cache needs an earlier "
                                   "layer of its type with a cache of its own")
    if shared == n_layers:
        raise ModelFileError(path, "num_kv_shared_layers equal to num_hidden_layers leaves no layer "
                                   "with a cache of its own")
    return out


def layer_sizes(raw: dict, n_layers: int, heads: int, layer_types: list, k_eq_v: bool, path) -> dict:
    """{layer: {"head_dim": .., "num_key_value_heads": ..}} of the layers
    whose sizes differ from the config's, as transformers' Gemma4TextConfig
    reads them: per_layer_config as it saves it, else the full-attention
    layers with global_head_dim (and num_global_key_value_heads, where
    attention_k_eq_v) as published configs give them."""
    given = raw.get("per_layer_config")
    if given is None:
        sizes = {"head_dim": raw.get("global_head_dim", 512)}
        if k_eq_v and raw.get("num_global_key_value_heads") is not None:
            sizes["num_key_value_heads"] = raw["num_global_key_value_heads"]
        given = {i: sizes for i, t in enumerate(layer_types) if t == "full_attention"}
    if not isinstance(given, dict):
        raise ModelFileError(path, f"per_layer_config must be an object, got {given!r}"[:200])
    out = {}
    for key, sizes in given.items():
        layer = int(key) if isinstance(key, str) and key.isdigit() else key
        if not (isinstance(layer, int) and 0 <= layer < n_layers) or not isinstance(sizes, dict):
            raise ModelFileError(path, f"per_layer_config: {key!r} is not a layer index with an object of sizes")
        unknown = sizes.keys() - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ModelFileError(path, f"per_layer_config of layer {layer}: {sorted(unknown)} are not supported "
                                       "(only head_dim and num_key_value_heads)")
        head_dim, kv = sizes.get("head_dim"), sizes.get("num_key_value_heads")
        if head_dim is not None and not head_dim_ok(head_dim):
            raise ModelFileError(path, f"head_dim of layer {layer} must be a positive even integer of at most "
                                       f"{MAX_HEAD_DIM}, got {head_dim!r}")
        if kv is not None and not (positive_int(kv) and heads % kv == 0):
            raise ModelFileError(path, f"num_attention_heads ({heads}) must be a multiple of layer {layer}'s "
                                       f"num_key_value_heads ({kv!r})")
        out[layer] = {k: v for k, v in sizes.items() if v is not None}
    return out


def read_config(raw: dict, fields: dict, path) -> dict:
    layer_types = fields["layer_types"]
    if layer_types[-1] != "full_attention":
        # transformers' Gemma4TextConfig makes the last layer a global one whatever config.json says.
        layer_types = layer_types[:-1] + ["full_attention"]
    return dict(gemma4_layers(raw, len(layer_types), fields["num_attention_heads"], layer_types, path),
                layer_types=layer_types, gemma4_layers=True, attention_multiplier=1.0)


def gguf_keys(md: dict, arch: str, shapes: dict, rope_freqs, path: Path) -> tuple:
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
        "final_logit_softcapping": shortest_float32(final) if final else None,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": partial,
                               "rope_theta": shortest_float32(md.get(f"{arch}.rope.freq_base", 1000000.0))},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": shortest_float32(md.get(f"{arch}.rope.freq_base_swa", 10000.0))}},
    }
    plain = dict(md)
    plain.update({f"{arch}.feed_forward_length": ff[0], f"{arch}.attention.head_count_kv": kv[swa],
                  f"{arch}.attention.key_length": head_swa, f"{arch}.rope.dimension_count": head_swa})
    return plain, keys


def gguf_prepare(md: dict, arch: str, shapes: dict, rope_freqs, path: Path) -> tuple:
    """The metadata with the per-layer lists read as the sliding layers'
    values, and no rope_freqs (the global layers' RoPE, read by gguf_read)."""
    if "token_embd.weight" not in shapes:
        raise ConversionError(path, "no token_embd.weight tensor")
    return gguf_keys(md, arch, shapes, rope_freqs, path)[0], None


def gguf_read(meta, cfg: dict) -> None:
    for key in ("hidden_act", "rope_theta", "rope_scaling"):
        cfg.pop(key, None)
    cfg.update(gguf_keys(meta.source_md, meta.arch, meta.shapes, meta.rope_freqs, meta.path)[1])


FAMILIES = {
    "gemma4_text": Family("Gemma4ForCausalLM", **dict(
        GEMMA, norm_plus_one=False, query_pre_attn_scalar=False,
        refuse=dict(GEMMA["refuse"], enable_moe_block="Gemma 4's mixture-of-experts block is not supported yet",
                    attention_bias="biases are not supported for gemma4_text")),
        qk_norm=True, local_rope=True, defaults=DEFAULTS, gguf="gemma4",
        gguf_refuse={"gemma4_layers": "Gemma 4 cannot be written to GGUF by fastllm yet (llama.cpp's converter "
                                      "writes it)"},
        read_config=read_config, gguf_prepare=gguf_prepare, gguf_read=gguf_read),
    "gemma4": Family("Gemma4ForConditionalGeneration", text_config="gemma4_text",
                     weight_prefix="model.language_model."),
}
