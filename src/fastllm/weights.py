"""HF checkpoint tensors -> the arrays the C run loop reads.

Matrices keep HF's (out_features, in_features) layout. fp32 tensors are used
in place from the memory map; bf16/f16 tensors are converted once. Q and K
rows (and their biases and norms) are permuted inside each head so that RoPE
rotates adjacent pairs: HF rotates dims (i, i + rope_dim/2) together, the C
loop rotates (2i, 2i+1).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import ModelFileError
from .safetensors import SafetensorsFile, bf16_to_f32, f32_to_bf16

# HF name of each per-layer tensor, by the C loop's name.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "b_gate": "mlp.gate_proj.bias",
    "b_up": "mlp.up_proj.bias",
    "b_down": "mlp.down_proj.bias",
}
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
ROPE_PERMUTED = {"wq": "q", "bq": "q", "wk": "k", "bk": "k", "q_norm": "norm", "k_norm": "norm"}


def rope_permutation(head_dim: int, rope_dim: int) -> np.ndarray:
    """Index map within one head: new row 2i is old row i, new row 2i+1 is
    old row i + rope_dim/2; dims past rope_dim stay where they are."""
    half = rope_dim // 2
    perm = np.arange(head_dim)
    perm[0:rope_dim:2] = np.arange(half)
    perm[1:rope_dim:2] = np.arange(half) + half
    return perm


class Checkpoint:
    """The tensors of model.safetensors or of a sharded checkpoint."""

    def __init__(self, folder):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        self.files = {}
        self.where = {}
        if single.exists():
            f = SafetensorsFile(single)
            self.files[single.name] = f
            self.where = {name: f for name in f.keys()}
        elif index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelFileError(index, f"not a valid safetensors index: {e}") from None
            for name, shard in weight_map.items():
                if shard not in self.files:
                    if Path(shard).name != shard:
                        raise ModelFileError(index, f"shard name {shard!r} is not a plain file name")
                    self.files[shard] = SafetensorsFile(folder / shard)
                if name not in self.files[shard]:
                    raise ModelFileError(folder / shard, f"tensor {name!r} listed in the index is missing")
                self.where[name] = self.files[shard]
        else:
            raise ModelFileError(folder, "no model.safetensors or model.safetensors.index.json")

    def __contains__(self, name):
        return name in self.where

    def file_of(self, name) -> SafetensorsFile:
        try:
            return self.where[name]
        except KeyError:
            raise ModelFileError(next(iter(self.files.values())).path if self.files else None,
                                 f"tensor {name!r} is missing") from None


def _as_compute_dtype(f: SafetensorsFile, name: str, bf16: bool, perm=None, heads=None):
    """A tensor in the compute dtype, rows permuted per head if perm is given.
    Returns a view of the memory map when nothing has to change."""
    raw = f.raw(name)
    if perm is not None:
        shape = raw.shape
        raw = np.take(raw.reshape(heads, len(perm), *shape[1:]), perm, axis=1).reshape(shape)
    dtype = f.dtype(name)
    if bf16:
        if dtype == "BF16":
            return np.ascontiguousarray(raw)
        return f32_to_bf16(_to_f32(raw, dtype, f, name))
    return np.ascontiguousarray(_to_f32(raw, dtype, f, name))


def _to_f32(raw, dtype, f, name):
    if dtype == "F32":
        return raw
    if dtype == "BF16":
        return bf16_to_f32(raw)
    if dtype in ("F16", "F64"):
        return raw.astype(np.float32)
    raise ModelFileError(f.path, f"tensor {name!r}: dtype {dtype} is not a float type")


def load_weights(cfg: ModelConfig, folder, bf16: bool = False) -> dict:
    """The arrays for fastllm._core.Engine: embed, norm, lm_head and a dict
    per layer, each checked against the shape the config implies."""
    ck = Checkpoint(folder)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    expected = {
        "attn_norm": (h,), "ffn_norm": (h,), "wq": (qd, h), "wk": (kvd, h), "wv": (kvd, h),
        "wo": (h, qd), "bq": (qd,), "bk": (kvd,), "bv": (kvd,), "bo": (h,),
        "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,),
        "w_gate": (inter, h), "w_up": (inter, h), "w_down": (h, inter),
        "b_gate": (inter,), "b_up": (inter,), "b_down": (h,),
    }
    wanted = {"attn_norm", "ffn_norm", *MATRICES}
    if cfg.attention_bias:
        wanted |= {"bq", "bk", "bv"} | ({"bo"} if cfg.model_type == "llama" else set())
    if cfg.mlp_bias:
        wanted |= {"b_gate", "b_up", "b_down"}
    if cfg.qk_norm:
        wanted |= {"q_norm", "k_norm"}
    perm = rope_permutation(cfg.head_dim, cfg.rope_dim)
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads, "norm": 1}

    def get(name, shape, matrix, permute=None):
        f = ck.file_of(name)
        if f.shape(name) != shape:
            raise ModelFileError(f.path, f"tensor {name!r} has shape {list(f.shape(name))}, "
                                         f"config.json implies {list(shape)}")
        arr = _as_compute_dtype(f, name, bf16 and matrix,
                                perm if permute else None, heads.get(permute))
        if not np.may_share_memory(arr, f.raw(name)):
            f.release(name)
        return arr

    layers = []
    for i in range(cfg.num_hidden_layers):
        layer = {}
        for key in sorted(wanted):
            name = f"model.layers.{i}.{LAYER_TENSORS[key]}"
            layer[key] = get(name, expected[key], key in MATRICES, ROPE_PERMUTED.get(key))
        layers.append(layer)
    embed = get("model.embed_tokens.weight", (cfg.vocab_size, h), True)
    if cfg.tie_word_embeddings or "lm_head.weight" not in ck:
        if not cfg.tie_word_embeddings:
            raise ModelFileError(folder, "lm_head.weight is missing and tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = get("lm_head.weight", (cfg.vocab_size, h), True)
    norm = get("model.norm.weight", (h,), False)
    return {"layers": layers, "embed": embed, "lm_head": lm_head, "norm": norm}
