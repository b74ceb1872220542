"""Random-weight Qwen3.5-shaped checkpoints for benchmarking the Gated
DeltaNet path (no real Qwen3.5 weights are reachable here).

    python benchmarks/make_qwen35.py OUT_DIR
    python benchmarks/compare.py --model OUT_DIR/mid --engines fastllm,transformers -p 512 -n 128

'tiny' is the shape the tests use; 'mid' follows Qwen3.5's small models
(head_dim 256 with a quarter rotated, 16 key and 16 value heads of 128 in
the linear layers, three linear layers to one full) at hidden 1024 with 8
layers and a 32k vocabulary, so that the layers, not the LM head, dominate.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oracles.tiny_models import SHAPES, _make_qwen35  # noqa: E402

MID = dict(model_type="qwen3_5_text", vocab_size=32768, hidden_size=1024, intermediate_size=3584,
           num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
           linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
           linear_value_head_dim=128, linear_conv_kernel_dim=4,
           layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
           + ["full_attention"], tie_word_embeddings=True, max_position_embeddings=4096)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    for name, spec, scale in (("tiny", SHAPES["qwen3_5-text"], 0.12), ("mid", MID, 0.02)):
        folder = args.out / name
        _make_qwen35(spec, seed=0, scale=scale).save_pretrained(folder, safe_serialization=True)
        print(folder)


if __name__ == "__main__":
    main()
