"""Tiny Phi-3 checkpoints and the GGUF files llama.cpp's converter and
quantizer make of them, for tests/test_phi3.py.

    python make.py /path/to/llama.cpp

Each model of MODELS is a random Phi-3 (fused qkv_proj and gate_up_proj)
saved by transformers into <name>/ (config.json, model.safetensors, and
the tokenizer of ../spm-gguf/llama-bpe-bf.model, a Llama-2-style
SentencePiece vocabulary as Phi-3's), then converted by
convert_hf_to_gguf.py --outtype f32 into <name>-F32.gguf. "wide" is only
kept quantized: llama-quantize Q4_K_M of its F32 file gives
wide-Q4_K_M.gguf (its width, 256, is one K-quant superblock).
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles.gguf_maker import CONVERTER, QUANTIZE, add_spm_tokenizer, convert, quantize  # noqa: E402

VOCAB = ROOT / "tests" / "data" / "spm-gguf" / "llama-bpe-bf.model"
COMMON = dict(model_type="phi3", vocab_size=2000, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              rms_norm_eps=1e-5, max_position_embeddings=256)
MODELS = {
    # Phi-4-mini's switches: partial rotary (12 of 16 dims) under LongRoPE,
    # the original context 32 tokens, a tied head.
    "longrope": dict(COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, partial_rotary_factor=0.75, original_max_position_embeddings=32,
                     tie_word_embeddings=True,
                     rope_scaling={"type": "longrope", "short_factor": [1.0, 1.05, 1.2, 1.5, 2.0, 3.0],
                                   "long_factor": [1.0, 1.5, 3.0, 8.0, 20.0, 50.0]}),
    # Phi-3-mini's: full rotary, a sliding window, an untied head.
    "swa": dict(COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, sliding_window=6, tie_word_embeddings=False),
    "wide": dict(COMMON, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}


def make_model(name: str, folder: Path, work: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(MODELS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), initializer_range=0.2, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    add_spm_tokenizer(folder, VOCAB, work, "llama")
    return folder


def main(llama_cpp: Path):
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            keep = name != "wide"
            folder = HERE / name if keep else Path(tmp) / name
            shutil.rmtree(folder, ignore_errors=True)
            make_model(name, folder, Path(tmp))
            f32 = (HERE if keep else Path(tmp)) / f"{name}-F32.gguf"
            convert(llama_cpp / CONVERTER, folder, f32)
            if keep:
                # The tokenizer is ../spm-gguf's; only the model is kept here.
                for f in folder.iterdir():
                    if f.name not in ("config.json", "model.safetensors"):
                        f.unlink()
            else:
                quantize(llama_cpp / QUANTIZE, f32, HERE / f"{name}-Q4_K_M.gguf", "Q4_K_M")
    print(json.dumps({p.name: p.stat().st_size for p in sorted(HERE.rglob("*")) if p.is_file()}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
