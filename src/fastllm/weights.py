"""HF checkpoint tensors -> the arrays the C run loop reads.

Weight matrices are packed once, tensor by tensor, into panels of 16 rows
(see csrc/gemm.c), in fp32 or bf16; the file pages of each tensor are
released as soon as it is packed, so the checkpoint is never held twice. Q
and K rows (and their biases and norms) are permuted inside each head so
that RoPE rotates adjacent pairs: HF rotates dims (i, i + rope_dim/2)
together, the C loop rotates (2i, 2i+1).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import _core
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
# Gated DeltaNet (linear attention) layers of Qwen3.5.
LAYER_TENSORS.update({
    "w_qkv": "linear_attn.in_proj_qkv.weight",
    "w_z": "linear_attn.in_proj_z.weight",
    "w_b": "linear_attn.in_proj_b.weight",
    "w_a": "linear_attn.in_proj_a.weight",
    "conv_w": "linear_attn.conv1d.weight",
    "lin_A": "linear_attn.A_log",
    "dt_bias": "linear_attn.dt_bias",
    "lin_norm": "linear_attn.norm.weight",
    "w_out": "linear_attn.out_proj.weight",
})
LINEAR_MATRICES = ("w_qkv", "w_z", "w_b", "w_a", "w_out")
LINEAR_TENSORS = {"w_qkv", "w_z", "w_b", "w_a", "conv_w", "lin_A", "dt_bias", "lin_norm", "w_out"}
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
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qd, kvd = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    hv = cfg.linear_num_value_heads
    expected = {
        "attn_norm": (h,), "ffn_norm": (h,), "wq": (qd * (2 if cfg.attn_output_gate else 1), h),
        "wk": (kvd, h), "wv": (kvd, h), "wo": (h, qd), "bq": (qd,), "bk": (kvd,), "bv": (kvd,),
        "bo": (h,), "q_norm": (hd,), "k_norm": (hd,),
        "w_gate": (inter, h), "w_up": (inter, h), "w_down": (h, inter),
        "b_gate": (inter,), "b_up": (inter,), "b_down": (h,),
        "w_qkv": (2 * kd + vd, h), "w_z": (vd, h), "w_b": (hv, h), "w_a": (hv, h),
        "conv_w": (2 * kd + vd, 1, cfg.linear_conv_kernel_dim), "lin_A": (hv,), "dt_bias": (hv,),
        "lin_norm": (cfg.linear_value_head_dim,), "w_out": (h, vd),
        "embed": (cfg.vocab_size, h), "lm_head": (cfg.vocab_size, h),
    }
    common = {"attn_norm", "ffn_norm", "w_gate", "w_up", "w_down"}
    if cfg.mlp_bias:
        common |= {"b_gate", "b_up", "b_down"}
    attention = {"wq", "wk", "wv", "wo"}
    if cfg.attention_bias:
        attention |= {"bq", "bk", "bv"} | ({"bo"} if cfg.model_type == "llama" else set())
    if cfg.qk_norm:
        attention |= {"q_norm", "k_norm"}
    perm = rope_permutation(hd, cfg.rope_dim)
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads, "norm": 1}
    # (1 + w) is formed once here, in float32 as the reference forms it.
    zero_centred = {"attn_norm", "ffn_norm", "q_norm", "k_norm"} if cfg.norm_plus_one else set()

    def get(name, key):
        f = ck.file_of(name)
        shape = expected.get(key, None)
        if shape is not None and f.shape(name) != shape:
            raise ModelFileError(f.path, f"tensor {name!r} has shape {list(f.shape(name))}, "
                                         f"config.json implies {list(shape)}")
        matrix = key in MATRICES or key in LINEAR_MATRICES or key in ("embed", "lm_head")
        if key == "wq" and cfg.attn_output_gate:
            # q_proj holds [q_h | gate_h] for each head h: split, then permute q.
            both = _as_compute_dtype(f, name, bf16).reshape(heads["q"], 2, hd, h)
            q = _core.pack(np.ascontiguousarray(both[:, 0][:, perm]).reshape(qd, h))
            gate = _core.pack(np.ascontiguousarray(both[:, 1]).reshape(qd, h))
            f.release(name)
            return q, gate
        permute = ROPE_PERMUTED.get(key)
        arr = _as_compute_dtype(f, name, bf16 and matrix,
                                perm if permute else None, heads.get(permute))
        if key in zero_centred:
            arr = (np.float32(1.0) + arr).astype(np.float32)
        elif key == "lin_A":
            arr = (-np.exp(arr.astype(np.float32))).astype(np.float32)
        elif key == "conv_w":
            arr = np.ascontiguousarray(arr.reshape(arr.shape[0], arr.shape[2]))
        if matrix and key != "embed":
            arr = _core.pack(arr)
        if not np.may_share_memory(arr, f.raw(name)):
            f.release(name)
        return arr

    prefix = cfg.weight_prefix
    layers = []
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_kind(i)
        layer = {"kind": kind}
        for key in sorted(common | (attention if kind == "attention" else LINEAR_TENSORS)):
            arr = get(f"{prefix}layers.{i}.{LAYER_TENSORS[key]}", key)
            if key == "wq" and cfg.attn_output_gate:
                layer["wq"], layer["w_attn_gate"] = arr
            else:
                layer[key] = arr
        layers.append(layer)
    # transformers ties the head to the embedding when asked to, except that
    # Qwen3.5 keeps an lm_head the file does carry.
    untie = cfg.model_type in ("qwen3_5_text", "qwen3_5") and "lm_head.weight" in ck
    tied = (cfg.tie_word_embeddings and not untie) or "lm_head.weight" not in ck
    if tied and not cfg.tie_word_embeddings:
        raise ModelFileError(folder, "lm_head.weight is missing and tie_word_embeddings is false")
    embed_name = f"{prefix}embed_tokens.weight"
    if tied:
        # One copy serves both: the packed head, whose rows the C loop reads
        # for the embedding lookup.
        embed, lm_head = None, get(embed_name, "lm_head")
    else:
        embed = get(embed_name, "embed")
        lm_head = get("lm_head.weight", "lm_head")
    norm = get(f"{prefix}norm.weight", "norm")
    if cfg.norm_plus_one:
        norm = (np.float32(1.0) + norm).astype(np.float32)
    return {"layers": layers, "embed": embed, "lm_head": lm_head, "norm": norm}
