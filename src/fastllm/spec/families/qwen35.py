"""Qwen3.5 (and its mixture of experts): Gated DeltaNet layers between
gated full-attention ones, (1 + w) norms, partial rotary, and a
multi-token-prediction block. Its checkpoints are a multimodal wrapper's
text model."""
from ..errors import ModelFileError
from ..family import Family
from ..files import read_json
from ..values import need_int, positive_int

_LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim")


def read_config(raw: dict, fields: dict, path) -> dict:
    """Which layers are Gated DeltaNet ones (layer_types, else all but every
    full_attention_interval-th) and their sizes."""
    n_layers = fields["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = raw.get("full_attention_interval", 4)
        if not positive_int(interval):
            raise ModelFileError(path, f"full_attention_interval must be a positive integer, got {interval!r}")
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(n_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != n_layers
            or any(t not in ("full_attention", "linear_attention") for t in layer_types)):
        raise ModelFileError(path, "layer_types must list 'full_attention' or "
                                   f"'linear_attention' for each of the {n_layers} layers")
    linear = {key: need_int(raw, key, path) for key in _LINEAR_KEYS}
    if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
        raise ModelFileError(path, "linear_num_value_heads must be a multiple of linear_num_key_heads")
    return dict(linear, layer_types=layer_types)


def gguf_read(meta, cfg: dict) -> None:
    """The Gated DeltaNet sizes from llama.cpp's ssm.* keys, the layer kinds,
    and the rope: partial, and multimodal (its sections only matter for
    images; text positions rotate as plain RoPE)."""
    def positive(key):
        value = int(meta.require(key))
        if value < 1:
            raise meta.error(f"{meta.arch}.{key} is {value}; it must be at least 1")
        return value
    hk, hv = positive("ssm.group_count"), positive("ssm.time_step_rank")
    inner = positive("ssm.inner_size")
    if inner % hv:
        raise meta.error(f"{meta.arch}.ssm.inner_size {inner} is not a whole number of "
                         f"{hv} value heads (ssm.time_step_rank)")
    n_layers = meta.n_layers
    recurrent = meta.get("attention.recurrent_layers")
    if recurrent is not None:
        # One entry per block, the multi-token-prediction ones included.
        if len(recurrent) < n_layers:
            raise meta.error(f"{meta.arch}.attention.recurrent_layers has {len(recurrent)} entries "
                             f"for {n_layers} layers")
        recurrent = recurrent[:n_layers]
    else:
        interval = int(meta.get("full_attention_interval", 4))
        if interval < 1:
            raise meta.error(f"{meta.arch}.full_attention_interval is {interval}; it must be at least 1")
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    sections = meta.get("rope.dimension_sections") or [11, 11, 10, 0]
    cfg["rope_parameters"] = {
        "rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
        "partial_rotary_factor": meta.rope_dim / meta.head_dim, "mrope_section": [int(x) for x in sections[:3]],
        "mrope_interleaved": True}
    cfg.update({
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "linear_conv_kernel_dim": positive("ssm.conv_kernel"),
        "linear_key_head_dim": positive("ssm.state_size"),
        "linear_num_key_heads": hk,
        "linear_num_value_heads": hv,
        "linear_value_head_dim": inner // hv,
    })


def gguf_write(w, cfg, folder) -> dict:
    """The Gated DeltaNet sizes as ssm.*, the layer kinds and the rope
    sections, as llama.cpp's converter writes them."""
    raw = read_json(folder / "config.json", 1 << 22, "config.json")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    rope = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    sections = [int(x) for x in rope.get("mrope_section") or [11, 11, 10]]
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    # Keys newer than the oldest gguf package this writes with.
    w.add_array(f"{w.arch}.attention.recurrent_layers",
                [cfg.layer_kind(i) == "linear_attention" for i in range(cfg.num_hidden_layers)])
    w.add_uint32(f"{w.arch}.full_attention_interval", int(text.get("full_attention_interval", 4)))
    return {}


_QWEN35 = dict(qk_norm=True, norm_plus_one=True, attn_output_gate=True, linear_attention=True,
               partial_rotary_factor=0.25, untie_with_head=True, gguf_partial_rotary=True,
               # llama.cpp names the norm before the MLP as the attention's post-norm.
               gguf_tensors={"ffn_norm": "post_attention_norm.weight"},
               read_config=read_config, gguf_read=gguf_read, gguf_write=gguf_write)

FAMILIES = {
    "qwen3_5_text": Family("Qwen3_5ForCausalLM", **_QWEN35, mtp=True,
                           refuse={"attention_bias": "biases are not supported for qwen3_5_text"},
                           gguf="qwen35"),
    "qwen3_5_moe_text": Family("Qwen3_5MoeForCausalLM", **_QWEN35,
                               refuse={"attention_bias": "biases are not supported for qwen3_5_moe_text"},
                               gguf="qwen35moe", experts_keys=("num_experts",), shared_expert=True),
    "qwen3_5": Family("Qwen3_5ForConditionalGeneration", text_config="qwen3_5_text",
                      weight_prefix="model.language_model."),
    "qwen3_5_moe": Family("Qwen3_5MoeForConditionalGeneration", text_config="qwen3_5_moe_text",
                          weight_prefix="model.language_model."),
}
