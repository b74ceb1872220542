"""Tiny random-weight checkpoints made offline with transformers.

Random models pass comparisons by accident when their logits are flat, so
the init scale is raised until the top-1/top-2 margins are clearly nonzero;
tests report the margins they compare on.
"""
from __future__ import annotations

from pathlib import Path

# Each shape exercises a different corner: GQA ratios, odd head counts,
# explicit head_dim, tied and untied heads, biases, q/k norms, rope scaling,
# sliding windows.
SHAPES = {
    "llama-gqa": dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                      tie_word_embeddings=True),
    "llama-mha-untied": dict(model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=3, num_key_value_heads=3, vocab_size=257,
                             tie_word_embeddings=False),
    "llama-headdim-bias": dict(model_type="llama", hidden_size=80, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=5, num_key_value_heads=1, head_dim=24, vocab_size=200,
                               attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "llama3-rope": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                        rope_theta=500000.0, max_position_embeddings=256,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear-rope": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # Dynamic NTK: the reference rescales the frequencies whenever the sequence
    # outgrows max_position_embeddings, so it is compared token by token.
    "llama-dynamic-rope": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                               max_position_embeddings=48,
                               rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False),
    "qwen2-tied": dict(model_type="qwen2", hidden_size=56, intermediate_size=112, num_hidden_layers=2,
                       num_attention_heads=7, num_key_value_heads=1, vocab_size=256, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300,
                  tie_word_embeddings=True),
    "qwen3-untied": dict(model_type="qwen3", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, head_dim=16, vocab_size=211,
                         tie_word_embeddings=False),
    # Sliding-window attention, the window far shorter than the prompts: 5
    # positions, and 19 (a window that starts inside a block of 16 keys).
    "mistral-swa": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=300, sliding_window=5,
                        tie_word_embeddings=False),
    "mistral-headdim": dict(model_type="mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=24, vocab_size=256,
                            sliding_window=19, tie_word_embeddings=True),
    # Qwen2/Qwen3 slide only from max_window_layers on.
    "qwen2-swa": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300, use_sliding_window=True,
                      sliding_window=6, max_window_layers=1, tie_word_embeddings=False),
    "qwen3-swa": dict(model_type="qwen3", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                      use_sliding_window=True, sliding_window=17, max_window_layers=1,
                      tie_word_embeddings=True),
    # Qwen3.5: Gated DeltaNet layers mixed with gated full attention. Hv != Hk
    # and dk != dv catch a wrong head sharing or a transposed state.
    "qwen3_5-text": dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=24, linear_conv_kernel_dim=4,
                         layer_types=["linear_attention", "full_attention", "linear_attention",
                                      "full_attention"], tie_word_embeddings=False),
    "qwen3_5-interval": dict(model_type="qwen3_5_text", vocab_size=200, hidden_size=48, intermediate_size=80,
                             num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                             linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=32,
                             linear_value_head_dim=16, linear_conv_kernel_dim=3,
                             full_attention_interval=2, tie_word_embeddings=True),
}
# The multimodal wrapper around the same text model, tied, another layer order.
SHAPES["qwen3_5-wrapper"] = dict(SHAPES["qwen3_5-text"], model_type="qwen3_5", tie_word_embeddings=True,
                                 layer_types=["linear_attention", "full_attention", "full_attention",
                                              "linear_attention"])

# Phi-3: q/k/v and gate/up stored fused. Phi-4-mini's partial rotary (0.75)
# under LongRoPE, its original context (32) shorter than the longer prompts,
# so that both factor sets are compared; and Phi-3-mini's sliding window,
# here far shorter than the prompts.
SHAPES["phi3-longrope"] = dict(
    model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, partial_rotary_factor=0.75, max_position_embeddings=256,
    original_max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    rope_scaling={"type": "longrope", "short_factor": [1.0, 1.02, 1.1, 1.25, 1.5, 2.0],
                  "long_factor": [1.0, 1.3, 2.5, 6.0, 15.0, 40.0]})
SHAPES["phi3-swa"] = dict(
    model_type="phi3", hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=256, sliding_window=6, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=0)
# SmolLM3: NoPE layers among RoPE ones, listed, and every fourth by default
# (as llama.cpp assumes); Granite: every multiplier far from 1; OLMo 2: norms
# of the sublayer outputs only, q/k norms over the whole projection.
SHAPES["smollm3-nope"] = dict(model_type="smollm3", hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                              no_rope_layers=[1, 0, 1, 1, 0], attention_bias=True, tie_word_embeddings=True,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHAPES["smollm3"] = dict(model_type="smollm3", hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, vocab_size=320,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHAPES["granite"] = dict(model_type="granite", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300, embedding_multiplier=12.0,
                         residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=2.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Seed-OSS: q/k/v biases, a head size apart from hidden/heads; as llama.cpp
# can hold it (no output or MLP biases), and with those biases (folders only).
SHAPES["seed_oss"] = dict(model_type="seed_oss", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=300,
                          attention_bias=True, attention_out_bias=False, mlp_bias=False,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHAPES["seed_oss-biases"] = dict(SHAPES["seed_oss"], num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
                                 attention_bias=False, attention_out_bias=True, mlp_bias=True,
                                 tie_word_embeddings=True)
# InternLM3 under its own names of the bias switches (transformers' attribute_map).
SHAPES["internlm3"] = dict(model_type="internlm3", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=300,
                           qkv_bias=True, bias=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
SHAPES["olmo2"] = dict(model_type="olmo2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)

# Gemma 2: GeLU, sandwich and (1 + w) norms, scaled embeddings, local layers
# (a window of 5) between global ones, head_dim and query_pre_attn_scalar
# apart from hidden/heads, and caps that the random scores and logits pass
# (tests check that lifting them moves the logits).
SHAPES["gemma2"] = dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20,
                        sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                        vocab_size=300, bos_token_id=2, eos_token_id=1, pad_token_id=0)
# Gemma 3: q/k norms; local layers (window 7, every third layer global) with
# a RoPE base of their own, global ones under linear scaling; no caps, as
# Gemma 3 ships them (transformers' multimodal wrapper would not apply a
# final cap, nor its sdpa attention a score cap). The wrapper's text model
# has a window (19) that starts inside a block of 16 keys.
SHAPES["gemma3-text"] = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128,
                             num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                             query_pre_attn_scalar=32, sliding_window=7, sliding_window_pattern=3,
                             rope_theta=10000.0, rope_local_base_freq=100.0,
                             rope_scaling={"rope_type": "linear", "factor": 4.0}, vocab_size=320,
                             bos_token_id=2, eos_token_id=1, pad_token_id=0)
SHAPES["gemma3-wrapper"] = dict(model_type="gemma3", hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                sliding_window=19, sliding_window_pattern=2, rope_local_base_freq=1000.0,
                                vocab_size=256,
                                bos_token_id=2, eos_token_id=1, pad_token_id=0)
# Gemma 4: per-layer inputs, global layers with wider heads, one KV head
# and values that are their keys, the last two layers attending to earlier
# layers' caches with a double-wide MLP, partial (proportional) RoPE on the
# global layers, a reached final soft-cap; the window shorter than the prompts.
_GEMMA4_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                    attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
                    hidden_size_per_layer_input=16, vocab_size=320, vocab_size_per_layer_input=320,
                    sliding_window=7, final_logit_softcapping=4.0,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                        "rope_theta": 10000.0}},
                    bos_token_id=2, eos_token_id=1, pad_token_id=0)
SHAPES["gemma4-text"] = dict(_GEMMA4_TEXT, model_type="gemma4_text")
SHAPES["gemma4-wrapper"] = dict(_GEMMA4_TEXT, model_type="gemma4", hidden_size=48, num_kv_shared_layers=0,
                                attention_k_eq_v=False, use_double_wide_mlp=False, sliding_window=19,
                                vocab_size=256, vocab_size_per_layer_input=256)


def _make_gemma4_wrapper(spec: dict, init_scale: float):
    """Gemma 4's multimodal wrapper: the text model beside a tiny vision
    tower that fastllm ignores. The image, video and audio placeholders lie
    outside the vocabulary: transformers' wrapper embeds a placeholder in a
    prompt as padding even without an image, which a text model does not."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    text = {k: v for k, v in spec.items() if k != "model_type"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, global_head_dim=16)
    config = Gemma4Config(text_config=dict(text, initializer_range=init_scale, max_position_embeddings=512),
                          vision_config=vision, audio_config=None, initializer_range=init_scale,
                          boi_token_id=3, eoi_token_id=4, image_token_id=1000, video_token_id=1001,
                          boa_token_id=7, eoa_token_index=8, audio_token_id=1002)
    return Gemma4ForConditionalGeneration(config)


def _make_gemma3_wrapper(spec: dict, init_scale: float):
    """Gemma 3's multimodal wrapper: the text model inside a tiny SigLIP
    vision tower that fastllm ignores."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    text = {k: v for k, v in spec.items() if k != "model_type"}
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=16, patch_size=4)
    config = Gemma3Config(text_config=dict(text, initializer_range=init_scale, max_position_embeddings=512),
                          vision_config=vision, mm_tokens_per_image=4, initializer_range=init_scale,
                          boi_token_index=3, eoi_token_index=4, image_token_index=5)
    return Gemma3ForConditionalGeneration(config)


def _make_qwen35(spec: dict, seed: int, scale: float):
    """A tiny Qwen3.5 with every parameter drawn at random: norm weights
    start at zero there ((1 + w) form) and A_log/dt_bias at fixed values,
    which would leave those paths untested."""
    import torch
    from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                              Qwen3_5MoeTextConfig, Qwen3_5TextConfig)
    spec = dict(spec)
    model_type = spec.pop("model_type")
    wrapper = model_type in ("qwen3_5", "qwen3_5_moe")
    tie = spec.pop("tie_word_embeddings")
    spec.setdefault("rms_norm_eps", 1e-6)
    spec["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    torch.manual_seed(seed)
    if wrapper:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=spec["hidden_size"],
                      num_position_embeddings=16)
        classes = {"qwen3_5": (Qwen3_5ForConditionalGeneration, Qwen3_5Config),
                   "qwen3_5_moe": (Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig)}
        model_class, config_class = classes[model_type]
        model = model_class(config_class(
            text_config=dict(spec, tie_word_embeddings=tie), vision_config=vision, tie_word_embeddings=tie))
    elif model_type == "qwen3_5_moe_text":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**spec, tie_word_embeddings=tie))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**spec, tie_word_embeddings=tie))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 4, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model.float().eval()


def make_tiny_model(kind: str, folder, seed: int = 0, init_scale: float = 0.2,
                    dtype: str = "float32") -> Path:
    """Create and save a tiny random checkpoint of SHAPES[kind]; returns the folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[kind])
    if spec["model_type"].startswith("qwen3_5"):
        model = _make_qwen35(spec, seed, scale=0.12)
        if dtype != "float32":
            model = model.to(torch.bfloat16)
        model.save_pretrained(Path(folder), safe_serialization=True)
        return Path(folder)
    model_type = spec.pop("model_type")
    spec.setdefault("max_position_embeddings", 512)
    spec.setdefault("rms_norm_eps", 1e-5)
    torch.manual_seed(seed)
    if model_type == "gemma3":
        model = _make_gemma3_wrapper(spec, init_scale)
    elif model_type == "gemma4":
        model = _make_gemma4_wrapper(spec, init_scale)
    elif model_type == "mistral3":
        model = _make_mistral3_wrapper(spec, init_scale)
    else:
        config = AutoConfig.for_model(model_type, initializer_range=init_scale, **spec)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Norm weights start at 1: perturb them so a wrong permutation of
        # q/k norms or a missing norm cannot go unnoticed.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):   # Gemma 4's: ones would leave it untested
                b.copy_(1.0 + 0.3 * torch.randn_like(b))
    model = model.to(getattr(torch, {"float32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)))
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def with_config(folder, out, **changes) -> Path:
    """A copy of the checkpoint in folder at out, its config.json changed
    (a value of None deletes the key)."""
    import json
    import shutil
    out = Path(out)
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def with_rope(folder, out, **changes) -> Path:
    """A copy of the checkpoint in folder at out, the rope_parameters of its
    (text model's) config changed."""
    import json
    raw = json.loads((Path(folder) / "config.json").read_text())
    text = raw.get("text_config", raw)
    params = dict(text["rope_parameters"], **changes)
    if "text_config" in raw:
        return with_config(folder, out, text_config=dict(text, rope_parameters=params))
    return with_config(folder, out, rope_parameters=params)

# Ministral 3: YaRN (factor 8, its original context of 24 shorter than the
# longer prompts) and queries scaled by position past each multiple of it
# (llama_4_scaling_beta far from 0.1 so that the step shows); the mistral3
# wrapper's text model besides, tied, with a sliding window of 19.
_YARN = dict(type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=24,
             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.6)
SHAPES["ministral3"] = dict(model_type="ministral3", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=300,
                            max_position_embeddings=512, rope_parameters=_YARN, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHAPES["mistral3-wrapper"] = dict(
    model_type="mistral3", hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, vocab_size=256, max_position_embeddings=512, sliding_window=19,
    rope_parameters=dict(_YARN, factor=4.0, mscale=1.3, mscale_all_dim=0.7, beta_fast=16.0,
                         original_max_position_embeddings=20, llama_4_scaling_beta=0.4),
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# Mixtures of experts, several experts per token: Qwen3-MoE with a dense
# layer among routed ones (mlp_only_layers and decoder_sparse_step) and
# its weights renormalised, or not; Mixtral (always renormalised); Qwen3.5-MoE
# with its shared expert. Expert sizes are whole int8 blocks (32).
SHAPES["qwen3_moe"] = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                           num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                           mlp_only_layers=[2], decoder_sparse_step=1, tie_word_embeddings=False)
SHAPES["qwen3_moe-unnormed"] = dict(SHAPES["qwen3_moe"], norm_topk_prob=False, mlp_only_layers=[],
                                    decoder_sparse_step=2, num_experts=6, num_experts_per_tok=2,
                                    tie_word_embeddings=True)
# Many experts, one per token: torch.topk takes its partial_sort path (k * 64 <= n).
SHAPES["qwen3_moe-64"] = dict(SHAPES["qwen3_moe"], num_hidden_layers=2, num_experts=64, num_experts_per_tok=1,
                              mlp_only_layers=[])
SHAPES["mixtral"] = dict(model_type="mixtral", hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300, num_local_experts=6,
                         num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SHAPES["qwen3_5_moe"] = dict(SHAPES["qwen3_5-text"], model_type="qwen3_5_moe_text", num_experts=8,
                             num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=64)
# Its multimodal wrapper, tied, another layer order.
SHAPES["qwen3_5_moe-wrapper"] = dict(SHAPES["qwen3_5-wrapper"], model_type="qwen3_5_moe", num_experts=6,
                                     num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=32)


def _make_mistral3_wrapper(spec: dict, init_scale: float):
    """The mistral3 wrapper: a Ministral 3 text model beside a tiny Pixtral
    vision tower that fastllm ignores."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    text = dict({k: v for k, v in spec.items() if k != "tie_word_embeddings"}, model_type="ministral3",
                initializer_range=init_scale)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=16, image_size=16, patch_size=4)
    config = Mistral3Config(text_config=text, vision_config=vision, initializer_range=init_scale,
                            tie_word_embeddings=spec["tie_word_embeddings"], image_token_index=5)
    return Mistral3ForConditionalGeneration(config)
