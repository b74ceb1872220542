"""Seed-OSS: Llama with a switch of its own for the output projection's
bias and a head size apart from hidden/heads; llama.cpp's seed_oss loads
neither that bias nor the MLP's."""
from ..family import Family

FAMILIES = {
    "seed_oss": Family("SeedOssForCausalLM", attention_bias="attention_bias", o_bias="attention_out_bias",
                       mlp_bias="mlp_bias", gguf=True,
                       # llama.cpp names the norm before the MLP as the attention's post-norm.
                       gguf_tensors={"ffn_norm": "post_attention_norm.weight"},
                       gguf_refuse={"o_bias": "llama.cpp's seed_oss has no bias of the output projection",
                                    "mlp_bias": "llama.cpp's seed_oss has no MLP biases"},
                       defaults=dict(attention_bias=True, head_dim=128)),
}
