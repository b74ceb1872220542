"""The seed corpora of fuzz_safetensors, fuzz_gguf, fuzz_gguf_load, fuzz_pack_cache and fuzz_session_file,
rebuilt by running this file: a tiny model checkpoint in each format and its
variants.

    python tests/fuzz/file_seeds.py      # rewrites tests/fuzz/corpus/{safetensors,gguf,gguf_load,pack_cache,session_file}/
"""
import json
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

# The config fuzz_safetensors loads every input against: one llama layer,
# small enough that a whole checkpoint is 3 KB.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16,
    "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "hidden_act": "silu",
}


def tiny_tensors(hidden=8, ff=16, vocab=16, heads=2, kv=1, seed=0):
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": w(vocab, hidden),
        p + "input_layernorm.weight": np.ones(hidden, np.float32),
        p + "self_attn.q_proj.weight": w(heads * hd, hidden),
        p + "self_attn.k_proj.weight": w(kv * hd, hidden),
        p + "self_attn.v_proj.weight": w(kv * hd, hidden),
        p + "self_attn.o_proj.weight": w(hidden, heads * hd),
        p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        p + "mlp.gate_proj.weight": w(ff, hidden),
        p + "mlp.up_proj.weight": w(ff, hidden),
        p + "mlp.down_proj.weight": w(hidden, ff),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": w(vocab, hidden),
    }


def safetensors_seeds() -> dict:
    from fastllm.formats.safetensors import save_file
    seeds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kwargs in (("tiny-f32", {}), ("tiny-bf16", {"bf16": True})):
            p = Path(tmp) / name
            save_file(p, tiny_tensors(), metadata={"format": "pt"}, **kwargs)
            seeds[name] = p.read_bytes()
        p = Path(tmp) / "tiny-f16"
        save_file(p, {k: v.astype(np.float16) for k, v in tiny_tensors().items()})
        seeds["tiny-f16"] = p.read_bytes()
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "I64", "shape": [1, 1], "data_offsets": [8, 16]}}).encode()
    seeds["two-tensors"] = struct.pack("<Q", len(header)) + header + bytes(16)
    return seeds


def _tiny_vocab():
    tokens = [chr(c) for c in range(ord("a"), ord("a") + 12)] + ["ab", "Ġ", "<|im_start|>", "<|endoftext|>"]
    types = [1] * 14 + [3, 3]
    return tokens, types, ["a b"]


def tiny_gguf(type_of) -> bytes:
    """A one-layer llama GGUF with the tiny vocabulary; type_of(tensor name)
    gives each matrix's GGML type, or None to keep it F32."""
    import gguf
    tokens, types, merges = _tiny_vocab()
    hidden, ff, heads, kv = 32, 32, 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_block_count(1)
        w.add_context_length(64)
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(ff)
        w.add_head_count(heads)
        w.add_head_count_kv(kv)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(14)
        w.add_eos_token_id(15)
        w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
        hd = hidden // heads
        rng = np.random.default_rng(1)
        shapes = {
            "token_embd.weight": (len(tokens), hidden),
            "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
            "blk.0.attn_q.weight": (heads * hd, hidden), "blk.0.attn_k.weight": (kv * hd, hidden),
            "blk.0.attn_v.weight": (kv * hd, hidden), "blk.0.attn_output.weight": (hidden, heads * hd),
            "blk.0.ffn_gate.weight": (ff, hidden), "blk.0.ffn_up.weight": (ff, hidden),
            "blk.0.ffn_down.weight": (hidden, ff), "output_norm.weight": (hidden,),
        }
        for tname, shape in shapes.items():
            data = (rng.standard_normal(shape) * 0.2).astype(np.float32)
            qtype = type_of(tname) if len(shape) == 2 else None
            if qtype is None:
                w.add_tensor(tname, data)
            elif qtype == gguf.GGMLQuantizationType.F16:
                w.add_tensor(tname, data.astype(np.float16))
            else:
                w.add_tensor(tname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


def gguf_seeds() -> dict:
    import gguf
    seeds = {}
    for name, qtype in (("tiny-f32", None), ("tiny-q8_0", gguf.GGMLQuantizationType.Q8_0),
                        ("tiny-q4_1", gguf.GGMLQuantizationType.Q4_1)):
        seeds[name] = tiny_gguf(lambda tname: qtype)
    # The header alone, with one short array: the start of every container.
    seeds["header-array"] = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
                             + struct.pack("<IIQ", 9, 0, 2) + b"\x01\x02")
    return seeds


def gguf_load_seeds() -> dict:
    """fuzz_gguf_load's seeds: fuzz_gguf's, and the default model's mix
    (a Q8_0 embedding, Q4_1 matrices) and F16 matrices."""
    import gguf
    QT = gguf.GGMLQuantizationType
    seeds = gguf_seeds()
    seeds["tiny-q4_1-q8_0"] = tiny_gguf(lambda tname: QT.Q8_0 if tname == "token_embd.weight" else QT.Q4_1)
    seeds["tiny-f16"] = tiny_gguf(lambda tname: QT.F16)
    return seeds


def write(name: str, seeds: dict) -> None:
    folder = HERE / "corpus" / name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    for key, data in seeds.items():
        (folder / key).write_bytes(data)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    write("safetensors", safetensors_seeds())
    write("gguf", gguf_seeds())
    write("gguf_load", gguf_load_seeds())
    import fuzz_pack_cache
    write("pack_cache", fuzz_pack_cache.seeds())
    import fuzz_session_file
    write("session_file", fuzz_session_file.seeds())
