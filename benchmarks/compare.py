#!/usr/bin/env python
"""fastllm, llama.cpp and transformers side by side, llama-bench style.

pp N: one forward pass over an N-token prompt from an empty cache.
tg N: N single-token decode steps from an empty cache.

All engines run in one process on the same weights at the same precision
and thread count. For each (dtype, threads, test) every engine gets one
warm-up run, then the repetitions are interleaved so that noise from other
load on the machine hits all of them alike, and the engine that goes first
rotates from one repetition to the next (fastllm, llama.cpp, transformers;
then llama.cpp, transformers, fastllm; ...), so that none always finds the
caches and the CPU's clock in the state another left. Medians are compared
as ratios.

Before each repetition, membw.c measures the memory read bandwidth at the
thread count under test (see membw.py: the fastest of 5 reads of a 1 GiB
buffer by t OpenMP threads, each summing the slice it first wrote); the
report gives the median of those readings and the ceiling it sets for
generation, which reads every weight once per token.

llama.cpp reads GGUF files made by its own quantizer from the source GGUF
(F32 and BF16), and the script checks that every tensor in them equals the
one fastllm loads from the model folder, bit for bit (bf16 included, since
both round float32 to nearest-even).

    python benchmarks/compare.py                      # -p 512 -n 128 -t 1,2 -r 5
    python benchmarks/compare.py -p 32 -n 8 -r 1 -t 1 --dtype f32,bf16 --json out.json
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import membw

ENGINES = ("fastllm", "llama.cpp", "transformers")
DTYPES = ("f32", "bf16")
GGUF_TAG = {"f32": "F32", "bf16": "BF16"}
BYTES_PER_WEIGHT = {"f32": 4, "bf16": 2}
# Idle OpenMP workers of the engine that just ran spin for a while before
# they sleep; a short pause keeps them off the cores the next engine times.
SETTLE_S = 0.05


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Machine and versions


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name, module in (("fastllm", "fastllm"), ("llama-cpp-python", "llama_cpp"),
                         ("torch", "torch"), ("transformers", "transformers"),
                         ("numpy", "numpy"), ("gguf", "gguf")):
        try:
            from importlib.metadata import version
            out[name] = version(name)
        except Exception:
            try:
                out[name] = __import__(module).__version__
            except Exception:
                out[name] = "not installed"
    return out


# --------------------------------------------------------------------------
# Timing statistics


def summarize(speeds: list) -> dict:
    return {
        "runs": speeds,
        "median": statistics.median(speeds),
        "mean": statistics.mean(speeds),
        "sd": statistics.stdev(speeds) if len(speeds) > 1 else 0.0,
    }


# --------------------------------------------------------------------------
# fastllm


class FastllmRunner:
    name = "fastllm"

    def __init__(self, folder: Path, dtype: str, n_ctx: int):
        from fastllm import Model
        self.model = Model.from_pretrained(folder, n_ctx=n_ctx, threads=1, dtype=dtype)
        self.session = self.model.new_session()
        self.info = f"KV cache f32, n_ctx {n_ctx}"

    def set_threads(self, t: int) -> None:
        self.model.threads = t

    # The same calls as fastllm.cli.bench.bench_model; that function brings a
    # warm-up run with each call, which the interleaving cannot afford.
    def pp(self, tokens: np.ndarray) -> float:
        self.session.reset()
        t0 = time.perf_counter()
        self.session.extend(tokens)
        return time.perf_counter() - t0

    def tg(self, tokens: np.ndarray) -> float:
        self.session.reset()
        step = self.session.step
        t0 = time.perf_counter()
        for token in tokens:
            step(token)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.model = self.session = None


# --------------------------------------------------------------------------
# llama.cpp


class LlamaLog:
    """Keeps llama.cpp's log lines instead of printing them; they are shown
    only when something fails."""

    def __init__(self, llama_cpp):
        self.lines = []

        def keep(level, text, user_data):
            self.lines.append(text.decode("utf-8", errors="replace") if text else "")

        # The ctypes callback must outlive every llama.cpp call.
        self._callback = llama_cpp.llama_log_callback(keep)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def tail(self, n: int = 15) -> str:
        return "".join(self.lines[-n:]).rstrip()

    def last_matching(self, needle: str):
        for line in reversed(self.lines):
            if needle in line:
                return line.strip()
        return None


class _ThreadpoolParams(ctypes.Structure):
    # struct ggml_threadpool_params, ggml.h (GGML_MAX_N_THREADS = 512)
    _fields_ = [
        ("cpumask", ctypes.c_bool * 512),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


class GgmlThreadpools:
    """Persistent ggml thread pools as llama-bench attaches them (polling
    level 50). Without one, ggml starts and joins its threads for every
    graph, which llama-bench does not measure."""

    POLL = 50

    def __init__(self, llama_cpp):
        libdir = Path(llama_cpp.__file__).parent / "lib"
        base = ctypes.CDLL(str(libdir / "libggml-base.so"))
        cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"))
        self.llama = llama_cpp.llama_cpp._lib
        self._default = base.ggml_threadpool_params_default
        self._default.argtypes, self._default.restype = [ctypes.c_int], _ThreadpoolParams
        self._new = cpu.ggml_threadpool_new
        self._new.argtypes, self._new.restype = [ctypes.POINTER(_ThreadpoolParams)], ctypes.c_void_p
        self._free = cpu.ggml_threadpool_free
        self._free.argtypes, self._free.restype = [ctypes.c_void_p], None
        self._attach = self.llama.llama_attach_threadpool
        self._attach.argtypes, self._attach.restype = [ctypes.c_void_p] * 3, None
        self._detach = self.llama.llama_detach_threadpool
        self._detach.argtypes, self._detach.restype = [ctypes.c_void_p], None
        # A layout that disagrees with this build's header would show here.
        probe = self._default(3)
        if probe.n_threads != 3 or probe.poll != 50 or probe.paused:
            raise RuntimeError("ggml_threadpool_params layout differs from this script's")

    def new(self, n_threads: int):
        params = self._default(n_threads)
        params.poll = self.POLL
        pool = self._new(ctypes.byref(params))
        if not pool:
            raise RuntimeError(f"ggml_threadpool_new({n_threads}) failed")
        return pool

    def attach(self, ctx, pool) -> None:
        self._attach(ctx, pool, None)

    def detach(self, ctx) -> None:
        self._detach(ctx)

    def free(self, pool) -> None:
        self._free(pool)


class LlamaRunner:
    name = "llama.cpp"

    def __init__(self, llama_cpp, llama_log, pools, gguf_path: Path, n_prompt: int, n_gen: int,
                 flash_attn: str, kv_type: str):
        L = self.L = llama_cpp
        self.log = llama_log
        self.pools = pools
        self.pool = None
        self.ctx = self.model = None
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(gguf_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}:\n{llama_log.tail()}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = max(n_prompt + n_gen, 1)
        # One ubatch holds the whole prompt, so pp is a single forward pass.
        cparams.n_batch = cparams.n_ubatch = max(n_prompt, 1)
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = 1
        cparams.flash_attn_type = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO,
                                   "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                   "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
        ggml_type = {"f32": 0, "f16": 1}[kv_type]  # GGML_TYPE_F32, GGML_TYPE_F16
        cparams.type_k = cparams.type_v = ggml_type
        mark = len(llama_log.lines)
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context:\n{llama_log.tail()}")
        fa_line = next((ln for ln in llama_log.lines[mark:] if "Flash Attention" in ln), None)
        fa = flash_attn
        if fa_line:
            fa += " -> " + ("enabled" if "enabled" in fa_line else "disabled")
        self.info = (f"flash_attn {fa}, KV {kv_type}, n_ctx {L.llama_n_ctx(self.ctx)}, "
                     f"n_batch = n_ubatch = {cparams.n_ubatch}, "
                     + (f"persistent ggml threadpool (poll {pools.POLL})" if pools
                        else "ggml threads started per graph"))
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(max(n_prompt, 1), 0, 1)
        self.one = L.llama_batch_init(1, 0, 1)
        self.one.n_tokens = 1
        self.one.n_seq_id[0] = 1
        self.one.seq_id[0][0] = 0
        self.one.logits[0] = 1

    def set_threads(self, t: int) -> None:
        if self.pools:
            if self.pool:
                self.pools.detach(self.ctx)
                self.pools.free(self.pool)
            self.pool = self.pools.new(t)
            self.pools.attach(self.ctx, self.pool)
        self.L.llama_set_n_threads(self.ctx, t, t)

    def _decode(self, batch) -> None:
        rc = self.L.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}:\n{self.log.tail()}")

    def pp(self, tokens: np.ndarray) -> float:
        n = len(tokens)
        b = self.batch
        for i in range(n):
            b.token[i] = int(tokens[i])
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 0
        b.logits[n - 1] = 1  # logits of the last token only, as fastllm computes
        b.n_tokens = n
        self.L.llama_memory_clear(self.memory, True)
        t0 = time.perf_counter()
        self._decode(b)
        self.L.llama_synchronize(self.ctx)
        return time.perf_counter() - t0

    def tg(self, tokens: np.ndarray) -> float:
        L, ctx, one = self.L, self.ctx, self.one
        ids = [int(x) for x in tokens]
        L.llama_memory_clear(self.memory, True)
        t0 = time.perf_counter()
        for i, tok in enumerate(ids):
            one.token[0] = tok
            one.pos[0] = i
            self._decode(one)
            L.llama_synchronize(ctx)
        return time.perf_counter() - t0

    def close(self) -> None:
        L = self.L
        if self.ctx:
            if self.pool:
                self.pools.detach(self.ctx)
            L.llama_batch_free(self.batch)
            L.llama_batch_free(self.one)
            L.llama_free(self.ctx)
            self.ctx = None
        if self.pool:
            self.pools.free(self.pool)
            self.pool = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None


# --------------------------------------------------------------------------
# transformers


class TransformersRunner:
    name = "transformers"

    def __init__(self, folder: Path, dtype: str):
        import inspect

        import torch
        import transformers
        from transformers import AutoModelForCausalLM, DynamicCache
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.DynamicCache = DynamicCache
        torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype)
        self.model.eval()
        # transformers 5 renamed past_key_values to cache.
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        attn = getattr(self.model.config, "_attn_implementation", "?")
        self.info = (f"{type(self.model).__name__}, attention {attn}, "
                     f"{torch_dtype} weights, "
                     "DynamicCache, logits_to_keep=1")

    def set_threads(self, t: int) -> None:
        self.torch.set_num_threads(t)

    def pp(self, tokens: np.ndarray) -> float:
        torch = self.torch
        ids = torch.from_numpy(tokens.astype(np.int64)).view(1, -1)
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            return time.perf_counter() - t0

    def tg(self, tokens: np.ndarray) -> float:
        torch = self.torch
        ids = torch.from_numpy(tokens.astype(np.int64)).view(1, -1)
        steps = [ids[:, i:i + 1] for i in range(ids.shape[1])]
        with torch.inference_mode():
            cache = self.DynamicCache(config=self.model.config)
            kw = {self.cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
            t0 = time.perf_counter()
            for step in steps:
                self.model(input_ids=step, **kw)
            return time.perf_counter() - t0

    def close(self) -> None:
        self.model = None


# --------------------------------------------------------------------------
# GGUF files for llama.cpp


def verify_gguf(gguf_path: Path, folder: Path, dtype: str) -> str:
    """Check every tensor of a llama.cpp GGUF against the model folder as
    fastllm loads it: float32 values, or for bf16 the nearest-even bf16 bits
    fastllm computes. Returns a one-line summary; raises on a difference."""
    import gguf
    from fastllm.spec.config import ModelConfig
    from fastllm.formats.gguf_tensors import gguf_names, unpermute
    from fastllm.formats.safetensors import Checkpoint, f32_to_bf16

    cfg = ModelConfig.from_file(folder / "config.json")
    ck = Checkpoint(folder)
    reader = gguf.GGUFReader(str(gguf_path))
    names = gguf_names(cfg)
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
    seen, permuted, skipped, as_bf16 = set(), 0, [], 0
    for t in reader.tensors:
        if t.name not in names:
            skipped.append(t.name)  # e.g. rope_freqs: baked into config.json
            continue
        hf, tensor, _ = names[t.name]
        if hf not in ck:
            raise ValueError(f"{gguf_path.name}: {t.name} has no counterpart {hf} in {folder}")
        ref = ck.file_of(hf).float32(hf)
        ttype = t.tensor_type.name
        if ttype == "F32":
            got = np.asarray(t.data).reshape(ref.shape)
            want = ref
        elif ttype == "BF16":
            got = np.asarray(t.data).view(np.uint16).reshape(ref.shape)
            want = f32_to_bf16(ref)
            as_bf16 += 1
        else:
            raise ValueError(f"{gguf_path.name}: {t.name} is {ttype}, expected F32 or BF16")
        if not np.array_equal(got, want):
            if tensor.rope in heads and np.array_equal(unpermute(got, heads[tensor.rope]), want):
                permuted += 1
            else:
                diff = np.count_nonzero(got != want)
                raise ValueError(f"{gguf_path.name}: {t.name} differs from {hf} in {folder} "
                                 f"({diff} of {got.size} values)")
        seen.add(hf)
    missing = [n for n in ck.where if n not in seen
               and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise ValueError(f"{gguf_path.name} lacks {len(missing)} tensors of {folder}, "
                         f"e.g. {missing[0]}")
    note = f"{len(seen)} tensors identical"
    if dtype == "bf16":
        note += f" ({as_bf16} as bf16, same nearest-even rounding as fastllm)"
    if permuted:
        note += f", {permuted} Q/K in llama.cpp's rope row order"
    if skipped:
        note += f", not compared: {', '.join(skipped)}"
    return note


def _file_id(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def prepare_gguf(llama_cpp, llama_log, source: Path, dtype: str, work: Path, folder: Path,
                 verify: bool) -> tuple:
    """The source GGUF converted by llama.cpp's quantizer to dtype, made once
    into work/ and reused while the source and llama-cpp-python are the same."""
    tag = GGUF_TAG[dtype]
    out = work / f"{source.stem}.{tag}.gguf"
    stamp_path = work / f"{source.stem}.{tag}.json"
    want = {"source": _file_id(source), "ftype": tag,
            "llama_cpp": getattr(llama_cpp, "__version__", "?")}
    stamp = None
    if out.exists() and stamp_path.exists():
        try:
            stamp = json.loads(stamp_path.read_text())
        except (OSError, json.JSONDecodeError):
            stamp = None
    if not stamp or stamp.get("made") != want or stamp.get("output") != _file_id(out):
        work.mkdir(parents=True, exist_ok=True)
        log(f"making {out} with llama.cpp's quantizer ...")
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32,
                        "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16}[dtype]
        params.allow_requantize = True  # the source is quantized (Q4_1, Q8_0)
        params.nthread = usable_cpus()
        try:
            rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(),
                                                ctypes.byref(params))
            if rc != 0:
                raise RuntimeError(f"llama_model_quantize returned {rc}:\n{llama_log.tail()}")
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                tmp.unlink()
        stamp = {"made": want, "output": _file_id(out)}
        stamp_path.write_text(json.dumps(stamp, indent=1))
    check = "not checked (--no-verify)"
    if verify:
        against = {"folder": str(folder.resolve()),
                   "files": [_file_id(p) for p in sorted(folder.glob("*.safetensors"))]}
        if stamp.get("verified") == against:
            check = stamp["verified_note"]
        else:
            log(f"checking {out.name} against {folder} ...")
            check = verify_gguf(out, folder, dtype)
            stamp.update(verified=against, verified_note=check)
            stamp_path.write_text(json.dumps(stamp, indent=1))
    return out, check


# --------------------------------------------------------------------------
# The run


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="fastllm vs llama.cpp vs transformers, llama-bench style, in one run")
    p.add_argument("-m", "--model", default=None,
                   help="HF model folder for fastllm and transformers (default: "
                        "SmolLM2-135M-Instruct, converted by fastllm from its GGUF)")
    p.add_argument("--gguf", default=None,
                   help="GGUF the llama.cpp files are made from "
                        "(default: the default model's GGUF)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (0 skips pp)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (0 skips tg)")
    p.add_argument("-t", "--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs after one warm-up")
    p.add_argument("--dtype", default="f32,bf16", help="comma-separated: f32,bf16")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of "
                   + ",".join(ENGINES))
    p.add_argument("--transformers-bf16", action="store_true",
                   help="also time transformers in bf16 (off by default: torch's CPU bf16 path "
                        "is not what people run)")
    p.add_argument("--llama-flash-attn", choices=("auto", "on", "off"), default="auto",
                   help="llama.cpp flash attention (llama-bench default: auto)")
    p.add_argument("--llama-kv", choices=("f16", "f32"), default="f16",
                   help="llama.cpp KV cache type (llama-bench default: f16)")
    p.add_argument("--work", default=None,
                   help="folder for the llama.cpp GGUF files (default: $FASTLLM_HOME/bench)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking the llama.cpp weights against the model folder")
    p.add_argument("--bw-mib", type=int, default=1024, help="buffer size of the bandwidth test")
    p.add_argument("--json", default=None, metavar="FILE", help="also save the raw numbers here")
    args = p.parse_args(argv)

    def split(text):
        return [x.strip() for x in str(text).split(",") if x.strip()]

    try:
        args.threads = [int(x) for x in split(args.threads)]
    except ValueError:
        p.error(f"--threads wants comma-separated integers, got {args.threads!r}")
    args.dtypes = split(args.dtype)
    args.engines = split(args.engines)
    if not args.threads or min(args.threads) < 1:
        p.error("thread counts must be positive")
    if not args.dtypes or any(d not in DTYPES for d in args.dtypes):
        p.error(f"--dtype wants a subset of {','.join(DTYPES)}")
    if not args.engines or any(e not in ENGINES for e in args.engines):
        p.error(f"--engines wants a subset of {','.join(ENGINES)}")
    if args.repetitions < 1:
        p.error("repetitions must be at least 1")
    if args.n_prompt < 0 or args.n_gen < 0 or args.n_prompt + args.n_gen == 0:
        p.error("-p and -n must not be negative, and not both 0")
    if args.bw_mib < 1:
        p.error("--bw-mib must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from fastllm.core import _core
    from fastllm.load.hub import cache_dir, default_gguf_path, default_model_dir

    command = shlex.join(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
    folder = Path(args.model) if args.model else default_model_dir()
    if not (folder / "config.json").exists():
        raise SystemExit(f"{folder} is not a HF model folder (no config.json)")
    work = Path(args.work) if args.work else cache_dir() / "bench"
    vers = versions()
    notes = []

    # Engines that cannot be imported are left out with a note, so that the
    # script still compares what is installed.
    llama_cpp = llama_log = pools = None
    if "llama.cpp" in args.engines:
        try:
            import llama_cpp
        except ImportError as e:
            notes.append(f"llama.cpp left out: {e}")
        else:
            llama_log = LlamaLog(llama_cpp)
            llama_cpp.llama_backend_init()
            try:
                pools = GgmlThreadpools(llama_cpp)
            except (OSError, AttributeError, RuntimeError) as e:
                notes.append(f"llama.cpp runs without a persistent threadpool: {e}")
    want_tf = "transformers" in args.engines
    if want_tf:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            notes.append(f"transformers left out: {e}")
            want_tf = False

    ggufs = {}
    if llama_cpp is not None:
        source = Path(args.gguf) if args.gguf else (None if args.model else default_gguf_path())
        if source is None:
            raise SystemExit("with --model, name the GGUF for llama.cpp with --gguf "
                             "(or leave llama.cpp out with --engines)")
        for dtype in args.dtypes:
            try:
                ggufs[dtype] = prepare_gguf(llama_cpp, llama_log, source, dtype, work, folder,
                                            not args.no_verify)
            except ValueError as e:
                raise SystemExit(f"llama.cpp would see other weights than fastllm: {e}\n"
                                 "(--no-verify compares them anyway)")

    from fastllm.spec.config import ModelConfig
    config = ModelConfig.from_file(folder / "config.json")
    n_params = config.n_params()
    n_ctx = max(args.n_prompt, args.n_gen, 1)
    tests = [(k, n) for k, n in (("pp", args.n_prompt), ("tg", args.n_gen)) if n > 0]

    header = [
        "# fastllm vs llama.cpp vs transformers",
        "",
        f"command: `{command}`",
        "",
        f"- CPU: {cpu_model()} ({os.cpu_count()} logical CPUs, {usable_cpus()} usable); "
        f"fastllm SIMD path: {_core.simd_path()}",
    ]
    if llama_cpp is not None:
        header.append("- llama.cpp CPU features: "
                      + llama_cpp.llama_print_system_info().decode().strip().rstrip("|").strip())
    header += [
        "- versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
        f"- model: {folder} ({n_params:,} parameters, tied embeddings counted once)",
        f"- tests: {', '.join(f'{k}{n}' for k, n in tests)}; threads {args.threads}; "
        f"dtypes {args.dtypes}; {args.repetitions} repetition"
        f"{'s' if args.repetitions != 1 else ''} after 1 warm-up, "
        "engines interleaved per repetition, the first rotating; same random token ids for every engine",
    ]
    for dtype, (path, check) in ggufs.items():
        header.append(f"- llama.cpp {dtype}: {path} (made by llama_model_quantize from "
                      f"{Path(args.gguf) if args.gguf else default_gguf_path()}); "
                      f"weights vs {folder.name}: {check}")
    print("\n".join(header))
    sys.stdout.flush()

    bandwidth = {}   # threads -> GB/s readings, one before each repetition
    try:
        membw_exe = membw.build()
    except (OSError, subprocess.CalledProcessError) as e:
        membw_exe = None
        notes.append(f"bandwidth not measured: membw.c did not build ({getattr(e, 'stderr', e)})")

    results = []     # one dict per (engine, dtype, threads, test)
    settings = {}    # engine/dtype -> description
    for dtype in args.dtypes:
        runners = []
        try:
            if "fastllm" in args.engines:
                runners.append(FastllmRunner(folder, dtype, n_ctx))
            if llama_cpp is not None:
                runners.append(LlamaRunner(llama_cpp, llama_log, pools, ggufs[dtype][0],
                                           args.n_prompt, args.n_gen, args.llama_flash_attn,
                                           args.llama_kv))
            if want_tf and (dtype == "f32" or args.transformers_bf16):
                runners.append(TransformersRunner(folder, dtype))
            for r in runners:
                settings[f"{r.name} {dtype}"] = r.info
            tokens = np.random.default_rng(0).integers(0, config.vocab_size,
                                                       max(args.n_prompt, args.n_gen))
            tokens = tokens.astype(np.int32)
            for t in args.threads:
                for r in runners:
                    r.set_threads(t)
                for test, n in tests:
                    toks = tokens[:n]
                    speeds = {r.name: [] for r in runners}
                    for rep in range(args.repetitions + 1):   # rep 0 is the warm-up
                        if rep and membw_exe is not None:
                            bandwidth.setdefault(t, []).append(membw.measure(membw_exe, t, args.bw_mib))
                        first = rep % len(runners)
                        for r in runners[first:] + runners[:first]:
                            time.sleep(SETTLE_S)
                            dt = r.pp(toks) if test == "pp" else r.tg(toks)
                            if rep:
                                speeds[r.name].append(n / dt)
                    line = []
                    for r in runners:
                        row = {"engine": r.name, "dtype": dtype, "threads": t,
                               "test": f"{test}{n}", **summarize(speeds[r.name])}
                        results.append(row)
                        line.append(f"{r.name} {row['median']:.2f}")
                    log(f"[{dtype} t={t} {test}{n}] median t/s: " + ", ".join(line))
        finally:
            for r in runners:
                r.close()
            del runners
            gc.collect()

    print_report(args, results, bandwidth, n_params, settings, notes)
    if args.json:
        out = {
            "command": command, "cpu": cpu_model(), "logical_cpus": os.cpu_count(),
            "usable_cpus": usable_cpus(), "simd": _core.simd_path(), "versions": vers,
            "model": str(folder), "n_params": n_params,
            "llama_cpp_gguf": {d: {"path": str(p), "check": c} for d, (p, c) in ggufs.items()},
            "settings": settings, "notes": notes,
            "n_prompt": args.n_prompt, "n_gen": args.n_gen, "repetitions": args.repetitions,
            "bandwidth_gb_per_s": {str(t): b for t, b in bandwidth.items()},
            "bandwidth_buffer_bytes": args.bw_mib * 1024 * 1024,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"\nraw numbers: {args.json}")
    return 0


def print_report(args, results, bandwidth, n_params, settings, notes) -> None:
    def find(engine, dtype, t, test):
        for r in results:
            if (r["engine"], r["dtype"], r["threads"], r["test"]) == (engine, dtype, t, test):
                return r
        return None

    print("\n## Engine settings\n")
    for key, info in settings.items():
        print(f"- {key}: {info}")
    for note in notes:
        print(f"- note: {note}")

    print("\n## Tokens per second\n")
    print("| dtype | threads | test | engine | t/s median | t/s mean ± sd |")
    print("|---|---:|---|---|---:|---:|")
    for r in results:
        print(f"| {r['dtype']} | {r['threads']} | {r['test']} | {r['engine']} | "
              f"{r['median']:.2f} | {r['mean']:.2f} ± {r['sd']:.2f} |")

    print("\n## Ratios of medians (above 1: fastllm is faster)\n")
    print("| dtype | threads | test | fastllm / llama.cpp | fastllm / transformers |")
    print("|---|---:|---|---:|---:|")
    keys = []
    for r in results:
        k = (r["dtype"], r["threads"], r["test"])
        if k not in keys:
            keys.append(k)
    for dtype, t, test in keys:
        ours = find("fastllm", dtype, t, test)
        cells = []
        for other in ("llama.cpp", "transformers"):
            theirs = find(other, dtype, t, test)
            cells.append(f"{ours['median'] / theirs['median']:.2f}" if ours and theirs else "—")
        print(f"| {dtype} | {t} | {test} | {cells[0]} | {cells[1]} |")

    if not bandwidth:
        return
    print("\n## Memory bandwidth and the generation ceiling\n")
    print(f"Read bandwidth: membw.c, the fastest of 5 reads of a {args.bw_mib} MiB buffer by t OpenMP "
          f"threads, measured before each repetition; median (and range) of those readings. "
          f"Ceiling = bandwidth / weight bytes per token "
          f"({n_params:,} parameters × 4 B for f32, × 2 B for bf16).\n")
    for t, readings in bandwidth.items():
        bw = statistics.median(readings) * 1e9
        print(f"- {t} thread{'s' if t > 1 else ''}: {bw / 1e9:.2f} GB/s "
              f"({min(readings):.2f}-{max(readings):.2f}, {len(readings)} readings)")
        for dtype in args.dtypes:
            per_token = n_params * BYTES_PER_WEIGHT[dtype]
            ceiling = bw / per_token
            parts = [f"  - {dtype}: ceiling {ceiling:.1f} t/s ({per_token / 1e6:.1f} MB/token)"]
            for engine in ("fastllm", "llama.cpp"):
                row = find(engine, dtype, t, f"tg{args.n_gen}") if args.n_gen else None
                if row:
                    parts.append(f"{engine} tg{args.n_gen} {row['median']:.1f} t/s = "
                                 f"{100 * row['median'] / ceiling:.0f}%")
            print("; ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
