"""GGML block quantization (fastllm.formats.quants) and the quantization mixes.

Oracles:
* gguf's dequantizers read our blocks (the layout), and the error of the
  round trip on Gaussian rows is what llama.cpp's quantizers give (its
  test-quantize-fns reports the same figures), per type;
* llama.cpp's own blocks: tests/data/llama-quantize holds a small F32 file
  and what llama-quantize --pure made of it in each type (make.py there);
  ours must be byte-identical (benchmarks/gguf_export.py makes the same
  comparison on a whole model);
* llama-quantize's per-tensor choices, written out for a 30-layer model.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fastllm.formats import quants

# Relative RMSE of quantize -> dequantize on standard normal rows: about
# 10% above what llama.cpp's reference quantizers reach.
GAUSSIAN_RMSE = {"q8_0": 0.006, "q4_0": 0.095, "q4_1": 0.086, "q5_0": 0.047, "q5_1": 0.042,
                 "q4_k": 0.078, "q5_k": 0.040, "q6_k": 0.0195}


def rel_rmse(a, b) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def test_the_c_cores_block_sizes_are_ggmls():
    """The C core's table, which Python reads its block sizes from, agrees
    with the gguf package's, type for type."""
    import gguf
    from fastllm.core import _core
    types = _core.weight_types()
    assert [t["type"] for t in types] == list(range(len(types)))
    for t in types:
        ggml = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t["name"].upper()]]
        assert (t["block"], t["block_bytes"]) == ggml, t
        assert t["superblock"] == (ggml[0] if t["quantized"] else 1), t
    assert set(quants.QTYPES) == {t["name"] for t in types if t["quantized"]}


@pytest.mark.parametrize("qtype", list(quants.QTYPES))
def test_round_trip_through_gguf_dequantizer(qtype):
    import gguf
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 512)).astype(np.float32)
    blocks = quants.quantize(w, qtype)
    assert blocks.dtype == np.uint8 and blocks.shape == (48, quants.row_bytes(qtype, 512))
    per_block = quants.QTYPES[qtype]
    assert blocks.shape[1] == 512 // per_block[0] * per_block[1]
    back = quants.dequantize(blocks, qtype, 512)
    direct = gguf.quants.dequantize(blocks, quants.ggml_type(qtype))
    np.testing.assert_array_equal(back, direct)
    err = rel_rmse(back, w)
    assert 0 < err < GAUSSIAN_RMSE[qtype], err
    # Quantizing what a quantization gave changes little.
    again = quants.dequantize(quants.quantize(back, qtype), qtype, 512)
    assert rel_rmse(again, back) < GAUSSIAN_RMSE[qtype] / 2


def test_more_bits_less_error():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((32, 256)) * rng.uniform(0.01, 3, (32, 1))).astype(np.float32)
    err = {q: rel_rmse(quants.dequantize(quants.quantize(w, q), q, 256), w) for q in quants.QTYPES}
    assert err["q4_k"] < err["q4_0"] and err["q5_k"] < err["q5_0"]
    assert err["q8_0"] < err["q6_k"] < err["q5_k"] < err["q4_k"]


def test_k_quant_search_beats_min_max_rounding():
    # The scale/min search must find better than the plain range split.
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 256)).astype(np.float32) ** 3
    sub = w.reshape(-1, 32)
    lo, hi = np.minimum(sub.min(1, keepdims=True), 0), sub.max(1, keepdims=True)
    naive = np.round((sub - lo) / (hi - lo) * 15) * (hi - lo) / 15 + lo
    ours = quants.dequantize(quants.quantize(w, "q4_k"), "q4_k", 256)
    assert rel_rmse(ours, w) < rel_rmse(naive.reshape(w.shape), w)


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k", "q4_0"])
def test_special_rows(qtype):
    k = 256
    rows = np.zeros((4, k), np.float32)
    rows[1] = 0.75                      # constant
    rows[2, ::7] = -3.0                 # sparse, negative
    rows[3] = np.linspace(-1e-3, 2e4, k, dtype=np.float32)  # wide range
    back = quants.dequantize(quants.quantize(rows, qtype), qtype, k)
    assert np.all(np.isfinite(back))
    np.testing.assert_array_equal(back[0], 0)
    span = np.abs(rows).max(axis=1)
    assert np.all(np.abs(back - rows).max(axis=1) <= 0.1 * span + 1e-6)


def test_float_types_are_exact_bytes():
    w = np.random.default_rng(4).standard_normal((3, 40)).astype(np.float32)
    assert np.array_equal(quants.quantize(w, "f32").view(np.float32), w)
    assert np.array_equal(quants.quantize(w, "f16").view(np.float16), w.astype(np.float16))
    np.testing.assert_array_equal(quants.dequantize(quants.quantize(w, "f16"), "f16", 40),
                                  w.astype(np.float16).astype(np.float32))


def test_bad_shapes_and_types():
    with pytest.raises(ValueError, match="multiple of 256"):
        quants.quantize(np.zeros((2, 576), np.float32), "q4_k")
    with pytest.raises(ValueError, match="multiple of 32"):
        quants.quantize(np.zeros((2, 48), np.float32), "q8_0")
    with pytest.raises(ValueError, match="matrix"):
        quants.quantize(np.zeros(256, np.float32), "q8_0")
    with pytest.raises(ValueError, match="unknown quantization type"):
        quants.quantize(np.zeros((1, 256), np.float32), "q3_k")
    with pytest.raises(ValueError, match="bytes"):
        quants.dequantize(np.zeros((1, 10), np.uint8), "q8_0", 32)


# --------------------------------------------------------------------------
# Mixes


def smollm_like(n_layers=30, hidden=576, ffn=1536, tied=True, hf=False):
    """(name, shape) of a SmolLM2-135M-shaped model, in GGUF or HF names."""
    out = []
    if hf:
        out.append(("model.embed_tokens.weight", (49152, hidden)))
        for i in range(n_layers):
            p = f"model.layers.{i}."
            out += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (192, hidden)),
                    (p + "self_attn.v_proj.weight", (192, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                    (p + "mlp.gate_proj.weight", (ffn, hidden)), (p + "mlp.up_proj.weight", (ffn, hidden)),
                    (p + "mlp.down_proj.weight", (hidden, ffn)), (p + "input_layernorm.weight", (hidden,)),
                    (p + "post_attention_layernorm.weight", (hidden,))]
        out.append(("model.norm.weight", (hidden,)))
        if not tied:
            out.append(("lm_head.weight", (49152, hidden)))
        return out
    out.append(("token_embd.weight", (49152, hidden)))
    for i in range(n_layers):
        p = f"blk.{i}."
        out += [(p + "attn_q.weight", (hidden, hidden)), (p + "attn_k.weight", (192, hidden)),
                (p + "attn_v.weight", (192, hidden)), (p + "attn_output.weight", (hidden, hidden)),
                (p + "ffn_gate.weight", (ffn, hidden)), (p + "ffn_up.weight", (ffn, hidden)),
                (p + "ffn_down.weight", (hidden, ffn)), (p + "attn_norm.weight", (hidden,)),
                (p + "ffn_norm.weight", (hidden,)), (p + "attn_q.bias", (hidden,))]
    out.append(("output_norm.weight", (hidden,)))
    if not tied:
        out.append(("output.weight", (49152, hidden)))
    return out


# llama-quantize's picks for SmolLM2-135M (30 layers, rows of 576 and 1536),
# as its Q4_K_M log lists them: the layers whose attn_v/ffn_down get Q6_K.
MORE_BITS_30 = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


def test_q4_k_m_plan_matches_llama_quantize():
    plan = quants.plan(smollm_like(), "q4_k_m")
    assert plan["token_embd.weight"] == "q8_0"          # tied: the output's Q6_K, 576 wide -> Q8_0
    assert plan["output_norm.weight"] == "f32" and plan["blk.0.attn_q.bias"] == "f32"
    for i in range(30):
        six = i in MORE_BITS_30
        assert plan[f"blk.{i}.ffn_down.weight"] == ("q6_k" if six else "q4_k")
        assert plan[f"blk.{i}.attn_v.weight"] == ("q8_0" if six else "q5_0")   # 576 wide: fallbacks
        assert plan[f"blk.{i}.attn_q.weight"] == "q5_0"
        assert plan[f"blk.{i}.ffn_up.weight"] == "q5_0"


def test_plan_by_hf_names_agrees():
    gg = quants.plan(smollm_like(tied=False), "q5_k_m")
    hf = quants.plan(smollm_like(tied=False, hf=True), "q5_k_m")
    assert gg["output.weight"] == hf["lm_head.weight"] == "q8_0"
    assert gg["token_embd.weight"] == hf["model.embed_tokens.weight"] == "q5_1"   # untied: the base type
    for i in range(30):
        assert gg[f"blk.{i}.ffn_down.weight"] == hf[f"model.layers.{i}.mlp.down_proj.weight"]
        assert gg[f"blk.{i}.attn_v.weight"] == hf[f"model.layers.{i}.self_attn.v_proj.weight"]
        assert hf[f"model.layers.{i}.input_layernorm.weight"] == "f32"


def test_plain_mixes():
    wide = smollm_like(n_layers=4, hidden=512, ffn=1024, tied=False)
    q4k = quants.plan(wide, "q4_k")
    assert {q for n, q in q4k.items() if n.endswith("weight") and "norm" not in n} == {"q4_k"}
    q4_0 = quants.plan(wide, "q4_0")
    assert q4_0["output.weight"] == "q6_k" and q4_0["token_embd.weight"] == "q4_0"
    assert quants.plan(wide, "q8_0")["output.weight"] == "q8_0"
    assert set(quants.plan(wide, "q6_k").values()) == {"q6_k", "f32"}
    f16 = quants.plan(wide, "f16")
    assert f16["blk.0.attn_q.weight"] == "f16" and f16["blk.0.attn_norm.weight"] == "f32"
    # Rows of 48 fit no block: f16, as llama.cpp falls back.
    assert quants.plan([("blk.0.attn_q.weight", (48, 48))], "q8_0")["blk.0.attn_q.weight"] == "f16"
    with pytest.raises(ValueError, match="unknown quantization mix"):
        quants.plan(wide, "q3_k_m")


# --------------------------------------------------------------------------
# llama.cpp's own blocks

LLAMA_QUANTIZE = Path(__file__).parent / "data" / "llama-quantize"


def _tensors(name: str) -> dict:
    import gguf
    return {t.name: t for t in gguf.GGUFReader(LLAMA_QUANTIZE / f"{name}.gguf").tensors}


@pytest.mark.parametrize("qtype", list(quants.QTYPES))
def test_blocks_equal_llama_quantize(qtype):
    source, made = _tensors("source-F32"), _tensors(qtype.upper())
    assert made.keys() == source.keys()
    for name, src in source.items():
        ref = made[name]
        assert ref.tensor_type.name.lower() == qtype, name
        w = np.asarray(src.data, np.float32).reshape(-1, int(src.shape[0]))
        np.testing.assert_array_equal(quants.quantize(w, qtype), np.asarray(ref.data).reshape(w.shape[0], -1),
                                      err_msg=name)
