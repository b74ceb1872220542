"""SmolLM3: Llama with layers that skip RoPE (NoPE)."""
from ..errors import ConversionError, ModelFileError
from ..family import Family
from ..values import positive_int

# llama.cpp's smollm3 skips RoPE in every fourth layer; its GGUF files say nothing of it.
GGUF_NO_ROPE_INTERVAL = 4


def no_rope_layers(raw: dict, n_layers: int, path) -> list:
    """Per layer, 1 where it applies RoPE and 0 where it does not, as
    transformers' SmolLM3Config reads config.json: no_rope_layers, else every
    no_rope_layer_interval-th layer without."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval", 4)
        if not positive_int(interval):
            raise ModelFileError(path, f"no_rope_layer_interval must be a positive integer, got {interval!r}")
        return [int((i + 1) % interval != 0) for i in range(n_layers)]
    if (not isinstance(flags, list) or len(flags) != n_layers
            or any(type(v) not in (int, bool) or v not in (0, 1) for v in flags)):
        raise ModelFileError(path, f"no_rope_layers must list 1 (RoPE) or 0 (none) for each of the "
                                   f"{n_layers} layers, got {flags!r}"[:300])
    return [int(v) for v in flags]


def read_config(raw: dict, fields: dict, path) -> dict:
    return {"no_rope_layers": no_rope_layers(raw, fields["num_hidden_layers"], path)}


def gguf_read(meta, cfg: dict) -> None:
    cfg["no_rope_layer_interval"] = GGUF_NO_ROPE_INTERVAL


def gguf_write(w, cfg, folder) -> dict:
    if cfg.no_rope_layers != no_rope_layers({"no_rope_layer_interval": GGUF_NO_ROPE_INTERVAL},
                                            cfg.num_hidden_layers, folder):
        raise ConversionError(folder / "config.json", f"no_rope_layers {cfg.no_rope_layers} cannot be written "
                                                      f"to GGUF: llama.cpp skips RoPE in every "
                                                      f"{GGUF_NO_ROPE_INTERVAL}th layer, and only there")
    return {}


FAMILIES = {
    "smollm3": Family("SmolLM3ForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                      mlp_bias="mlp_bias", gguf=True, gguf_qk_interleaved=True, gguf_head_dim=False,
                      refuse={"use_sliding_window": "sliding windows are not supported for smollm3"},
                      read_config=read_config, gguf_read=gguf_read, gguf_write=gguf_write),
}
