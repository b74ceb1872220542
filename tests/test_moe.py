"""Mixtures of experts (Qwen3-MoE, Mixtral, Qwen3.5-MoE) against transformers.

The tiny random checkpoints are oracles/tiny_models.py's: several experts
per token, a dense layer among routed ones (Qwen3-MoE's mlp_only_layers and
decoder_sparse_step), renormalised weights or not, and Qwen3.5-MoE's shared
expert with its sigmoid gate (and its multimodal wrapper, whose text model
fastllm runs). Transformers runs them in float64 with its
experts one by one; the bounds are those of oracles/hf_reference.py.
The tests every family passes (logits and greedy decoding against
transformers with the switches changed, splits, batches and threads) are
the "moe" row of test_conformance.py; this file keeps what is the
experts' own.
"""
import pytest
import torch

from fastllm import Model
from fastllm.cli.main import main
from fastllm.spec.errors import ModelFileError
from fastllm.formats.gguf import ConversionError
from fastllm.formats.gguf_writer import export_gguf
from oracles.hf_reference import hf_logits, load_hf, random_prompt as prompt, within
from oracles.splits import assert_same_bits_however_split
from oracles.tiny_models import with_config


def test_which_layers_route_is_read_from_config(tiny_model_dir):
    moe = Model.from_pretrained(tiny_model_dir("qwen3_moe")).config
    assert moe.moe_layers == [1, 1, 0, 1]   # mlp_only_layers=[2]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (
        8, 3, 32, True)
    sparse = Model.from_pretrained(tiny_model_dir("qwen3_moe-unnormed")).config
    assert sparse.moe_layers == [0, 1, 0, 1] and not sparse.norm_topk_prob   # decoder_sparse_step=2
    mixtral = Model.from_pretrained(tiny_model_dir("mixtral")).config
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (6, 64, True)
    shared = Model.from_pretrained(tiny_model_dir("qwen3_5_moe")).config
    assert shared.shared_expert and shared.shared_expert_intermediate_size == 64


def test_missing_experts_are_refused(tiny_model_dir, tmp_path):
    folder = with_config(tiny_model_dir("qwen3_moe"), tmp_path / "all", mlp_only_layers=[])
    with pytest.raises(ModelFileError, match="experts"):
        Model.from_pretrained(folder)


@pytest.mark.parametrize("kind, tied", [
    ("qwen3_moe", [(1, 4)]), ("qwen3_moe", [(0, 7)]), ("qwen3_moe", [(2, 3)]), ("qwen3_moe", [(5, 6)]),
    ("qwen3_moe", [(0, 3), (0, 5), (1, 6)]), ("qwen3_moe", [(2, e) for e in range(8)]),
    ("qwen3_moe-64", [(e % 5, e) for e in range(5, 64)]),
])
def test_router_ties_are_broken_as_transformers_breaks_them(kind, tied, tiny_model_dir, tmp_path):
    """Experts with the same router row tie for every token; torch.topk
    keeps one or another by its sorting algorithm, not by index, and so
    must fastllm (their experts differ, so the wrong one shows). (a, b):
    expert b gets expert a's row."""
    model = load_hf(tiny_model_dir(kind), "float32")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                for a, b in tied:
                    p[b] = p[a]
    model.save_pretrained(tmp_path / "tie")
    ref, ours = load_hf(tmp_path / "tie"), Model.from_pretrained(tmp_path / "tie", threads=2)
    for seed in range(3):
        ids = prompt(300, 40, seed)
        ok, err, _ = within(ours.logits(ids), hf_logits(ref, ids))
        assert ok, f"experts {tied} tied, prompt {seed}: max |err| {err:.3g}"


@pytest.mark.parametrize("load", [dict(), dict(dtype="bf16"), dict(dtype="q8_0"), dict(dtype="q4_k_m")])
def test_split_or_batched_prompts_give_the_same_bits_in_every_weight_type(load, tiny_model_dir):
    assert_same_bits_however_split(tiny_model_dir("qwen3_moe"), dict(threads=2, **load))


@pytest.mark.parametrize("model_type, message", [
    ("gpt_oss", "gpt-oss is not supported"),
    ("deepseek_v3", "multi-head latent attention"),
    ("qwen2_moe", "Qwen2-MoE"),
])
def test_out_of_scope_families_are_refused_clearly(model_type, message, tiny_model_dir, tmp_path):
    folder = with_config(tiny_model_dir("qwen3_moe"), tmp_path / model_type, model_type=model_type)
    with pytest.raises(ModelFileError, match=message):
        Model.from_pretrained(folder)


def test_info_shows_the_experts(tiny_model_dir, capsys):
    assert main(["info", "--model", str(tiny_model_dir("qwen3_5_moe")), "--threads", "1"]) == 0
    assert "3 of 8 per token, 32 wide, renormalised, in 4 of 4 layers, a shared expert 64 wide" in \
        capsys.readouterr().out


def test_export_to_gguf_is_refused_clearly(tiny_model_dir, tmp_path):
    with pytest.raises(ConversionError, match="writing a mixture of experts to GGUF is not supported"):
        export_gguf(tiny_model_dir("mixtral"), tmp_path / "out.gguf")


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) is more than the 8 experts"),
    (dict(num_experts=5000, num_local_experts=5000), "more than 4096 experts are not supported"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok must be a positive integer"),
    (dict(mlp_only_layers="2"), "mlp_only_layers must be a list of layer indices"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer"),
])
def test_bad_expert_settings_are_refused(changes, message, tiny_model_dir, tmp_path):
    with pytest.raises(ModelFileError, match=message):
        Model.from_pretrained(with_config(tiny_model_dir("qwen3_moe"), tmp_path / "bad", **changes))
