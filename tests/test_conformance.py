"""The conformance tests every family of the one layer passes, written once.

FAMILIES has a row per family: the tiny checkpoints of
oracles/tiny_models.py it covers and, where it has them, the GGUF files
llama.cpp's converter wrote of like shapes (tests/data/<folder>/make.py
writes each file and transformers' logits on the folder it was made from).
Each test runs over every row:

* the logits of a random prompt within oracles/hf_reference.py's bound of
  float64 transformers on every SIMD path, and transformers with a switch
  of the family turned off (a config change) outside it, so that the
  comparison checks what the switch does; greedy decoding judged with the
  reference's margins;
* the same bits however a prompt is split or batched, and for any thread
  count;
* the converter's file run natively and through the folder it converts to,
  that folder run in transformers, and fastllm's own export of it equal to
  the converter's file, tensor for tensor.

What a family needs beyond these (its config reading, its refusals, its chat
template, its own math) stays in its own file: test_coverage_switches.py,
test_gemma.py, test_gemma4.py, test_ministral3.py, test_moe.py and
test_sliding_window.py.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import pytest

from fastllm import Model
from fastllm.formats.gguf import convert_gguf
from fastllm.formats.gguf_writer import export_gguf
from oracles.gguf_files import arch_fields_and_tensors
from oracles.hf_reference import compare_greedy, hf_greedy, hf_logits, load_hf, logits_against_transformers, within
from oracles.splits import assert_same_bits_for_thread_counts, assert_same_bits_however_split
from oracles.tiny_models import with_config, with_rope

DATA = Path(__file__).parent / "data"
PATHS = ("generic", "avx2", "avx512")
KV_DTYPES = ("f32", "bf16")


@dataclass(frozen=True)
class Family:
    name: str
    kinds: tuple                 # tiny shapes (oracles/tiny_models.py) compared with transformers
    # kind -> config changes, each of which must move transformers' logits
    # out of the bound (a switch of the family turned off)
    switched_off: Mapping = field(default_factory=dict)
    edit: Callable = with_config           # how a change is written into a copy of the checkpoint
    logits_tokens: int = 40                # the prompt compared with transformers
    greedy_tokens: int = 40                # greedy tokens after the prompt's first 7
    min_greedy: Mapping = field(default_factory=dict)   # kind -> fewest greedy tokens compared (else 8)
    split_kinds: tuple | None = None       # kinds split and batched (None: all)
    split_paths: tuple = PATHS
    kv_dtypes: tuple = KV_DTYPES
    thread_kinds: tuple | None = None      # kinds run with several thread counts (None: all, (): none)
    thread_tokens: int = 37
    thread_counts: tuple = (2, 3)
    thread_vocab: int | None = None        # prompt ids below this (None: the model's vocabulary)
    gguf_data: str | None = None           # folder under tests/data of the converter's files
    gguf_kinds: tuple = ()                 # its files (KIND.gguf, KIND.npz)
    gguf_far_from_folder: tuple = ()       # files that must run apart from their folder (npz folder_logits)
    gguf_converted_folder: bool = True     # the folder a file converts to is run in transformers
    gguf_export: bool = True               # fastllm's export equals the converter's file


GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
GEMMA4_FULL_ROTARY = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                      "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0,
                                         "rope_theta": 10000.0}}
NO_WINDOW = dict(sliding_window=None, use_sliding_window=False, layer_types=None)
# The windows of test_sliding_window.py's shapes: greedy decoding must go past them.
SWA_WINDOWS = {"mistral-swa": 5, "mistral-headdim": 19, "qwen2-swa": 6, "qwen3-swa": 17}

FAMILIES = [
    # NoPE layers, Granite's multipliers, OLMo 2's output norms, Seed-OSS's biases and head size,
    # InternLM3's names of the bias switches.
    Family("coverage", kinds=("smollm3-nope", "smollm3", "granite", "olmo2", "seed_oss", "seed_oss-biases",
                              "internlm3"),
           switched_off={"smollm3-nope": (dict(no_rope_layers=[1] * 5),),
                         "smollm3": (dict(no_rope_layers=[1] * 4),),
                         "granite": (dict(embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0),),
                         "seed_oss": (dict(attention_bias=False),),
                         "seed_oss-biases": (dict(attention_out_bias=False, mlp_bias=False),),
                         "internlm3": (dict(attention_bias=False, mlp_bias=False),)},
           thread_vocab=200,
           gguf_data="coverage-gguf", gguf_kinds=("smollm3", "granite", "olmo2", "seed_oss", "internlm3")),
    # Soft-caps that are reached, windows shorter than the prompt, Gemma 3's two RoPEs.
    Family("gemma", kinds=("gemma2", "gemma3-text", "gemma3-wrapper"),
           switched_off={"gemma2": (dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
                                    dict(sliding_window=512)),
                         "gemma3-text": (
                             dict(rope_parameters=dict(GEMMA3_ROPE,
                                                       sliding_attention=GEMMA3_ROPE["full_attention"])),
                             dict(rope_parameters=dict(GEMMA3_ROPE, full_attention={"rope_type": "default",
                                                                                    "rope_theta": 10000.0})),
                             dict(layer_types=["full_attention"] * 5))},
           thread_vocab=256,
           gguf_data="gemma-gguf", gguf_kinds=("gemma2", "gemma3")),
    # Per-layer inputs, shared caches, proportional RoPE; fastllm writes no Gemma 4 GGUF.
    Family("gemma4", kinds=("gemma4-text", "gemma4-wrapper"),
           switched_off={"gemma4-text": (dict(final_logit_softcapping=None), dict(sliding_window=512),
                                         dict(rope_parameters=GEMMA4_FULL_ROTARY))},
           split_kinds=("gemma4-text",), thread_kinds=("gemma4-text",),
           gguf_data="gemma4-gguf", gguf_kinds=("gemma4",), gguf_export=False),
    # YaRN and the query scaling by position, past two steps of the original context.
    Family("ministral3", kinds=("ministral3", "mistral3-wrapper"),
           switched_off={"ministral3": (dict(rope_type="default", type="default"), dict(llama_4_scaling_beta=0.0),
                                        dict(factor=2.0)),
                         "mistral3-wrapper": (dict(mscale=1.0, mscale_all_dim=1.0), dict(llama_4_scaling_beta=0.0),
                                              dict(beta_slow=0.25))},
           edit=with_rope, logits_tokens=70, greedy_tokens=50, thread_tokens=57,
           gguf_data="ministral3-gguf", gguf_kinds=("ministral3", "mistral3-wrapper"),
           # The file holds no mscale: llama.cpp runs the wrapper's with 1, its folder says 1.3.
           gguf_far_from_folder=("mistral3-wrapper",), gguf_converted_folder=False),
    # Mixtures of experts (fastllm writes none to GGUF; their files: test_moe_gguf.py).
    Family("moe", kinds=("qwen3_moe", "qwen3_moe-unnormed", "mixtral", "qwen3_5_moe", "qwen3_5_moe-wrapper"),
           switched_off={"qwen3_moe": (dict(norm_topk_prob=False), dict(num_experts_per_tok=1))},
           greedy_tokens=30,
           split_kinds=("qwen3_moe", "qwen3_moe-unnormed", "mixtral", "qwen3_5_moe"), kv_dtypes=("f32",),
           thread_kinds=("qwen3_moe", "qwen3_5_moe"), thread_counts=(2, 3, 5)),
    # Sliding windows far shorter than the prompts: attending to everything leaves the bound.
    Family("sliding-window", kinds=tuple(SWA_WINDOWS),
           switched_off={kind: (NO_WINDOW,) for kind in SWA_WINDOWS},
           min_greedy={kind: max(8, window + 1) for kind, window in SWA_WINDOWS.items()},
           split_kinds=("mistral-swa", "qwen2-swa", "mistral-headdim"), thread_kinds=()),
]


def _cases(make):
    """pytest.param per (row, ...) tuple that make(row) yields, its id the rest joined by '-'."""
    return [pytest.param(row, *rest, id="-".join(map(str, rest))) for row in FAMILIES for rest in make(row)]


LOGITS = _cases(lambda row: [(kind, path) for kind in row.kinds for path in PATHS])
SPLITS = _cases(lambda row: [(kind, path, kv) for kind in row.split_kinds or row.kinds
                             for path in row.split_paths for kv in row.kv_dtypes])
THREADS = _cases(lambda row: [(kind,) for kind in (row.kinds if row.thread_kinds is None else row.thread_kinds)])
GGUF = _cases(lambda row: [(kind, dtype) for kind in row.gguf_kinds for dtype in ("gguf", "f32")])
CONVERTED = _cases(lambda row: [(kind,) for kind in row.gguf_kinds if row.gguf_converted_folder])
EXPORTED = _cases(lambda row: [(kind,) for kind in row.gguf_kinds if row.gguf_export])


@pytest.fixture(autouse=True)
def _quiet_wrapper_notices():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".* checkpoint: running its text model")
        warnings.filterwarnings("ignore", message=".*RoPE scaling factor")
        yield


@pytest.mark.parametrize("row, kind, path", LOGITS)
def test_logits_and_greedy_match_transformers(row, kind, path, tiny_model_dir, simd_path, tmp_path):
    simd_path(path)
    folder = tiny_model_dir(kind)
    ours, ids, got, ratio = logits_against_transformers(folder, row.logits_tokens, f"{path} {kind}")
    for i, changes in enumerate(row.switched_off.get(kind, ())):
        plain = load_hf(row.edit(folder, tmp_path / f"off{i}", **changes))
        assert not within(got, hf_logits(plain, ids))[0], f"{kind}: {changes} changes nothing"

    want, margins = hf_greedy(load_hf(folder), ids[:7], row.greedy_tokens)
    tokens = list(ours.generate_tokens(ids[:7], row.greedy_tokens, stop_token_ids=()))
    same, compared, diverged = compare_greedy(tokens, want, margins)
    assert same, f"{path} {kind}: token {diverged} differs with margin {margins[diverged]:.3g}"
    least = row.min_greedy.get(kind, 8)
    assert compared >= least, f"{kind}: only {compared} tokens compared, fewer than {least}"
    print(f"{path} {kind}: err/bound {ratio:.3f}, {compared} greedy tokens, "
          f"smallest margin {min(margins[:compared]):.3g}")


@pytest.mark.parametrize("row, kind, path, kv_dtype", SPLITS)
def test_split_or_batched_prompts_give_the_same_bits(row, kind, path, kv_dtype, tiny_model_dir, simd_path):
    """Whole, in chunks of the work buffers, in uneven calls, token by token,
    and beside other sequences in one pass: the same logits, bit for bit."""
    simd_path(path)
    assert_same_bits_however_split(tiny_model_dir(kind), dict(threads=2, kv_dtype=kv_dtype))


@pytest.mark.parametrize("row, kind", THREADS)
def test_thread_counts_give_the_same_bits(row, kind, tiny_model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # more threads than this machine's CPUs
        assert_same_bits_for_thread_counts(tiny_model_dir(kind), row.thread_tokens, row.thread_counts,
                                           vocab=row.thread_vocab)


def _gguf(row, kind):
    return DATA / row.gguf_data / f"{kind}.gguf"


def _reference(row, kind):
    return np.load(DATA / row.gguf_data / f"{kind}.npz")


@pytest.mark.parametrize("row, kind, dtype", GGUF)
def test_llama_cpp_gguf_matches_transformers(row, kind, dtype, fastllm_home):
    """The converter's file, run natively (its own tensors) and through the
    folder it converts to, against transformers on the folder it was made
    from (as llama.cpp runs it, where the file cannot say all the folder says)."""
    data = _reference(row, kind)
    ids = data["ids"].tolist()
    got = Model.from_pretrained(_gguf(row, kind), dtype=dtype, threads=2).logits(ids)
    ok, err, _ = within(got, data["logits"])
    assert ok, f"{kind} {dtype}: max |err| {err:.3g} exceeds the bound"
    if kind in row.gguf_far_from_folder:
        assert not within(got, data["folder_logits"])[0], f"{kind}: the file runs as its folder does"


@pytest.mark.parametrize("row, kind", CONVERTED)
def test_converted_folder_runs_in_transformers(row, kind, tmp_path, fastllm_home):
    """The config.json fastllm writes for the file says to transformers what
    the file says to llama.cpp."""
    data = _reference(row, kind)
    folder = convert_gguf(_gguf(row, kind), tmp_path / kind, progress=False)
    ok, err, _ = within(hf_logits(load_hf(folder), data["ids"].tolist()), data["logits"])
    assert ok, f"{kind}: max |err| {err:.3g}"


@pytest.mark.parametrize("row, kind", EXPORTED)
def test_export_equals_llama_cpp_converter(row, kind, tmp_path, fastllm_home):
    """fastllm convert FOLDER OUT.gguf writes the converter's tensors, bit
    for bit, and its hyperparameters."""
    folder = convert_gguf(_gguf(row, kind), tmp_path / kind, progress=False)
    out = export_gguf(folder, tmp_path / f"{kind}.gguf", "f32")
    want_md, want_tensors = arch_fields_and_tensors(_gguf(row, kind))
    got_md, got_tensors = arch_fields_and_tensors(out)
    assert {k: got_md.get(k) for k in want_md} == want_md
    assert got_tensors.keys() == want_tensors.keys()
    for name, value in want_tensors.items():
        assert np.array_equal(got_tensors[name], value), name
