"""Qwen2 and Qwen3, and Qwen3's mixture of experts."""
from ..family import USE_SLIDING_WINDOW, Family

FAMILIES = {
    "qwen2": Family("Qwen2ForCausalLM", attention_bias=True, sliding_window=USE_SLIDING_WINDOW,
                    gguf=True, gguf_head_dim=False),
    "qwen3": Family("Qwen3ForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                    qk_norm=True, sliding_window=USE_SLIDING_WINDOW, gguf=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                        qk_norm=True, sliding_window=USE_SLIDING_WINDOW, gguf="qwen3moe",
                        experts_keys=("num_experts", "num_local_experts"), norm_topk_prob="norm_topk_prob",
                        sparse_layer_keys=True),
}
