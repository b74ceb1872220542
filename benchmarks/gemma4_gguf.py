"""A random-weight Gemma 4 checkpoint as llama.cpp's converter and
llama-quantize make it, for benchmarks/perplexity.py (fastllm's perplexity
and KL divergence beside llama-perplexity's on the same files).

    python benchmarks/gemma4_gguf.py OUT_DIR --llama-cpp /path/to/llama.cpp
    python benchmarks/perplexity.py --base OUT_DIR/gemma4-F32.gguf OUT_DIR/gemma4-Q8_0.gguf \\
        OUT_DIR/gemma4-Q4_K_M.gguf --llama-perplexity /path/to/llama.cpp/build/bin/llama-perplexity \\
        --ctx 256 --chunks 16

The switches are tests/data/gemma4-gguf/make.py's (per-layer inputs, wider
global heads with one KV head and values that are their keys, caches shared
by the last two layers with a double-wide MLP, proportional RoPE, a final
soft-cap), at hidden 256 and 6 layers so that llama-quantize's K-quants
apply, with a window of 64 that a context of 256 passes, and that script's
Gemma-style vocabulary and chat template. Its q_norm weights are scaled by
1/sqrt(head_dim): Gemma 4's softmax scale is 1, and random norms near 1
would make every attention row all but one-hot, so that the least rounding
flips which key a query sees (trained weights learn the scale).
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "data" / "gemma4-gguf"))

import make  # noqa: E402  (tests/data/gemma4-gguf/make.py)
from oracles.gguf_maker import CONVERTER, QUANTIZE, convert, quantize  # noqa: E402


def scale_query_norms(folder: Path) -> None:
    from safetensors.numpy import load_file, save_file
    path = folder / "model.safetensors"
    weights = load_file(path)
    for name, w in weights.items():
        if name.endswith("q_norm.weight"):
            weights[name] = (w / w.size ** 0.5).astype(w.dtype)
    save_file(weights, path, metadata={"format": "pt"})

WIDER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, global_head_dim=128, hidden_size_per_layer_input=64,
             sliding_window=64, final_logit_softcapping=30.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, built")
    args = parser.parse_args()
    llama = args.llama_cpp.resolve()
    out = args.out.resolve()
    folder = make.folder_of("gemma4-bench", dict(make.TEXT, **WIDER), out, llama, init_scale=0.05)
    scale_query_norms(folder)
    f32 = out / "gemma4-F32.gguf"
    convert(llama / CONVERTER, folder, f32)
    for qtype in ("Q8_0", "Q4_K_M"):
        quantize(llama / QUANTIZE, f32, out / f"gemma4-{qtype}.gguf", qtype)
    print(f"wrote {folder} and {out}/gemma4-{{F32,Q8_0,Q4_K_M}}.gguf")


if __name__ == "__main__":
    main()
