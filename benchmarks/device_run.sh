#!/usr/bin/env bash
# The scaling run for a 16-core test machine without network, in one go of at
# most SCALE_SECONDS (default 560) of wall time. From the checkout root:
#
#   bash benchmarks/device_run.sh        # results into $OUT (default: ./scale-out)
#
# Needs, laid out beforehand in the checkout and carried along (git ignores it):
#   .devbench/     ../shared/device-bench/prepare.sh .devbench  (llama.cpp source,
#                  its converter and gguf-py, build.sh)
#   .devbench/tok/ tokenizer.json and tokenizer_config.json of SmolLM2 (e.g. from
#                  fastllm's converted default model in $FASTLLM_HOME)
#
# Phases, each printed with its time: machine summary; llama.cpp and the
# extension built natively (build.sh, in the background) while the random
# checkpoints and GGUF files are made; then scale.py runs, most important
# first, each given the time left minus what the later ones need:
#   0. the C core alone (benchmarks/kernels_run.sh): C test, matmul speed, profile
#   1. SmolLM2-1.7B shape, bf16 and f32, fastllm vs llama.cpp, 4/8/16 threads, pp512 tg64
#   2. transformers, 1.7B bf16, 16 threads, pp512
#   3. SmolLM2-135M shape, f32 and bf16, fastllm vs llama.cpp, 1/2/4/8/16 threads
#   4. pp4096, 1.7B bf16, 16 threads, llama.cpp with flash attention on, then fastllm
# Every case is written to $OUT as it finishes, so a run stopped early keeps
# what it measured.
#
# SCALE_ARGS, when set, replaces phases 1-4 by one scale.py run with these
# arguments (a quick check of the whole path on a small machine), and
# SCALE_PREP the shapes prepared while building (default 1.7b,135m).
set -u
T0=$(date +%s)
BUDGET=${SCALE_SECONDS:-560}
OUT=${OUT:-$PWD/scale-out}
T=${TMPDIR:-$(python3 -c "import tempfile; print(tempfile.gettempdir())")}
CACHE=$T/fastllm-scale-cache
mkdir -p "$OUT" "$CACHE"

phase() { echo "=== $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s: $*" >&2; }
# Seconds left until the end of the budget, keeping $1 seconds for later phases.
left() { echo $(( T0 + BUDGET - $(date +%s) - ${1:-0} )); }

phase "machine"
lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)|L3 cache)' >&2
echo "SIMD: $(grep -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|avx512_fp16|amx_bf16|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ')" >&2
free -g | head -2 >&2
python3 -c "import sys, torch, transformers, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)" >&2

if [ ! -f .devbench/build.sh ] || [ ! -f .devbench/tok/tokenizer.json ]; then
  echo "missing .devbench/ or .devbench/tok/tokenizer.json: lay them out first (see the top of $0)" >&2
  exit 1
fi
export PYTHONPATH=$PWD/src:$PWD/.devbench/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}

phase "build (background) while making checkpoints and GGUF files"
bash .devbench/build.sh .devbench >"$OUT/build.log" 2>&1 &
BUILD=$!
python3 benchmarks/scale.py --prepare-only --shapes "${SCALE_PREP:-1.7b,135m}" --dtypes f32,bf16 \
  --cache "$CACHE" --out "$OUT" --tokenizer .devbench/tok || exit 1
phase "checkpoints and GGUF files ready; waiting for the build"
wait $BUILD
cat "$OUT/build.log" >&2
LB=$T/llb/bin/llama-bench
python3 -c "import fastllm.core._core" || { echo "the fastllm extension did not build" >&2; exit 1; }
[ -x "$LB" ] || echo "no llama-bench at $LB: llama.cpp is left out" >&2

# The C core alone, before the engines side by side (benchmarks/kernels_run.sh).
if [ -z "${SCALE_ARGS:-}" ] && [ -z "${SKIP_KERNELS:-}" ]; then
  phase "kernels: C test, matmul speed, per-phase profile (at most ${KERNEL_SECONDS:-200} s)"
  timeout "${KERNEL_SECONDS:-200}" bash benchmarks/kernels_run.sh "$T/fastllm-kernels" >"$OUT/kernels.txt" 2>&1
  cat "$OUT/kernels.txt" >&2
fi

scale() {  # scale NAME RESERVE ARGS...: one scale.py run, keeping RESERVE s for later phases
  local name=$1 reserve=$2; shift 2
  phase "$name (budget $(left "$reserve") s)"
  python3 benchmarks/scale.py --cache "$CACHE" --out "$OUT" --tokenizer .devbench/tok \
    --llama-bench "$LB" --time-budget "$(left "$reserve")" "$@" >"$OUT/scale-$name.log"
}
if [ -n "${SCALE_ARGS:-}" ]; then
  # shellcheck disable=SC2086  # split into arguments on purpose
  scale quick 5 $SCALE_ARGS
else
  scale 1.7b 170 --shapes 1.7b --dtypes bf16,f32 --threads 4,8,16 --engines fastllm,llama.cpp \
    --pp 512 --tg 64 --reps 1
  scale transformers 150 --shapes 1.7b --dtypes bf16 --threads 16 --engines transformers \
    --pp 512 --tg 0 --reps 2
  scale 135m 70 --shapes 135m --dtypes f32,bf16 --threads 1,2,4,8,16 --engines fastllm,llama.cpp \
    --pp 512 --tg 64 --reps 2
  scale long-prompt 0 --shapes 1.7b --dtypes bf16 --threads 16 --engines llama.cpp,fastllm \
    --pp 0 --tg 0 --long-pp 4096 --reps 1
fi
phase "done"
cat "$OUT/scale.md"
