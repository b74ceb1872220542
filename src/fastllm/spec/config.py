"""config.json of a HuggingFace model folder, as a typed and validated config.

Keys keep their HF names. Each supported `model_type` is the Llama decoder
plus the switches its entry in families.FAMILIES gives.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from .errors import ModelFileError
from .families import FAMILIES, family
from .family import ACTIVATIONS, EVERY_LAYER, LAYER_TYPES, USE_SLIDING_WINDOW, Family
from .files import read_json
from .schema import n_params
from .values import MAX_HEAD_DIM, head_dim_ok, need_int, number, positive_int, token_id

CONFIG_LIMIT = 4 << 20   # bytes; a config.json is a few kilobytes

# Bytes of one value of the KV cache by its storage; q8_0 keeps 32 int8 and
# their f16 scale for every 32 values, as llama.cpp's -ctk/-ctv q8_0 does.
KV_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "q8_0": 34 / 32}
KV_DTYPES = tuple(KV_BYTES)





ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "su", "proportional")   # su: LongRoPE's old name
SUPPORTED_ROPE = "(supported: linear, dynamic, llama3, yarn, longrope, proportional)"


def check_rope_scaling(scaling, path):
    """ModelFileError naming the field unless rope_scaling is null or a
    dict that ModelConfig.rope_inv_freq can use."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ModelFileError(path, f"rope_scaling must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelFileError(path, f"rope_scaling type {kind!r} is not supported "
                                   + SUPPORTED_ROPE)
    if kind == "default":
        return
    if kind == "proportional":
        # Gemma 4: the whole head rotated, the frequencies past partial_rotary_factor's share zero.
        for key in ("factor", "partial_rotary_factor"):
            v = scaling.get(key, 1.0)
            if not (number(v) and v > 0) or (key == "partial_rotary_factor" and v > 1):
                raise ModelFileError(path, f"rope_scaling {key!r} must be a positive number (at most 1 for "
                                           f"partial_rotary_factor) for proportional scaling, got {v!r}")
        return
    if kind in ("longrope", "su"):
        for key in ("short_factor", "long_factor"):
            v = scaling.get(key)
            if not isinstance(v, list) or not v or not all(number(x) and x > 0 for x in v):
                raise ModelFileError(path, f"rope_scaling {key!r} must be a list of positive numbers "
                                           f"for longrope scaling, got {str(v)[:80]}")
        for key in ("factor", "attention_factor", "original_max_position_embeddings"):
            v = scaling.get(key)
            if v is not None and not (number(v) and v > 0):
                raise ModelFileError(path, f"rope_scaling {key!r} must be a positive number, got {v!r}")
        return

    def positive(key, whole=False, required=True):
        if key not in scaling and not required:
            return
        v = scaling.get(key)
        ok = positive_int(v) if whole else number(v) and v > 0
        if not ok:
            raise ModelFileError(path, f"rope_scaling {key!r} must be a positive "
                                       f"{'integer' if whole else 'number'} for {kind} scaling, got {v!r}")
    positive("factor")
    positive("original_max_position_embeddings", whole=True, required=kind == "llama3")
    if kind == "yarn":
        for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if scaling.get(key) is not None:
                positive(key)
        if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
            raise ModelFileError(path, f"rope_scaling 'truncate' must be true or false, got {scaling['truncate']!r}")
    if kind == "llama3":
        positive("low_freq_factor")
        positive("high_freq_factor")
        if scaling["low_freq_factor"] == scaling["high_freq_factor"]:
            raise ModelFileError(path, "rope_scaling low_freq_factor and high_freq_factor must differ")


def longrope_scaling(scaling: dict, raw: dict, rope_dim: int, path) -> dict:
    """rope_scaling of LongRoPE as transformers reads it: one factor per
    rotated frequency, the original context (config.json's own key first,
    as for Phi-3) and the attention factor that scales cos and sin."""
    half = rope_dim // 2
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != half:
            raise ModelFileError(path, f"rope_scaling {key!r} has {len(scaling[key])} entries; "
                                       f"the {rope_dim} rotated dims need {half}")
    orig = raw.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings"))
    if not positive_int(orig):
        raise ModelFileError(path, "longrope scaling needs original_max_position_embeddings, a positive "
                                   f"integer, got {orig!r}")
    factor = scaling.get("factor") or raw["max_position_embeddings"] / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return dict(scaling, rope_type="longrope", original_max_position_embeddings=orig,
                attention_factor=float(attention))


def yarn_scaling(scaling: dict, raw: dict, path) -> dict:
    """rope_scaling of YaRN as transformers reads it: the original context
    (config.json's max_position_embeddings when rope_scaling has none) and
    the attention factor that scales cos and sin (else one from the factor,
    mscale and mscale_all_dim)."""
    orig = scaling.get("original_max_position_embeddings", raw["max_position_embeddings"])
    factor = scaling["factor"]

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return dict(scaling, rope_type="yarn", original_max_position_embeddings=orig,
                attention_factor=float(attention))


def sliding_layers(raw: dict, fam: Family, n_layers: int, path) -> tuple:
    """(sliding_window, layer_types) of the layers that attend through a
    sliding window, read from config.json as transformers reads it for the
    family; (None, None) when every layer sees the whole context."""
    if fam.sliding_window is None:
        return None, None
    if fam.sliding_window == LAYER_TYPES:
        return pattern_layers(raw, n_layers, path)
    window, types = raw.get("sliding_window"), None
    if fam.sliding_window == USE_SLIDING_WINDOW:
        use = raw.get("use_sliding_window")
        if use is not None and not isinstance(use, bool):
            raise ModelFileError(path, f"use_sliding_window must be true or false, got {use!r}")
        types = raw.get("layer_types")
        if types is not None:
            _check_layer_types(types, n_layers, path)
        if not use:
            window = None
    if window is None:
        if types and "sliding_attention" in types:
            raise ModelFileError(path, "layer_types names sliding_attention layers, but no sliding_window "
                                       "is in use (use_sliding_window must be true, sliding_window a size)")
        return None, None
    if not positive_int(window):
        raise ModelFileError(path, f"sliding_window must be a positive integer or null, got {window!r}")
    if fam.sliding_window == EVERY_LAYER:
        return window, ["sliding_attention"] * n_layers
    if types is None:
        first = raw.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ModelFileError(path, f"max_window_layers must be a non-negative integer, got {first!r}")
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return window, types


def _check_layer_types(types, n_layers: int, path):
    if (not isinstance(types, list) or len(types) != n_layers
            or any(t not in ("full_attention", "sliding_attention") for t in types)):
        raise ModelFileError(path, "layer_types must list 'full_attention' or 'sliding_attention' "
                                   f"for each of the {n_layers} layers")


def pattern_layers(raw: dict, n_layers: int, path) -> tuple:
    """(sliding_window, layer_types) of local (sliding) layers between
    global ones, as transformers' Gemma configs read config.json: the
    layers layer_types names, else all but every sliding_window_pattern-th."""
    window, types = raw.get("sliding_window"), raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern")
        if not positive_int(pattern):
            raise ModelFileError(path, f"sliding_window_pattern must be a positive integer, got {pattern!r}")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    _check_layer_types(types, n_layers, path)
    if "sliding_attention" in types and not positive_int(window):
        raise ModelFileError(path, f"sliding_window must be a positive integer for the sliding_attention "
                                   f"layers, got {window!r}")
    return window, types


def _rope_of(params: dict, theta_default, path, what: str) -> tuple:
    """(theta, scaling or None) of one rope_parameters entry."""
    if not isinstance(params, dict):
        raise ModelFileError(path, f"rope_parameters[{what!r}] must be an object, got {params!r}")
    theta = params.get("rope_theta", theta_default)
    if not number(theta) or not theta > 0:
        raise ModelFileError(path, f"rope_theta of the {what} layers must be a positive number, got {theta!r}")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("longrope", "su"):
        raise ModelFileError(path, f"longrope scaling of the {what} layers is not supported")
    return float(theta), (scaling if kind != "default" else None)


def layer_type_ropes(raw: dict, path) -> tuple:
    """((theta, scaling) of the full-attention layers, (theta, scaling) of
    the sliding ones), as transformers' Gemma3TextConfig reads config.json:
    rope_parameters per layer type, else rope_theta and rope_scaling for the
    full layers and rope_local_base_freq for the sliding ones."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params.keys() & {"full_attention", "sliding_attention"}:
        return (_rope_of(params.get("full_attention") or {}, raw.get("rope_theta"), path, "full_attention"),
                _rope_of(params.get("sliding_attention") or {}, raw.get("rope_local_base_freq"), path,
                         "sliding_attention"))
    scaling = raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelFileError(path, f"rope_scaling must be an object or null, got {scaling!r}")
    full = dict(scaling or {}, rope_theta=raw.get("rope_theta"))
    return (_rope_of(full, None, path, "full_attention"),
            _rope_of({"rope_theta": raw.get("rope_local_base_freq")}, None, path, "sliding_attention"))


def _optional_positive(raw: dict, key: str, path):
    value = raw.get(key)
    if value is not None and not (number(value) and value > 0):
        raise ModelFileError(path, f"{key} must be a positive number or null, got {value!r}")
    return None if value is None else float(value)


# Experts a router may choose from (the largest models have 512): each
# token's probabilities are ranked on the stack.
MAX_EXPERTS = 4096
# Layers a config may claim (the deepest models have a few hundred): much
# of the config is worked out layer by layer, before any file is read.
MAX_LAYERS = 4096


def experts_config(raw: dict, fam: Family, n_layers: int, path) -> dict:
    """The mixture of experts' sizes and switches, read from config.json as
    transformers reads them for the family, and which layers have experts
    (moe_layers: 1 where a layer routes, 0 where it has a dense MLP)."""
    key = next((k for k in fam.experts_keys if raw.get(k) is not None), fam.experts_keys[0])

    def positive(name):
        v = raw.get(name)
        if not positive_int(v):
            raise ModelFileError(path, f"{name} must be a positive integer, got {v!r}")
        return v
    n, k = positive(key), positive("num_experts_per_tok")
    if n > MAX_EXPERTS:
        raise ModelFileError(path, f"{key} is {n}; more than {MAX_EXPERTS} experts are not supported")
    if k > n:
        raise ModelFileError(path, f"num_experts_per_tok ({k}) is more than the {n} experts")
    norm = fam.switch("norm_topk_prob", raw)
    layers = [1] * n_layers
    if fam.sparse_layer_keys:
        only, step = raw.get("mlp_only_layers") or [], raw.get("decoder_sparse_step", 1)
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ModelFileError(path, f"mlp_only_layers must be a list of layer indices, got {only!r}"[:200])
        if not positive_int(step):
            raise ModelFileError(path, f"decoder_sparse_step must be a positive integer, got {step!r}")
        layers = [int(i not in only and (i + 1) % step == 0) for i in range(n_layers)]
    out = dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=positive(fam.expert_size_key),
               norm_topk_prob=norm, moe_layers=layers)
    if fam.shared_expert:
        out.update(shared_expert=True, shared_expert_intermediate_size=positive("shared_expert_intermediate_size"))
    return out


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    # Which optional tensors the layers have; see families.Family.
    attention_bias: bool = False     # q/k/v biases
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: list = field(default_factory=list)
    # Qwen3.5: Gated DeltaNet layers mixed with gated full attention; or
    # layers of sliding-window attention ("sliding_attention") beside full ones.
    layer_types: list | None = None
    sliding_window: int | None = None   # positions a sliding layer sees, its own included
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    norm_plus_one: bool = False
    attn_output_gate: bool = False
    qk_norm_whole: bool = False      # q/k norms over the whole projection, not per head
    pre_norms: bool = True           # RMSNorm before the attention and the MLP ...
    post_norms: bool = False         # ... and/or of their outputs, before the residual adds
    no_rope_layers: list | None = None   # per layer, 1 where it applies RoPE and 0 where not (NoPE)
    embedding_multiplier: float = 1.0    # the embeddings are multiplied by it
    residual_multiplier: float = 1.0     # each sublayer's output, before the residual add
    attention_multiplier: float | None = None   # the softmax scale; None: 1/sqrt(head_dim)
    logits_scaling: float = 1.0          # the logits are divided by it
    fused_qkv: bool = False
    fused_gate_up: bool = False
    hidden_act: str = "silu"             # the MLP gate's activation (families.ACTIVATIONS)
    attn_logit_softcapping: float | None = None    # scaled scores become cap * tanh(score / cap)
    final_logit_softcapping: float | None = None   # the logits likewise
    local_rope_theta: float | None = None   # the sliding layers' own RoPE base (Gemma 3) ...
    local_rope_scaling: dict | None = None  # ... and scaling; with None theta they share the others'
    query_scale_beta: float = 0.0        # Ministral 3: queries at positions past each multiple of
    query_scale_period: int = 0          # query_scale_period scaled (query_position_scales)
    # Mixture of experts (0 and None where dense): see experts_config.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: list | None = None       # per layer, 1 where it routes to experts, 0 where its MLP is dense
    shared_expert: bool = False
    shared_expert_intermediate_size: int = 0
    # Gemma 4 (families' gemma4_layers); layer_config(i) gives each layer's view.
    gemma4_layers: bool = False
    hidden_size_per_layer_input: int = 0     # per-layer inputs of this width; 0: none
    layer_sizes: dict | None = None          # {layer: head_dim, num_key_value_heads} where they differ
    attention_k_eq_v: bool = False           # full-attention layers' values are their keys as projected
    num_kv_shared_layers: int = 0            # the last ones attend to an earlier layer's cache
    use_double_wide_mlp: bool = False        # those layers' MLP is twice intermediate_size
    # One layer's view (layer_config): whether it projects keys and values of its own.
    own_kv: bool = True
    values_are_keys: bool = False
    weight_prefix: str = "model."
    head_prefix: str = ""
    path: Path | None = None

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    def layer_kind(self, i: int) -> str:
        """'attention' or 'linear_attention' for layer i."""
        if self.layer_types is None:
            return "attention"
        return "linear_attention" if self.layer_types[i] == "linear_attention" else "attention"

    def layer_ffn(self, i: int) -> str:
        """'experts' or 'dense' for layer i's MLP."""
        return "experts" if self.moe_layers and self.moe_layers[i] else "dense"

    def attention_window(self, i: int) -> int:
        """Positions layer i's attention sees (a query the keys after its
        position - window), or 0 for the whole context."""
        if self.sliding_window and self.layer_types and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return 0

    def rope_config(self, i: int) -> "ModelConfig":
        """The config whose rope_tables layer i rotates with: its own, or
        for Gemma 3's sliding layers one with their theta and scaling."""
        if self.local_rope_theta is None or not self.layer_types or self.layer_types[i] != "sliding_attention":
            return self
        return replace(self, rope_theta=self.local_rope_theta, rope_scaling=self.local_rope_scaling,
                       local_rope_theta=None, local_rope_scaling=None)

    def kv_layer(self, i: int) -> int:
        """The layer whose keys and values layer i attends to: itself, or
        for Gemma 4's last num_kv_shared_layers the last layer of its type
        before them."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if i < first_shared:
            return i
        return max(j for j in range(first_shared) if self.layer_types[j] == self.layer_types[i])

    def layer_config(self, i: int) -> "ModelConfig":
        """Layer i's view of the config, whose sizes and switches its tensors
        and RoPE follow: the config itself, but for Gemma 4's layers (the
        full-attention ones with their own head size, and KV heads where
        their values are their keys; the sharing ones without k/v
        projections, their MLP doubled where use_double_wide_mlp)."""
        view = self.rope_config(i)
        if not self.gemma4_layers:
            return view
        changes = dict((self.layer_sizes or {}).get(i, {}))
        if self.layer_types[i] == "full_attention":
            changes["values_are_keys"] = self.attention_k_eq_v
        if self.kv_layer(i) != i:
            changes["own_kv"] = False
            if self.use_double_wide_mlp:
                changes["intermediate_size"] = 2 * self.intermediate_size
        return replace(view, **changes)

    def layer_configs(self) -> list:
        return [self.layer_config(i) for i in range(self.num_hidden_layers)]

    def mtp_config(self) -> "ModelConfig":
        """The config of the model's multi-token-prediction block as a model
        of its own: one full-attention layer of the model's sizes (see
        schema.NEXTN)."""
        return replace(self, num_hidden_layers=1, layer_types=["full_attention"],
                                   linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0,
                                   linear_value_head_dim=0, linear_conv_kernel_dim=0)

    # Switches of schema tensors that some layers of a model lack.
    @property
    def per_layer_inputs(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    @property
    def layer_scalar(self) -> bool:
        return self.gemma4_layers

    @property
    def values(self) -> bool:
        """The layer has a v projection (and v bias where attention_bias)."""
        return self.own_kv and not self.values_are_keys

    @property
    def k_norm(self) -> bool:
        return self.qk_norm and self.own_kv

    @property
    def key_bias(self) -> bool:
        return self.attention_bias and self.own_kv

    @property
    def value_bias(self) -> bool:
        return self.attention_bias and self.values

    def layer_rope(self, i: int) -> bool:
        """Whether layer i rotates q and k (False for a NoPE layer)."""
        return self.no_rope_layers is None or bool(self.no_rope_layers[i])

    @property
    def attention_scale(self) -> float:
        """The factor of q.k in the softmax."""
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim ** -0.5

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_file(cls, path) -> "ModelConfig":
        path = Path(path)
        if not path.exists():
            raise ModelFileError(path, "file not found (a model folder needs config.json)")
        raw = read_json(path, CONFIG_LIMIT, "config.json")
        if not isinstance(raw, dict):
            raise ModelFileError(path, "expected a JSON object")
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict, path=None) -> "ModelConfig":
        def need(key):
            return need_int(raw, key, path)

        model_type = raw.get("model_type")
        fam = family(model_type, path)
        prefix, head_prefix = fam.weight_prefix, fam.head_prefix
        if fam.text_config:
            # A multimodal wrapper: its text model is all fastllm runs.
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ModelFileError(path, f"model_type {model_type!r} without a text_config object")
            warnings.warn(f"{path}: {model_type} checkpoint: running its text model; the vision "
                          "tower and multi-token-prediction weights are ignored", stacklevel=3)
            merged = dict(text)
            raw = {**fam.defaults, **raw}   # the wrapper's own, which decide the tying
            if "tie_word_embeddings" in raw:
                merged["tie_word_embeddings"] = raw["tie_word_embeddings"]
            raw = merged
            own = text.get("model_type")
            raw["model_type"] = model_type = own if own in fam.text_models else fam.text_config
            fam = family(model_type, path)
        # The family's own names of keys first (qkv_bias for attention_bias), then transformers' defaults.
        raw = {**fam.defaults, **{fam.attribute_map.get(k, k): v for k, v in raw.items()}}
        for key, why in fam.refuse.items():
            if raw.get(key):
                raise ModelFileError(path, f"{key} is true: {why}")
        act = raw.get(fam.hidden_act_key, "silu")
        if act not in ACTIVATIONS:
            raise ModelFileError(path, f"{fam.hidden_act_key} {act!r} is not supported "
                                       f"(supported: {', '.join(ACTIVATIONS)})")

        if need("num_hidden_layers") > MAX_LAYERS:
            raise ModelFileError(path, f"num_hidden_layers is {raw['num_hidden_layers']}; at most {MAX_LAYERS} "
                                       "layers are supported")
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        if not positive_int(kv_heads) or heads % kv_heads:
            raise ModelFileError(path, f"num_attention_heads ({heads}) must be a multiple of "
                                       f"num_key_value_heads ({kv_heads})")
        if not head_dim_ok(head_dim):
            raise ModelFileError(path, f"head_dim must be a positive even integer of at most {MAX_HEAD_DIM}, "
                                       f"got {head_dim!r}")
        if raw.get("head_dim") is None and hidden % heads:
            raise ModelFileError(path, f"hidden_size ({hidden}) is not divisible by "
                                       f"num_attention_heads ({heads}) and no head_dim is given")
        rope_params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
        prf = (raw.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor")
               or fam.partial_rotary_factor)
        if not number(prf) or not (0 < prf <= 1) or int(head_dim * prf) % 2:
            raise ModelFileError(path, f"partial_rotary_factor {prf!r} does not give an even "
                                       f"number of rotated dims of head_dim {head_dim}")

        sliding_window, layer_types = sliding_layers(raw, fam, need("num_hidden_layers"), path)
        multipliers = {}
        if fam.scale_embeddings:
            multipliers["embedding_multiplier"] = hidden ** 0.5
        if fam.query_pre_attn_scalar:
            scalar = raw.get("query_pre_attn_scalar")
            if not (number(scalar) and scalar > 0):
                raise ModelFileError(path, f"query_pre_attn_scalar must be a positive number, got {scalar!r}")
            multipliers["attention_multiplier"] = scalar ** -0.5
        softcaps = {key: _optional_positive(raw, key, path) for key in (
            "attn_logit_softcapping", "final_logit_softcapping")} if fam.softcapping else {}

        experts = experts_config(raw, fam, need("num_hidden_layers"), path) if fam.experts_keys else {}
        if experts and all(experts["moe_layers"]) and raw.get("intermediate_size") is None:
            intermediate = experts["moe_intermediate_size"]   # no dense MLP needs one
        else:
            intermediate = need("intermediate_size")

        eos = raw.get("eos_token_id")
        eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
        if not all(token_id(i) for i in eos):
            raise ModelFileError(path, "eos_token_id must be a token id or a list of token ids, "
                                       f"got {raw.get('eos_token_id')!r}")
        bos = raw.get("bos_token_id")
        if bos is not None and not token_id(bos):
            raise ModelFileError(path, f"bos_token_id must be a token id, got {bos!r}")
        rope_scaling = raw.get("rope_scaling")
        rope_theta = raw.get("rope_theta", 10000.0)
        local_rope = {}
        if fam.local_rope:
            (rope_theta, rope_scaling), (local_theta, local_scaling) = layer_type_ropes(raw, path)
            check_rope_scaling(local_scaling, path)
            local_rope = dict(local_rope_theta=local_theta, local_rope_scaling=local_scaling)
        elif isinstance(raw.get("rope_parameters"), dict):
            # Newer transformers folds rope_theta and rope_scaling into one dict.
            params = dict(raw["rope_parameters"])
            rope_theta = params.pop("rope_theta", rope_theta)
            if params.get("rope_type", params.get("type", "default")) != "default":
                rope_scaling = params
        if not number(rope_theta) or not rope_theta > 0:
            raise ModelFileError(path, f"rope_theta must be a positive number, got {rope_theta!r}")
        eps = raw.get("rms_norm_eps", 1e-6)
        if not number(eps) or not 0 <= eps < 1:
            raise ModelFileError(path, f"rms_norm_eps must be a number in [0, 1), got {eps!r}")
        check_rope_scaling(rope_scaling, path)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("longrope", "su"):
            need("max_position_embeddings")
            rope_scaling = longrope_scaling(rope_scaling, raw, int(head_dim * prf), path)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "yarn":
            need("max_position_embeddings")
            rope_scaling = yarn_scaling(rope_scaling, raw, path)
        switches = ("attention_bias", "o_bias", "mlp_bias")
        keys = {"tie_word_embeddings", "attention_bias", "mlp_bias"} | {
            getattr(fam, name) for name in switches if isinstance(getattr(fam, name), str)}
        for key in sorted(keys):
            if raw.get(key) is not None and not isinstance(raw[key], bool):
                raise ModelFileError(path, f"{key} must be true or false, got {raw[key]!r}")
        fields = dict(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            max_position_embeddings=need("max_position_embeddings"),
            rms_norm_eps=float(eps),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            partial_rotary_factor=float(prf),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            **{name: fam.switch(name, raw) for name in switches},
            qk_norm=fam.qk_norm,
            bos_token_id=bos,
            eos_token_id=eos,
            layer_types=layer_types,
            sliding_window=sliding_window,
            norm_plus_one=fam.norm_plus_one,
            attn_output_gate=fam.attn_output_gate,
            qk_norm_whole=fam.qk_norm_whole,
            pre_norms=fam.pre_norms,
            post_norms=fam.post_norms,
            **multipliers,
            hidden_act=act,
            **softcaps,
            **local_rope,
            fused_qkv=fam.fused_qkv,
            fused_gate_up=fam.fused_gate_up,
            weight_prefix=prefix,
            head_prefix=head_prefix,
            path=Path(path) if path else None,
            **experts,
        )
        if fam.read_config:
            fields.update(fam.read_config(raw, fields, path))
        cfg = cls(**fields)
        for i in range(cfg.num_hidden_layers if cfg.gemma4_layers else 0):
            mine, theirs = cfg.layer_config(i), cfg.layer_config(cfg.kv_layer(i))
            if (mine.head_dim, mine.num_key_value_heads) != (theirs.head_dim, theirs.num_key_value_heads):
                raise ModelFileError(path, f"layer {i} attends to layer {cfg.kv_layer(i)}'s keys and values, "
                                           "whose head_dim or num_key_value_heads differ from its own")
        return cfg

    def context_bytes(self, n_ctx: int, kv_dtype: str = "f32", threads: int = 1, max_pass: int | None = None,
                      key_block: int = 256) -> int:
        """Memory a context of n_ctx positions takes: the RoPE tables (and
        their temporaries while they are computed) and query scales, one
        session's KV cache when full (each layer in its own sizes; with
        max_pass, a sliding-window layer's cache a ring of its window and one
        pass, in whole key blocks, where that is smaller, as the C core
        sizes it), and the partial results of its short passes' attention."""
        kv_bytes = KV_BYTES[kv_dtype]
        whole = -(-n_ctx // 16) * 16
        kv = 0
        for i in range(self.num_hidden_layers):
            if self.layer_kind(i) == "linear_attention" or self.kv_layer(i) != i:
                continue
            layer, slots, window = self.layer_config(i), whole, self.attention_window(i)
            if window and max_pass:
                slots = min(whole, -(-(window - 1 + max_pass) // key_block) * key_block)
            kv += 2 * int(slots * layer.num_key_value_heads * layer.head_dim * kv_bytes)
        tables = (2 if self.longrope else 1) * (2 if self.local_rope_theta is not None else 1)
        rope = 3 * self.rope_dim // 2 * 4 * tables + (4 if self.query_scale_beta else 0)
        partials = 32 * self.num_attention_heads * (self.max_size("head_dim") + 2) * 4 // key_block
        return kv + n_ctx * (rope + partials)

    # ------------------------------------------------------------------ RoPE
    # rope_inv_freq reads rope_scaling as check_rope_scaling has checked it.

    def rope_inv_freq(self, seq_len: int) -> np.ndarray:
        """Inverse frequencies for a sequence of seq_len tokens, computed in
        float32 as the reference does."""
        dim = self.rope_dim
        f32 = np.float32
        exponents = np.arange(0, dim, 2, dtype=np.float32) / f32(dim)
        base = f32(self.rope_theta)
        scaling = dict(self.rope_scaling or {})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "longrope":
            # The long factors for a sequence past the original context.
            orig = scaling["original_max_position_embeddings"]
            ext = np.asarray(scaling["long_factor" if seq_len > orig else "short_factor"], np.float32)
            return (f32(1.0) / (ext * base ** exponents)).astype(np.float32)
        if kind == "dynamic":
            factor = float(scaling["factor"])
            orig = int(scaling.get("original_max_position_embeddings", self.max_position_embeddings))
            if seq_len > orig:
                base = f32(float(base) * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2)))
        inv_freq = (f32(1.0) / (base ** exponents)).astype(np.float32)
        if kind in ("default", "dynamic"):
            pass
        elif kind == "proportional":
            rotated = int(scaling.get("partial_rotary_factor", 1.0) * dim // 2)
            inv_freq[rotated:] = 0
            inv_freq = (inv_freq / f32(scaling.get("factor", 1.0))).astype(np.float32)
        elif kind == "yarn":
            inv_freq = self._yarn_inv_freq(base ** exponents)
        elif kind == "linear":
            inv_freq = (inv_freq / f32(scaling["factor"])).astype(np.float32)
        elif kind == "llama3":
            factor = scaling["factor"]
            low = scaling["low_freq_factor"]
            high = scaling["high_freq_factor"]
            old_ctx = scaling["original_max_position_embeddings"]
            low_wavelen = old_ctx / low
            high_wavelen = old_ctx / high
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / f32(factor), inv_freq)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
        else:
            raise ModelFileError(self.path, f"rope_scaling type {kind!r} is not supported "
                                            + SUPPORTED_ROPE)
        return inv_freq

    def _yarn_inv_freq(self, pos_freqs: np.ndarray) -> np.ndarray:
        """YaRN: the slow frequencies interpolated by the factor, the fast
        ones kept, a linear ramp between (bounded by beta_fast and beta_slow
        rotations over the original context)."""
        scaling = self.rope_scaling
        dim, base = self.rope_dim, self.rope_theta
        orig = scaling["original_max_position_embeddings"]

        def dim_of(rotations):
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        keep = (np.float32(1) - ramp).astype(np.float32)
        kept = (np.float32(1) / pos_freqs).astype(np.float32)
        interpolated = (np.float32(1) / (np.float32(scaling["factor"]) * pos_freqs)).astype(np.float32)
        return (interpolated * (np.float32(1) - keep) + kept * keep).astype(np.float32)

    def query_position_scales(self, seq_len: int):
        """Ministral 3's factor of the query at each position, 1 + beta *
        log(1 + floor(position / original context)); None without it."""
        if not self.query_scale_beta:
            return None
        steps = np.floor(np.arange(seq_len, dtype=np.float64) / self.query_scale_period)
        return np.ascontiguousarray((1 + self.query_scale_beta * np.log1p(steps)).astype(np.float32))

    @property
    def longrope(self) -> bool:
        return (self.rope_scaling or {}).get("rope_type") == "longrope"

    def rope_tables_long(self, seq_len: int):
        """LongRoPE's cos and sin tables for a sequence longer than the
        original context, shape (seq_len, rope_dim/2); None without LongRoPE.
        (rope_tables gives the short ones, for a sequence that fits it.)"""
        if not self.longrope:
            return None
        orig = self.rope_scaling["original_max_position_embeddings"]
        return self._longrope_tables(seq_len, self.rope_inv_freq(orig + 1))

    def _longrope_tables(self, seq_len: int, inv_freq: np.ndarray):
        angles = np.arange(seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]
        scale = np.float32(self.rope_scaling["attention_factor"])
        return (np.ascontiguousarray((np.cos(angles) * scale).astype(np.float32)),
                np.ascontiguousarray((np.sin(angles) * scale).astype(np.float32)))

    def rope_tables(self, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of every position's angles, shape (seq_len, rope_dim/2)."""
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        pos = np.arange(seq_len, dtype=np.float32)[:, None]
        if kind == "longrope":
            return self._longrope_tables(seq_len, self.rope_inv_freq(1))
        if kind == "dynamic":
            # The reference recomputes the frequencies whenever the sequence
            # outgrows the original context: a token at position p was
            # rotated with the frequencies for a sequence of p+1 tokens.
            orig = int(self.rope_scaling.get("original_max_position_embeddings",
                                             self.max_position_embeddings))
            base_freq = self.rope_inv_freq(orig)
            angles = np.empty((seq_len, self.rope_dim // 2), np.float32)
            angles[:orig] = pos[:orig] * base_freq
            for p in range(orig, seq_len):
                angles[p] = np.float32(p) * self.rope_inv_freq(p + 1)
        else:
            angles = pos * self.rope_inv_freq(seq_len)[None, :]
        if kind == "yarn":
            scale = np.float32(self.rope_scaling["attention_factor"])
            return (np.ascontiguousarray((np.cos(angles) * scale).astype(np.float32)),
                    np.ascontiguousarray((np.sin(angles) * scale).astype(np.float32)))
        return (np.ascontiguousarray(np.cos(angles).astype(np.float32)),
                np.ascontiguousarray(np.sin(angles).astype(np.float32)))

    def max_size(self, name: str) -> int:
        """The largest of a size over the layers (the run loop's buffers and
        its cache are sized by it)."""
        return max(getattr(lc, name) for lc in self.layer_configs())

    def n_params(self) -> int:
        return n_params(self)
