"""Llama, and Mistral and Mixtral, which are Llama with a sliding window
(and experts) as far as the run loop is concerned."""
from ..family import EVERY_LAYER, Family

_MIXTRAL_NAMES = {"w_router": "block_sparse_moe.gate.weight",
                  "w_exp_gate": "block_sparse_moe.experts.{e}.w1.weight",
                  "w_exp_up": "block_sparse_moe.experts.{e}.w3.weight",
                  "w_exp_down": "block_sparse_moe.experts.{e}.w2.weight"}

FAMILIES = {
    "llama": Family("LlamaForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                    mlp_bias="mlp_bias", gguf=True, gguf_qk_interleaved=True, gguf_experts="mixtral"),
    # llama.cpp's GGUF of a Mistral is arch llama, without the sliding window.
    "mistral": Family("MistralForCausalLM", sliding_window=EVERY_LAYER, gguf_export="llama",
                      gguf_qk_interleaved=True),
    "mixtral": Family("MixtralForCausalLM", sliding_window=EVERY_LAYER, experts_keys=("num_local_experts",),
                      expert_size_key="intermediate_size", hf_names=_MIXTRAL_NAMES, gguf_qk_interleaved=True),
}
