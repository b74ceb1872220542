"""Mixture-of-experts GGUF files as llama.cpp's converter and llama-quantize
write them (tests/data/moe-gguf/make.py): qwen3moe, llama with expert
tensors (Mixtral) and qwen35moe, their experts merged in 3-D tensors
(ffn_gate_exps, ffn_up_exps, ffn_down_exps, or ffn_gate_up_exps), each in
its own type. Run natively and through the folder the importer writes,
against float64 transformers on the folder they were made from.
"""
from pathlib import Path

import pytest

from fastllm import Model
from fastllm.formats.gguf import ConversionError, convert_gguf
from oracles.hf_reference import load_hf
from oracles.splits import assert_same_bits_however_split
from test_qwen35_gguf import assert_greedy_matches, assert_matches

DATA = Path(__file__).resolve().parent / "data" / "moe-gguf"
# file: (its folder, the model_type it imports as)
FILES = {"qwen3moe-F32": ("qwen3moe", "qwen3_moe"), "mixtral-F32": ("mixtral", "mixtral"),
         "qwen35moe-F32": ("qwen35moe", "qwen3_5_moe_text"),
         "qwen35moe-fused-F32": ("qwen35moe", "qwen3_5_moe_text")}


@pytest.fixture(autouse=True)
def _home(fastllm_home):
    """Conversions of the files land in the session's own FASTLLM_HOME."""


@pytest.mark.parametrize("dtype", ["gguf", "f32"])
@pytest.mark.parametrize("name", FILES)
def test_f32_file_matches_transformers_on_its_folder(name, dtype):
    """Natively (the merged expert tensors packed expert by expert) and
    converted to a folder (one tensor per expert, as HF stores them)."""
    folder, model_type = FILES[name]
    model = Model.from_pretrained(DATA / f"{name}.gguf", dtype=dtype, threads=2)
    assert model.config.model_type == model_type
    assert model.config.num_experts > 1 and model.config.norm_topk_prob
    assert_matches(model, load_hf(DATA / folder), f"{name} {dtype}")


def test_greedy_decoding_matches_transformers():
    model = Model.from_pretrained(DATA / "qwen3moe-F32.gguf", threads=2)
    ref = load_hf(DATA / "qwen3moe")
    assert_greedy_matches(model, ref)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_quantized_file_matches_transformers_on_its_dequantized_folder(quant, tmp_path):
    """llama-quantize's output, its experts in their own types (Q4_K_M gives
    one layer's ffn_down_exps Q6_K), run with f32 activations, against
    transformers on the folder the importer dequantizes it into."""
    path = DATA / f"wide-{quant}.gguf"
    folder = convert_gguf(path, tmp_path / "folder", dtype="f32", progress=False)
    model = Model.from_pretrained(path, threads=2, activations="f32")
    want = {"Q8_0": {"q8_0"}, "Q4_K_M": {"q4_k", "q6_k"}}[quant]
    assert want <= set(model.weight_types), model.weight_types
    assert_matches(model, load_hf(folder), quant, seed=3)


def test_a_quantized_qwen35moe_file_reads_the_shared_gate_as_a_vector(tmp_path):
    """llama-quantize writes the shared expert's gate, (1, dim) as the
    converter stores it, as a vector of dim: both are read."""
    from fastllm.formats.gguf_tensors import read_contents
    path = DATA / "qwen35moe-Q8_0.gguf"
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in read_contents(path).tensors}
    assert len(shapes["blk.0.ffn_gate_inp_shexp.weight"]) == 1
    folder = convert_gguf(path, tmp_path / "folder", dtype="f32", progress=False)
    model = Model.from_pretrained(path, threads=2, activations="f32")
    assert "q8_0" in model.weight_types
    assert_matches(model, load_hf(folder), "qwen35moe Q8_0", seed=4)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_quantized_experts_give_the_same_bits_however_split(quant):
    assert_same_bits_however_split(DATA / f"wide-{quant}.gguf", dict(threads=2))


def test_another_router_than_a_softmax_is_refused(tmp_path):
    from test_qwen35_gguf import rewrite
    path = rewrite(DATA / "qwen3moe-F32.gguf", tmp_path / "sigmoid.gguf", ints={"expert_gating_func": 2})
    with pytest.raises(ConversionError, match="expert_gating_func is 2; only a softmax router"):
        Model.from_pretrained(path)


@pytest.mark.parametrize("arch, message", [("gpt-oss", "gpt-oss is not supported"),
                                           ("deepseek2", "multi-head latent attention")])
def test_out_of_scope_architectures_are_refused_clearly(arch, message, tmp_path):
    from test_qwen35_gguf import rewrite
    path = rewrite(DATA / "qwen3moe-F32.gguf", tmp_path / f"{arch}.gguf", arch=arch)
    with pytest.raises(ConversionError, match=message):
        Model.from_pretrained(path)


def test_expert_tensors_without_an_expert_count_are_refused(tmp_path):
    from test_qwen35_gguf import rewrite
    path = rewrite(DATA / "mixtral-F32.gguf", tmp_path / "no-count.gguf", drop=("expert_count",))
    with pytest.raises(ConversionError, match="tensors do not fit the llama architecture: .*unexpected "
                                              "blk.0.ffn_gate_exps.weight"):
        Model.from_pretrained(path)
