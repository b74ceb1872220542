#!/usr/bin/env python
"""fastllm against llama-bench on a Qwen3.5-2B-shaped random checkpoint.

    python benchmarks/qwen35_speed.py WORK --llama-cpp DIR [--threads 1,2] [--pp 512] [--tg 128] [--reps 5]
        [--mixes q4_k_m,q8_0] [--fastllm-from gguf|folder]

makes, once, in WORK: the checkpoint (`2b/`: Qwen3.5-2B's shape - hidden
2048, 24 layers, three Gated DeltaNet layers to one gated full-attention
layer, 16 key and 16 value heads of 128 in the linear layers, 8 query heads
of 256 and 2 KV heads, intermediate 6144, the Qwen3.5 vocabulary of 248,320
rows, tied - with random bf16 weights, as scale.py writes them, and the
Qwen3.5 tokenizer rebuilt by oracles/qwen_tokenizers.py), its BF16 GGUF by
llama.cpp's own converter (DIR/convert_hf_to_gguf.py, gguf-py from DIR),
and from that the files of the mixes asked for (Q4_K_M and Q8_0 unless
--mixes says otherwise; Q5_K_M and Q6_K too) by DIR/build/bin/llama-quantize
(`bf16` times the BF16 file itself; fastllm's bf16 matmuls multiply float32
activations unless FASTLLM_SIMD=avx512_bf16 is set, which rounds them to
bf16 as llama.cpp's BF16 path does).
Then it times both engines as gguf_speed.py does: per repetition one run
of each (mix, threads) case per engine, each in a process of its own, the
engine that goes first alternating; medians and their ratio.

llama.cpp always runs the GGUF file. fastllm runs the same file
(`--fastllm-from gguf`), or the checkpoint folder quantized at load under
its own mix of the same name (`--fastllm-from folder`; its types per tensor
follow llama-quantize's rules, see fastllm.formats.quants.plan, so the
bytes a token reads are close to the file's but not the same).
"""
from __future__ import annotations

import argparse
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

# Qwen3.5-2B's text model (the MTP layer left out: neither engine runs it).
SHAPE = dict(
    architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=248320, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, tie_word_embeddings=True,
    max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", attn_output_gate=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    bos_token_id=None, eos_token_id=248046, torch_dtype="bfloat16")
MIXES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q8_0": "Q8_0", "bf16": "BF16"}


def run(cmd, log: Path, env=None) -> None:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    with open(log, "w") as f:
        r = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}), see {log}")


def prepare(work: Path, llama_cpp: Path, mixes: list) -> dict:
    """{mix: GGUF file}, with the checkpoint folder at work/2b."""
    folder = work / "2b"
    if not (folder / "model.safetensors").exists():
        from oracles import qwen_tokenizers
        tok = qwen_tokenizers.build("qwen3.5", work / "tokenizer")
        tmp = work / "2b.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(SHAPE, indent=1))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok / f, tmp / f)
        run([sys.executable, HERE / "scale_worker.py", "checkpoint", tmp], work / "make-2b.log")
        tmp.rename(folder)
    bf16 = work / "2b-BF16.gguf"
    if not bf16.exists():
        env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
        run([sys.executable, llama_cpp / "convert_hf_to_gguf.py", folder, "--outtype", "bf16",
             "--no-mtp", "--outfile", str(bf16) + ".tmp"], work / "convert-2b.log", env=env)
        os.rename(str(bf16) + ".tmp", bf16)
    files = {}
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    env = dict(os.environ, LD_LIBRARY_PATH=str(quantize.parent))
    for mix in mixes:
        out = work / f"2b-{MIXES[mix]}.gguf"
        if not out.exists():
            run([quantize, bf16, str(out) + ".tmp", MIXES[mix]], work / f"quantize-{mix}.log", env=env)
            os.rename(str(out) + ".tmp", out)
        files[mix] = out
    return files


def tensor_types(path: Path) -> dict:
    """{GGML type: [tensor name patterns]} of a GGUF file, layer numbers folded."""
    import re

    import gguf
    got = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        name = re.sub(r"blk\.\d+\.", "blk.N.", t.name)
        got.setdefault(t.tensor_type.name, set()).add(name)
    return {k: sorted(v) for k, v in got.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", type=Path)
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, built in build/")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mixes", default="q4_k_m,q8_0")
    p.add_argument("--fastllm-from", choices=("gguf", "folder"), default="gguf")
    p.add_argument("--prepare-only", action="store_true", help="make the files, list their tensor types, stop")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    mixes = args.mixes.split(",")
    if unknown := [m for m in mixes if m not in MIXES]:
        p.error(f"unknown mixes {unknown}; known: {', '.join(MIXES)}")
    files = prepare(args.work, args.llama_cpp, mixes)
    if args.prepare_only:
        for mix, path in files.items():
            print(f"{path.name}: " + json.dumps(tensor_types(path), indent=1))
        return 0
    bench = args.llama_cpp / "build" / "bin" / "llama-bench"
    os.environ["LD_LIBRARY_PATH"] = str(bench.parent)
    threads = [int(t) for t in args.threads.split(",")]
    exe = membw.build()
    runs, bw = {}, {t: [] for t in threads}
    for rep in range(args.reps):
        for t in threads:
            bw[t].append(membw.measure(exe, t))
        engines = gguf_speed.ENGINES if rep % 2 == 0 else gguf_speed.ENGINES[::-1]
        for mix in mixes:
            source, dtype = (files[mix], "gguf") if args.fastllm_from == "gguf" else (args.work / "2b", mix)
            for t in threads:
                for engine in engines:
                    if engine == "fastllm":
                        f, _ = gguf_speed.fastllm_run(source, t, args.pp, args.tg, dtype=dtype)
                    else:
                        f = gguf_speed.llama_run(str(bench), files[mix], t, args.pp, args.tg)
                    runs.setdefault((mix, t, engine), []).append(f)
                print(f"rep {rep + 1}/{args.reps} ({engines[0]} first) {mix} t={t}, load average "
                      f"{os.getloadavg()[0]:.1f}: "
                      + ", ".join(f"{e} {runs[(mix, t, e)][-1]}" for e in gguf_speed.ENGINES),
                      file=sys.stderr, flush=True)
    print(f"\nmedians of {args.reps} interleaved runs, tokens/s; fastllm from the "
          f"{'GGUF file' if args.fastllm_from == 'gguf' else 'checkpoint folder quantized at load'}; "
          "bandwidth (membw, median): " + ", ".join(f"{t} threads {statistics.median(bw[t]):.1f} GB/s"
                                                     for t in threads))
    print(f"| file | threads | pp{args.pp} fastllm / llama.cpp | ratio | tg{args.tg} fastllm / llama.cpp | ratio |")
    print("|---|---|---|---|---|---|")
    for mix in mixes:
        for t in threads:
            med = {e: {k: statistics.median(r[k] for r in runs[(mix, t, e)]) for k in runs[(mix, t, e)][0]}
                   for e in gguf_speed.ENGINES}
            pp, tg = f"pp{args.pp}", f"tg{args.tg}"
            print(f"| {files[mix].name} | {t} | {med['fastllm'][pp]:.1f} / {med['llama.cpp'][pp]:.1f} | "
                  f"{med['fastllm'][pp] / med['llama.cpp'][pp]:.2f} | {med['fastllm'][tg]:.2f} / "
                  f"{med['llama.cpp'][tg]:.2f} | {med['fastllm'][tg] / med['llama.cpp'][tg]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
