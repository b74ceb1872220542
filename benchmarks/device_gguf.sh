#!/usr/bin/env bash
# Quantized GGUF files on a many-core test machine without network: fastllm
# and llama.cpp side by side (perf_targets.py's speed part) at several thread
# counts, in one go of at most DEV_SECONDS (default 540) of wall time. From
# the checkout root:
#
#   bash benchmarks/device_gguf.sh          # results into $OUT (default: ./gguf-out)
#
# Needs .devbench/ with tok/ laid out beforehand and carried along, as
# device_run.sh does (see the top of that script).
#
# Phases, each printed with its time: machine summary; llama.cpp (shared
# libraries) and the extension built natively in the background while a
# random-weight checkpoint of DEV_SHAPE (mkmodel.py: 135m, 360m, 1.7b;
# default 1.7b) is made and converted to a BF16 GGUF by llama.cpp's
# converter; DEV_QUANTS (default Q4_K_M,Q8_0) made from it by llama-quantize;
# then perf_targets.py --parts speed on those files at DEV_THREADS (default
# 4,8,16), pp DEV_PP (512) and tg DEV_TG (64), DEV_REPS (2) repetitions,
# each rep's figures logged as they come, so that a run cut short by the
# budget keeps what it measured. DEV_LLAMA_NO_AMX=1 runs llama.cpp without
# its AMX kernels (for machines that report AMX but fault on it).
set -u
T0=$(date +%s)
BUDGET=${DEV_SECONDS:-540}
OUT=${OUT:-$PWD/gguf-out}
T=${TMPDIR:-$(python3 -c "import tempfile; print(tempfile.gettempdir())")}
SHAPE=${DEV_SHAPE:-1.7b}
QUANTS=${DEV_QUANTS:-Q4_K_M,Q8_0}
mkdir -p "$OUT"

phase() { echo "=== $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s: $*" >&2; }

phase "machine"
lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)|L3 cache)' >&2
echo "SIMD: $(grep -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|avx512_fp16|amx_bf16|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ')" >&2
free -g | head -2 >&2

if [ ! -d .devbench/llama.cpp ] || [ ! -f .devbench/tok/tokenizer.json ]; then
  echo "missing .devbench/ or .devbench/tok/tokenizer.json: lay them out first (see device_run.sh)" >&2
  exit 1
fi
export PYTHONPATH=$PWD/src:$PWD/.devbench/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}
LL=$T/llroot   # perf_targets.py wants llama.cpp's tree with its build in build/bin
mkdir -p "$LL"
ln -sfn "$PWD/.devbench/llama.cpp/include" "$LL/include"
ln -sfn "$PWD/.devbench/llama.cpp/ggml" "$LL/ggml"

phase "build (background) while making the checkpoint and its BF16 GGUF"
(
  [ -x "$LL/build/bin/llama-quantize" ] && [ -x "$LL/build/bin/llama-bench" ] && exit 0   # built by an earlier run
  cd .devbench/llama.cpp && cmake -B "$LL/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$OUT/build.log" 2>&1 \
    && cmake --build "$LL/build" -j"$(nproc)" --target llama-bench llama-quantize >>"$OUT/build.log" 2>&1
) &
LLB=$!
python3 setup.py build_ext --inplace -j "$(nproc)" >"$OUT/ext.log" 2>&1 || { tail -30 "$OUT/ext.log" >&2; exit 1; }
M=$T/dev-$SHAPE
[ -f "$M/model.safetensors" ] || python3 .devbench/mkmodel.py "$M" "$SHAPE" .devbench/tok >&2 || exit 1
[ -f "$M-BF16.gguf" ] || python3 .devbench/llama.cpp/convert_hf_to_gguf.py "$M" --outtype bf16 \
  --outfile "$M-BF16.gguf" >"$OUT/convert.log" 2>&1 || { tail -20 "$OUT/convert.log" >&2; exit 1; }
phase "waiting for llama.cpp's build"
wait $LLB || { tail -30 "$OUT/build.log" >&2; exit 1; }
FILES=()
for q in ${QUANTS//,/ }; do
  f=$M-$q.gguf
  [ -f "$f" ] || "$LL/build/bin/llama-quantize" "$M-BF16.gguf" "$f" "$q" "$(nproc)" >"$OUT/quantize-$q.log" 2>&1 \
    || { tail -20 "$OUT/quantize-$q.log" >&2; exit 1; }
  FILES+=("$f")
done
ls -l "${FILES[@]}" >&2

LEFT=$(( T0 + BUDGET - $(date +%s) - 5 ))
phase "speed, at most $LEFT s: ${FILES[*]##*/} at ${DEV_THREADS:-4,8,16} threads"
timeout "$LEFT" python3 benchmarks/perf_targets.py "${FILES[@]}" --llama-cpp "$LL" \
  --threads "${DEV_THREADS:-4,8,16}" --pp "${DEV_PP:-512}" --tg "${DEV_TG:-64}" --reps "${DEV_REPS:-2}" \
  --parts speed ${DEV_LLAMA_NO_AMX:+--llama-no-amx} --home "$T/fastllm-home" --json "$OUT/speed.json" >"$OUT/speed.md" 2>"$OUT/speed.log"
echo "perf_targets exit $?" >&2
cat "$OUT/speed.log" "$OUT/speed.md" >&2
phase "done"
