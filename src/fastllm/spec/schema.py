"""The one table of the tensors a model is made of.

For each per-layer tensor: its field in the C loop's FlmLayer (in the
struct's order: _core fills the struct from this order), its HF name under
model.layers.N., its llama.cpp GGUF name under blk.N., its shape from the
config as the C loop reads it, whether it is a weight matrix (packed, in
the weight dtype) or a float32 vector, the layer kind it belongs to, and the
ModelConfig switch that turns it on. Loading, the shape and required-tensor
checks, n_params, GGUF conversion and the benchmark's weight check are all
read off this table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

ATTENTION, LINEAR, BOTH = "attention", "linear_attention", "both"
# A layer's MLP: a dense SwiGLU one, or a mixture of experts.
DENSE, EXPERTS = "dense", "experts"


@dataclass(frozen=True)
class Tensor:
    field: str                 # FlmLayer field (FlmWeights field for the model's own)
    hf: str                    # HF name, under model.layers.N. (the model's own: see hf_name)
    gguf: str | None           # llama.cpp name, under blk.N.; None: not in the GGUF files fastllm reads
    shape: Callable            # ModelConfig -> shape the C loop reads
    matrix: bool               # a weight matrix, or a float32 vector
    kind: str = BOTH           # the layer kind that has it
    switch: str | None = None  # the ModelConfig flag that turns it on; None: always there
    rope: str | None = None    # rows in RoPE's half-split order, per "q" or "k" head, or a norm over
                               # heads ("head": each head_dim slice of it)
    norm: bool = False         # an RMSNorm weight (stored as w - 1 where norm_plus_one)
    hf_shape: Callable | None = None  # the file's shape where it differs
    parts: tuple = ()          # a fused tensor: the LAYER fields its rows hold, in order
    gguf_shape: Callable | None = None  # the GGUF file's shape where it differs from the HF one
    v_heads: str | None = None  # Gated DeltaNet value heads along its "rows", "columns" or "rows after q, k"
    ffn: str | None = None     # the MLP kind that has it: DENSE, EXPERTS, or None: both
    experts: bool = False      # n_experts matrices, shape[0] of them (HF: one tensor per expert)


def _q(c): return c.num_attention_heads * c.head_dim
def _kv(c): return c.num_key_value_heads * c.head_dim
def _hv(c): return c.linear_num_value_heads
def _vd(c): return c.linear_num_value_heads * c.linear_value_head_dim
def _conv(c): return 2 * c.linear_num_key_heads * c.linear_key_head_dim + _vd(c)


def _t(field, hf, gguf, shape, matrix, kind=BOTH, switch=None, **kw):
    return Tensor(field, hf, gguf, shape, matrix, kind, switch, **kw)


A, L = ATTENTION, LINEAR
LAYER = (
    _t("wq", "self_attn.q_proj.weight", "attn_q.weight", lambda c: (_q(c), c.hidden_size), True, A,
       rope="q", hf_shape=lambda c: (_q(c) * (2 if c.attn_output_gate else 1), c.hidden_size)),
    # A layer attending to an earlier one's cache has no k/v projections (Gemma 4), and one whose values
    # are its keys no v projection.
    _t("wk", "self_attn.k_proj.weight", "attn_k.weight", lambda c: (_kv(c), c.hidden_size), True, A, "own_kv",
       rope="k"),
    _t("wv", "self_attn.v_proj.weight", "attn_v.weight", lambda c: (_kv(c), c.hidden_size), True, A, "values"),
    _t("wo", "self_attn.o_proj.weight", "attn_output.weight", lambda c: (c.hidden_size, _q(c)), True, A),
    _t("bq", "self_attn.q_proj.bias", "attn_q.bias", lambda c: (_q(c),), False, A, "attention_bias", rope="q"),
    _t("bk", "self_attn.k_proj.bias", "attn_k.bias", lambda c: (_kv(c),), False, A, "key_bias", rope="k"),
    _t("bv", "self_attn.v_proj.bias", "attn_v.bias", lambda c: (_kv(c),), False, A, "value_bias"),
    _t("bo", "self_attn.o_proj.bias", "attn_output.bias", lambda c: (c.hidden_size,), False, A, "o_bias"),
    # Per head, or over the whole projection (every head's slice of head_dim in turn).
    _t("q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight",
       lambda c: (_q(c) if c.qk_norm_whole else c.head_dim,), False, A, "qk_norm", rope="head", norm=True),
    _t("k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight",
       lambda c: (_kv(c) if c.qk_norm_whole else c.head_dim,), False, A, "k_norm", rope="head", norm=True),
    # q_proj holds [q_h | gate_h] for each head h where the output is gated.
    _t("w_attn_gate", "self_attn.q_proj.weight", None, lambda c: (_q(c), c.hidden_size), True, A,
       "attn_output_gate"),
    # Gated DeltaNet (linear attention) layers of Qwen3.5.
    # llama.cpp's converter stores A as -exp(A_log), the value the run loop
    # reads, and orders value heads its own way (see formats.gguf_tensors).
    _t("w_qkv", "linear_attn.in_proj_qkv.weight", "attn_qkv.weight", lambda c: (_conv(c), c.hidden_size), True,
       L, v_heads="rows after q, k"),
    _t("w_z", "linear_attn.in_proj_z.weight", "attn_gate.weight", lambda c: (_vd(c), c.hidden_size), True, L,
       v_heads="rows"),
    _t("w_b", "linear_attn.in_proj_b.weight", "ssm_beta.weight", lambda c: (_hv(c), c.hidden_size), True, L,
       v_heads="rows"),
    _t("w_a", "linear_attn.in_proj_a.weight", "ssm_alpha.weight", lambda c: (_hv(c), c.hidden_size), True, L,
       v_heads="rows"),
    _t("conv_w", "linear_attn.conv1d.weight", "ssm_conv1d.weight", lambda c: (_conv(c), c.linear_conv_kernel_dim),
       False, L, hf_shape=lambda c: (_conv(c), 1, c.linear_conv_kernel_dim),
       gguf_shape=lambda c: (_conv(c), c.linear_conv_kernel_dim), v_heads="rows after q, k"),
    _t("lin_A", "linear_attn.A_log", "ssm_a", lambda c: (_hv(c),), False, L, v_heads="rows"),
    _t("dt_bias", "linear_attn.dt_bias", "ssm_dt.bias", lambda c: (_hv(c),), False, L, v_heads="rows"),
    _t("lin_norm", "linear_attn.norm.weight", "ssm_norm.weight", lambda c: (c.linear_value_head_dim,), False, L),
    _t("w_out", "linear_attn.out_proj.weight", "ssm_out.weight", lambda c: (c.hidden_size, _vd(c)), True, L,
       v_heads="columns"),
    # Both kinds.
    _t("attn_norm", "input_layernorm.weight", "attn_norm.weight", lambda c: (c.hidden_size,), False,
       switch="pre_norms", norm=True),
    _t("ffn_norm", "post_attention_layernorm.weight", "ffn_norm.weight", lambda c: (c.hidden_size,), False,
       switch="pre_norms", norm=True),
    # Norms of the attention's and the MLP's outputs, before the residual add. (Where a
    # family has pre-norms alone, its post_attention_layernorm is ffn_norm, the MLP's input
    # norm; where it has both, as Gemma's sandwich does, ffn_norm is pre_feedforward_layernorm:
    # see hf_name.)
    _t("post_attn_norm", "post_attention_layernorm.weight", "post_attention_norm.weight",
       lambda c: (c.hidden_size,), False, switch="post_norms", norm=True),
    _t("post_ffn_norm", "post_feedforward_layernorm.weight", "post_ffw_norm.weight", lambda c: (c.hidden_size,),
       False, switch="post_norms", norm=True),
    _t("w_gate", "mlp.gate_proj.weight", "ffn_gate.weight", lambda c: (c.intermediate_size, c.hidden_size), True,
       ffn=DENSE),
    _t("w_up", "mlp.up_proj.weight", "ffn_up.weight", lambda c: (c.intermediate_size, c.hidden_size), True,
       ffn=DENSE),
    _t("w_down", "mlp.down_proj.weight", "ffn_down.weight", lambda c: (c.hidden_size, c.intermediate_size), True,
       ffn=DENSE),
    _t("b_gate", "mlp.gate_proj.bias", "ffn_gate.bias", lambda c: (c.intermediate_size,), False, switch="mlp_bias",
       ffn=DENSE),
    _t("b_up", "mlp.up_proj.bias", "ffn_up.bias", lambda c: (c.intermediate_size,), False, switch="mlp_bias",
       ffn=DENSE),
    _t("b_down", "mlp.down_proj.bias", "ffn_down.bias", lambda c: (c.hidden_size,), False, switch="mlp_bias",
       ffn=DENSE),
    # Mixture of experts. HF names are Qwen's (others: Family.hf_names); an
    # expert tensor's HF name has {e} for the expert, GGUF merges them in one.
    _t("w_router", "mlp.gate.weight", "ffn_gate_inp.weight", lambda c: (c.num_experts, c.hidden_size), True,
       ffn=EXPERTS),
    _t("w_exp_gate", "mlp.experts.{e}.gate_proj.weight", "ffn_gate_exps.weight",
       lambda c: (c.num_experts, c.moe_intermediate_size, c.hidden_size), True, ffn=EXPERTS, experts=True),
    _t("w_exp_up", "mlp.experts.{e}.up_proj.weight", "ffn_up_exps.weight",
       lambda c: (c.num_experts, c.moe_intermediate_size, c.hidden_size), True, ffn=EXPERTS, experts=True),
    _t("w_exp_down", "mlp.experts.{e}.down_proj.weight", "ffn_down_exps.weight",
       lambda c: (c.num_experts, c.hidden_size, c.moe_intermediate_size), True, ffn=EXPERTS, experts=True),
    _t("w_shexp_gate", "mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight",
       lambda c: (c.shared_expert_intermediate_size, c.hidden_size), True, switch="shared_expert", ffn=EXPERTS),
    _t("w_shexp_up", "mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight",
       lambda c: (c.shared_expert_intermediate_size, c.hidden_size), True, switch="shared_expert", ffn=EXPERTS),
    _t("w_shexp_down", "mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight",
       lambda c: (c.hidden_size, c.shared_expert_intermediate_size), True, switch="shared_expert", ffn=EXPERTS),
    _t("shexp_gate", "mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight", lambda c: (c.hidden_size,),
       False, switch="shared_expert", ffn=EXPERTS, hf_shape=lambda c: (1, c.hidden_size)),
    # Gemma 4's per-layer inputs, and its scalar of each layer's output.
    _t("w_ple_gate", "per_layer_input_gate.weight", "inp_gate.weight",
       lambda c: (c.hidden_size_per_layer_input, c.hidden_size), True, switch="per_layer_inputs"),
    _t("w_ple_proj", "per_layer_projection.weight", "proj.weight",
       lambda c: (c.hidden_size, c.hidden_size_per_layer_input), True, switch="per_layer_inputs"),
    _t("ple_norm", "post_per_layer_input_norm.weight", "post_norm.weight", lambda c: (c.hidden_size,), False,
       switch="per_layer_inputs", norm=True),
    _t("layer_scalar", "layer_scalar", "layer_output_scale.weight", lambda c: (1,), False, switch="layer_scalar"),
)
# The model's own tensors. The embedding and the final norm sit under the
# config's weight_prefix, lm_head at the top.
EMBED = _t("embed", "embed_tokens.weight", "token_embd.weight", lambda c: (c.vocab_size, c.hidden_size), True)
NORM = _t("norm", "norm.weight", "output_norm.weight", lambda c: (c.hidden_size,), False, norm=True)
LM_HEAD = _t("lm_head", "lm_head.weight", "output.weight", lambda c: (c.vocab_size, c.hidden_size), True)
MODEL = (EMBED, NORM, LM_HEAD)
# Gemma 4's per-layer inputs (FlmWeights), where the config has them.
def _ple(c): return c.num_hidden_layers * c.hidden_size_per_layer_input


PER_LAYER_MODEL = (
    _t("embed_per_layer", "embed_tokens_per_layer.weight", "per_layer_token_embd.weight",
       lambda c: (c.vocab_size, _ple(c)), True, switch="per_layer_inputs"),
    _t("per_layer_proj", "per_layer_model_projection.weight", "per_layer_model_proj.weight",
       lambda c: (_ple(c), c.hidden_size), True, switch="per_layer_inputs"),
    _t("per_layer_norm", "per_layer_projection_norm.weight", "per_layer_proj_norm.weight",
       lambda c: (c.hidden_size_per_layer_input,), False, switch="per_layer_inputs", norm=True),
)
# A multi-token-prediction block (Qwen3.5's mtp.*, llama.cpp's NextN): one
# more attention layer of the model's sizes, stored past the model's own
# (blk.N, N = num_hidden_layers), whose input joins each token's embedding
# and the hidden state it follows; its own final norm replaces the model's
# (FlmWeights.norm), the embedding and LM head are the model's.
NEXTN = (
    _t("eh_proj", "fc.weight", "nextn.eh_proj.weight", lambda c: (c.hidden_size, 2 * c.hidden_size), True),
    _t("enorm", "pre_fc_norm_embedding.weight", "nextn.enorm.weight", lambda c: (c.hidden_size,), False,
       norm=True),
    _t("hnorm", "pre_fc_norm_hidden.weight", "nextn.hnorm.weight", lambda c: (c.hidden_size,), False, norm=True),
    _t("norm", "norm.weight", "nextn.shared_head_norm.weight", lambda c: (c.hidden_size,), False, norm=True),
)
# Tensors some families store fused, rows of one after the other's: each
# is split at load into the LAYER tensors it names. llama.cpp keeps them
# fused too (ffn_up holding gate and up, as HF's gate_up_proj does).
FUSED = (
    _t("qkv", "self_attn.qkv_proj.weight", "attn_qkv.weight", lambda c: (_q(c) + 2 * _kv(c), c.hidden_size),
       True, A, "fused_qkv", parts=("wq", "wk", "wv")),
    _t("gate_up", "mlp.gate_up_proj.weight", "ffn_up.weight", lambda c: (2 * c.intermediate_size, c.hidden_size),
       True, switch="fused_gate_up", parts=("w_gate", "w_up"), ffn=DENSE),
)
# llama.cpp's converter may store each expert's gate and up rows as one
# tensor (--fuse-gate-up-exps); it is split at load.
FUSED_GATE_UP_EXPERTS = _t("gate_up_exps", "mlp.experts.{e}.gate_up_proj.weight", "ffn_gate_up_exps.weight",
                           lambda c: (c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size), True,
                           ffn=EXPERTS, experts=True, parts=("w_exp_gate", "w_exp_up"))
BY_FIELD = {t.field: t for t in LAYER + MODEL}


def layer_tensors(cfg, kind: str, ffn: str = DENSE) -> list:
    """The tensors a layer of this kind (and MLP kind) has under cfg, in FlmLayer order."""
    return [t for t in LAYER if t.kind in (kind, BOTH) and t.ffn in (ffn, None)
            and (t.switch is None or getattr(cfg, t.switch))]


def file_tensors(cfg, kind: str, ffn: str = DENSE) -> list:
    """The tensors a layer of this kind has in the checkpoint: those of
    layer_tensors, fused ones in place of their parts where cfg says so."""
    fused = [t for t in FUSED if t.kind in (kind, BOTH) and t.ffn in (ffn, None) and getattr(cfg, t.switch)]
    covered = {part: t for t in fused for part in t.parts}
    out = []
    for t in layer_tensors(cfg, kind, ffn):
        t = covered.get(t.field, t)
        if t not in out:
            out.append(t)
    return out


def split_rows(t: Tensor, arr, cfg) -> dict:
    """A fused tensor's rows (or rows of blocks) as its parts, by field."""
    out, start = {}, 0
    for field in t.parts:
        n = BY_FIELD[field].shape(cfg)[0]
        out[field] = arr[start:start + n]
        start += n
    return out


# The HF names of tensors whose name depends on the norm placement: with
# norms both before and after each sublayer (Gemma's sandwich).
SANDWICH_HF = {"ffn_norm": "pre_feedforward_layernorm.weight"}


def hf_name(t: Tensor, cfg, layer: int | None = None) -> str:
    if layer is not None:
        hf = SANDWICH_HF.get(t.field, t.hf) if cfg.pre_norms and cfg.post_norms else t.hf
        hf = cfg.family.hf_names.get(t.field, hf)
        return f"{cfg.weight_prefix}layers.{layer}.{hf}"
    return cfg.head_prefix + t.hf if t is LM_HEAD else cfg.weight_prefix + t.hf


def hf_entries(t: Tensor, cfg, layer: int) -> list:
    """(HF name, HF shape) of a layer's tensor: one per expert for a
    mixture's expert matrices, which HF stores one tensor each."""
    name, shape = hf_name(t, cfg, layer), hf_shape(t, cfg)
    if not t.experts:
        return [(name, shape)]
    return [(name.format(e=e), shape[1:]) for e in range(shape[0])]


def hf_shape(t: Tensor, cfg) -> tuple:
    return (t.hf_shape or t.shape)(cfg)


def gguf_name(t: Tensor, cfg) -> str | None:
    """The tensor's llama.cpp name (under blk.N. for a layer's) in cfg's architecture."""
    return cfg.family.gguf_tensors.get(t.field, t.gguf)


def gguf_shape(t: Tensor, cfg) -> tuple:
    return (t.gguf_shape or t.hf_shape or t.shape)(cfg)


def n_params(cfg) -> int:
    """Parameters of the checkpoint the config describes, a tied head counted once."""
    total = sum(math.prod(t.shape(lc)) for i, lc in enumerate(cfg.layer_configs())
                for t in layer_tensors(lc, cfg.layer_kind(i), cfg.layer_ffn(i)))
    heads = (EMBED, NORM) if cfg.tie_word_embeddings else MODEL
    own = heads + tuple(t for t in PER_LAYER_MODEL if getattr(cfg, t.switch))
    return total + sum(math.prod(t.shape(cfg)) for t in own)
