"""The model families fastllm runs: each model_type is the Llama decoder
plus a few switches, and this table is the one place that says which.

A Llama-like family is one more entry here (and its tests); no other module
compares model_type strings.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ModelFileError

# model_types fastllm knows and refuses: why.
REFUSED = {
    "qwen2_moe": "Qwen2-MoE (mixture of experts with a shared expert per layer) is not supported",
    "gpt_oss": "gpt-oss is not supported (its MXFP4 experts and attention sinks are not implemented)",
    "deepseek_v2": "DeepSeek-V2 is not supported (multi-head latent attention is not implemented)",
    "deepseek_v3": "DeepSeek-V3 is not supported (multi-head latent attention is not implemented)",
    "kimi_k2": "Kimi K2 is not supported (DeepSeek's multi-head latent attention is not implemented)",
}

# Which layers attend through a sliding window (Family.sliding_window).
EVERY_LAYER = "every_layer"            # all of them, when config.json's sliding_window is set (Mistral)
USE_SLIDING_WINDOW = "use_sliding_window"  # only with use_sliding_window: the layers layer_types
                                           # names, or from max_window_layers on (Qwen2, Qwen3)
LAYER_TYPES = "layer_types"            # the layers layer_types names, else all but every
                                       # sliding_window_pattern-th (Gemma 2, Gemma 3)

# The MLP gate activations the run loop has (config.json's names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Family:
    hf_class: str
    # Optional tensors: True (always there), False (never), or the
    # config.json key whose value says.
    attention_bias: bool | str = False   # q, k and v projections
    o_bias: bool | str = False           # output projection
    mlp_bias: bool | str = False
    qk_norm: bool = False                # per-head RMSNorm of q and k
    qk_norm_whole: bool = False          # q and k normed over the whole projection (all heads at once)
    pre_norms: bool = True               # RMSNorm before the attention and before the MLP
    post_norms: bool = False             # RMSNorm of the attention's and the MLP's outputs
    no_rope_layers: bool = False         # config.json's no_rope_layers (or no_rope_layer_interval)
                                         # names layers that skip RoPE
    multipliers: bool = False            # config.json's embedding_, residual_ and attention_multiplier
                                         # and logits_scaling
    norm_plus_one: bool = False          # RMSNorm weights stored zero-centred: y = norm(x) * (1 + w)
    attn_output_gate: bool = False       # q_proj also yields a sigmoid gate on the attention output
    linear_attention: bool = False       # Gated DeltaNet layers, as config.json's layer_types say
    partial_rotary_factor: float = 1.0   # when config.json gives none
    sliding_window: str | None = None    # EVERY_LAYER, USE_SLIDING_WINDOW, or None: every layer sees
                                         # the whole context
    refuse: dict = field(default_factory=dict)   # config.json key that must not be true: why
    untie_with_head: bool = False        # an lm_head the file carries is used even when tied
    gguf: bool | str = False             # importable from llama.cpp's GGUF: True (its arch name is the
                                         # model_type) or llama.cpp's name for the architecture
    gguf_experts: str | None = None      # the model_type of this architecture's GGUF files that have experts
    gguf_export: str | None = None       # written to GGUF as this llama.cpp architecture, which imports
                                         # as another model_type (a Mistral is a llama there)
    gguf_qk_interleaved: bool = False    # llama.cpp stores each Q/K head's rotary halves interleaved
    gguf_tensors: dict = field(default_factory=dict)   # schema field -> llama.cpp's name under blk.N.,
                                                       # where this architecture's differs
    gguf_refuse: dict = field(default_factory=dict)    # ModelConfig switch that llama.cpp's architecture
                                                       # cannot load when true: why (on export)
    gguf_head_dim: bool = True           # HF's config can say head_dim (else it must be hidden/heads)
    gguf_longrope: bool = False          # llama.cpp's rope_factors_long/short tensors (LongRoPE),
                                         # partial rotary and a sliding window in the metadata
    fused_qkv: bool = False              # q, k and v rows stored as one qkv_proj
    fused_gate_up: bool = False          # gate and up rows stored as one gate_up_proj
    hidden_act_key: str = "hidden_act"   # the config.json key naming the MLP's activation
    scale_embeddings: bool = False       # the embeddings are multiplied by sqrt(hidden_size)
    query_pre_attn_scalar: bool = False  # config.json's query_pre_attn_scalar: the softmax scale
                                         # is its inverse square root
    softcapping: bool = False            # config.json's attn_logit_softcapping and
                                         # final_logit_softcapping (tanh soft-caps), where set
    local_rope: bool = False             # sliding layers rotate with their own RoPE (theta, scaling)
    gemma4_layers: bool = False          # Gemma 4's per-layer switches from config.json: per-layer
                                         # inputs, value norms, layer scalars, global layers' own head
                                         # size (and KV heads with attention_k_eq_v, values being the
                                         # keys), KV caches shared by the last num_kv_shared_layers
                                         # (their MLP twice as wide with use_double_wide_mlp);
                                         # softmax scale 1
    query_position_scale: bool = False   # the rope parameters' llama_4_scaling_beta scales queries
                                         # by position (ModelConfig.query_position_scales)
    defaults: dict = field(default_factory=dict)   # transformers' values of keys config.json
                                                   # may leave out, where they are not Llama's
    text_config: str | None = None       # a multimodal wrapper: the family of its text model ...
    text_models: tuple = ()              # ... or of these, where its text_config's model_type says
    weight_prefix: str = "model."        # of the text model's tensors in the checkpoint
    head_prefix: str = ""                # of its lm_head
    # Mixture of experts: the config.json keys of the expert count (the
    # first present) and of an expert's intermediate size; None: dense.
    experts_keys: tuple | None = None
    expert_size_key: str = "moe_intermediate_size"
    norm_topk_prob: bool | str = True    # the chosen experts' weights are renormalised (or the key that says)
    sparse_layer_keys: bool = False      # config.json's mlp_only_layers and decoder_sparse_step say
                                         # which layers have experts (else every layer)
    shared_expert: bool = False          # a shared expert with a sigmoid gate beside the routed ones
    hf_names: dict = field(default_factory=dict)   # schema field -> HF name where the family's differs

    def switch(self, name: str, raw: dict) -> bool:
        """The value of an optional-tensor switch for config.json raw."""
        value = getattr(self, name)
        return bool(raw.get(value, False)) if isinstance(value, str) else value


# transformers' Gemma2Config and Gemma3TextConfig defaults: published
# config.json files (the multimodal wrapper's text_config above all) rely on
# them for most sizes.
_GEMMA2_DEFAULTS = dict(
    vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=2, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    pad_token_id=0, eos_token_id=1, bos_token_id=2)
_GEMMA3_DEFAULTS = dict(
    _GEMMA2_DEFAULTS, vocab_size=262208, max_position_embeddings=131072, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, sliding_window_pattern=6, final_logit_softcapping=None,
    attn_logit_softcapping=None)
# transformers' Gemma4TextConfig defaults.
_GEMMA4_DEFAULTS = dict(
    vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, global_head_dim=512, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=512,
    sliding_window_pattern=6, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
    rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                         full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                             rope_theta=1000000.0)),
    pad_token_id=0, eos_token_id=1, bos_token_id=2)
# transformers' Ministral3Config defaults (YaRN among them).
_MINISTRAL3_DEFAULTS = dict(
    vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    rope_parameters=dict(type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=16384,
                         beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0,
                         llama_4_scaling_beta=0.1))
_GEMMA = dict(attention_bias="attention_bias", o_bias="attention_bias", norm_plus_one=True, post_norms=True,
              sliding_window=LAYER_TYPES, hidden_act_key="hidden_activation", scale_embeddings=True,
              query_pre_attn_scalar=True, softcapping=True,
              refuse={"use_bidirectional_attention": "bidirectional attention is not supported"})

_MIXTRAL_NAMES = {"w_router": "block_sparse_moe.gate.weight",
                  "w_exp_gate": "block_sparse_moe.experts.{e}.w1.weight",
                  "w_exp_up": "block_sparse_moe.experts.{e}.w3.weight",
                  "w_exp_down": "block_sparse_moe.experts.{e}.w2.weight"}
# llama.cpp's name for the norm before the MLP in architectures that list it
# as the attention's post-norm.
_FFN_NORM_AS_POST_ATTENTION = {"ffn_norm": "post_attention_norm.weight"}
_QWEN35 = dict(qk_norm=True, norm_plus_one=True, attn_output_gate=True, linear_attention=True,
               partial_rotary_factor=0.25, untie_with_head=True, gguf_tensors=_FFN_NORM_AS_POST_ATTENTION)

FAMILIES = {
    "llama": Family("LlamaForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                    mlp_bias="mlp_bias", gguf=True, gguf_qk_interleaved=True, gguf_experts="mixtral"),
    # llama.cpp's GGUF of a Mistral is arch llama, without the sliding window.
    "mistral": Family("MistralForCausalLM", sliding_window=EVERY_LAYER, gguf_export="llama",
                      gguf_qk_interleaved=True),
    "qwen2": Family("Qwen2ForCausalLM", attention_bias=True, sliding_window=USE_SLIDING_WINDOW,
                    gguf=True, gguf_head_dim=False),
    "qwen3": Family("Qwen3ForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                    qk_norm=True, sliding_window=USE_SLIDING_WINDOW, gguf=True),
    "qwen3_5_text": Family("Qwen3_5ForCausalLM", **_QWEN35,
                           refuse={"attention_bias": "biases are not supported for qwen3_5_text"},
                           gguf="qwen35"),
    # Mixtures of experts: Qwen3's layers, or Qwen3.5's with a shared expert.
    "qwen3_moe": Family("Qwen3MoeForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                        qk_norm=True, sliding_window=USE_SLIDING_WINDOW, gguf="qwen3moe",
                        experts_keys=("num_experts", "num_local_experts"), norm_topk_prob="norm_topk_prob",
                        sparse_layer_keys=True),
    "qwen3_5_moe_text": Family("Qwen3_5MoeForCausalLM", **_QWEN35,
                               refuse={"attention_bias": "biases are not supported for qwen3_5_moe_text"},
                               gguf="qwen35moe", experts_keys=("num_experts",), shared_expert=True),
    "qwen3_5_moe": Family("Qwen3_5MoeForConditionalGeneration", text_config="qwen3_5_moe_text",
                          weight_prefix="model.language_model."),
    "mixtral": Family("MixtralForCausalLM", sliding_window=EVERY_LAYER, experts_keys=("num_local_experts",),
                      expert_size_key="intermediate_size", hf_names=_MIXTRAL_NAMES, gguf_qk_interleaved=True),
    "qwen3_5": Family("Qwen3_5ForConditionalGeneration", text_config="qwen3_5_text",
                      weight_prefix="model.language_model."),
    # Phi-3/3.5-mini and Phi-4-mini: LongRoPE and partial rotary come from config.json.
    "phi3": Family("Phi3ForCausalLM", fused_qkv=True, fused_gate_up=True, sliding_window=EVERY_LAYER,
                   gguf=True, gguf_longrope=True),
    # llama.cpp makes every fourth layer of a smollm3 GGUF a NoPE layer.
    "smollm3": Family("SmolLM3ForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                      mlp_bias="mlp_bias", no_rope_layers=True, gguf=True, gguf_qk_interleaved=True,
                      gguf_head_dim=False,
                      refuse={"use_sliding_window": "sliding windows are not supported for smollm3"}),
    "granite": Family("GraniteForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                      mlp_bias="mlp_bias", multipliers=True, gguf=True, gguf_qk_interleaved=True,
                      gguf_head_dim=False),
    # Seed-OSS: Llama with a switch of its own for the output projection's
    # bias and a head size apart from hidden/heads; llama.cpp's seed_oss
    # loads neither that bias nor the MLP's.
    "seed_oss": Family("SeedOssForCausalLM", attention_bias="attention_bias", o_bias="attention_out_bias",
                       mlp_bias="mlp_bias", gguf=True, gguf_tensors=_FFN_NORM_AS_POST_ATTENTION,
                       gguf_refuse={"o_bias": "llama.cpp's seed_oss has no bias of the output projection",
                                    "mlp_bias": "llama.cpp's seed_oss has no MLP biases"},
                       defaults=dict(attention_bias=True, head_dim=128)),
    "olmo2": Family("Olmo2ForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                    qk_norm=True, qk_norm_whole=True, pre_norms=False, post_norms=True, gguf=True,
                    gguf_head_dim=False),
    # Gemma 2 and 3: GeLU, sandwich norms, (1 + w) norms, scaled embeddings,
    # soft-caps, local (sliding) layers between global ones; Gemma 3 adds
    # q/k norms and a RoPE of the local layers' own.
    "gemma2": Family("Gemma2ForCausalLM", **_GEMMA, defaults=_GEMMA2_DEFAULTS, gguf=True),
    "gemma3_text": Family("Gemma3ForCausalLM", **_GEMMA, qk_norm=True, local_rope=True,
                          defaults=_GEMMA3_DEFAULTS, gguf="gemma3"),
    # Its checkpoints (Google's, and transformers' save_pretrained) keep the
    # text model under language_model.model.
    "gemma3": Family("Gemma3ForConditionalGeneration", text_config="gemma3_text",
                     weight_prefix="language_model.model."),
    # Gemma 4's dense text model: Gemma 3 with x * w norms and the switches of gemma4_layers.
    "gemma4_text": Family("Gemma4ForCausalLM", **dict(
        _GEMMA, norm_plus_one=False, query_pre_attn_scalar=False,
        refuse=dict(_GEMMA["refuse"], enable_moe_block="Gemma 4's mixture-of-experts block is not supported yet",
                    attention_bias="biases are not supported for gemma4_text")),
        qk_norm=True, local_rope=True, gemma4_layers=True, defaults=_GEMMA4_DEFAULTS, gguf="gemma4"),
    "gemma4": Family("Gemma4ForConditionalGeneration", text_config="gemma4_text",
                     weight_prefix="model.language_model."),
    # Ministral 3: Mistral with YaRN and queries scaled by position. Its
    # checkpoints are the text model of the mistral3 wrapper, which also holds
    # Mistral Small 3.x (a mistral text model).
    "ministral3": Family("Ministral3ForCausalLM", sliding_window=EVERY_LAYER, query_position_scale=True,
                         defaults=_MINISTRAL3_DEFAULTS, gguf="mistral3", gguf_qk_interleaved=True),
    "mistral3": Family("Mistral3ForConditionalGeneration", text_config="ministral3",
                       text_models=("ministral3", "mistral"), weight_prefix="language_model.model.",
                       head_prefix="language_model.", defaults=dict(tie_word_embeddings=True)),
}
# llama.cpp's architecture name -> the model_type it is imported as.
GGUF_ARCHITECTURES = {(name if f.gguf is True else f.gguf): name for name, f in FAMILIES.items() if f.gguf}
# Architectures llama.cpp writes that fastllm knows and refuses: why.
GGUF_REFUSED = {"gpt-oss": REFUSED["gpt_oss"], "deepseek2": REFUSED["deepseek_v3"],
                "qwen2moe": REFUSED["qwen2_moe"]}


def family(model_type, path=None) -> Family:
    """The family of a model_type, or a ModelFileError naming the file."""
    if isinstance(model_type, str) and model_type in REFUSED:
        raise ModelFileError(path, f"model_type {model_type!r}: {REFUSED[model_type]}")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ModelFileError(path, f"model_type {model_type!r} is not supported "
                                   f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]
