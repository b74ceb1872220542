"""InternLM3: Llama under names of its own. Its config.json says qkv_bias
for the biases of q, k, v and the output projection and bias for the MLP's
(transformers' attribute_map), which must agree; llama.cpp's converter
writes it as a llama GGUF."""
from ..errors import ModelFileError
from ..family import Family

# transformers' InternLM3Config defaults, where they are not Llama's.
DEFAULTS = dict(vocab_size=128512, hidden_size=4096, intermediate_size=10240, num_hidden_layers=48,
                num_attention_heads=32, num_key_value_heads=2, head_dim=128, max_position_embeddings=32768,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def read_config(raw: dict, fields: dict, path) -> dict:
    # transformers runs it as Llama, whose one attention_bias covers q, k, v and o.
    if fields["attention_bias"] != fields["mlp_bias"]:
        raise ModelFileError(path, "qkv_bias and bias (attention_bias and mlp_bias) must be equal for "
                                   "internlm3, as transformers requires")
    return {}


FAMILIES = {
    "internlm3": Family("InternLM3ForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                        mlp_bias="mlp_bias", attribute_map={"qkv_bias": "attention_bias", "bias": "mlp_bias"},
                        defaults=DEFAULTS, gguf_export="llama", gguf_qk_interleaved=True,
                        read_config=read_config),
}
