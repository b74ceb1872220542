#!/usr/bin/env bash
# The C core alone on this machine, no Python: the C test on every SIMD path
# the CPU has (AMX included where it has it), matmul GFLOP/s per core and
# decode GB/s for the 1.7B shapes at 1 thread and all threads, and the run
# loop's per-phase profile (forward_speed) at all threads. About two
# minutes on 16 cores. From the checkout root:
#
#   bash benchmarks/kernels_run.sh [BUILD_DIR]
set -u
KB=${1:-${TMPDIR:-/tmp}/fastllm-kernels}
mkdir -p "$KB"
CORE=$(ls csrc/*.c | grep -v '^csrc/test_')   # every csrc/*.c but the tests, as setup.py takes them
cc -O2 -fopenmp $CORE csrc/test_core.c -lm -o "$KB/test_core" &
cc -O2 -fopenmp -Icsrc $CORE benchmarks/gemm_speed.c -lm -o "$KB/gemm_speed" &
cc -O2 -fopenmp -Icsrc $CORE benchmarks/forward_speed.c -lm -o "$KB/forward_speed" &
wait
NT=$(nproc)
stamp() { echo "--- $(date +%H:%M:%S) $*"; }

stamp "C test"
timeout 60 "$KB/test_core" | grep -v "^ok  \|kv_type=.: err"
for cfg in "f32 avx512" "bf16 avx512" "bf16 avx512_bf16" "bf16 amx_bf16"; do
  set -- $cfg
  stamp "gemm_speed $cfg"
  timeout 30 "$KB/gemm_speed" 1 "$2" "$1" 512 1.7B
  timeout 30 "$KB/gemm_speed" "$NT" "$2" "$1" 0 1.7B
done
for cfg in "bf16 avx512" "bf16 avx512_bf16" "bf16 amx_bf16" "f32 avx512"; do
  set -- $cfg
  stamp "forward_speed 1.7b $cfg"
  timeout 60 "$KB/forward_speed" 1.7b "$1" "$NT" 512 32 "$2"
done
stamp "long prompt, 16-bit KV cache"
FS_REPS=1 timeout 60 "$KB/forward_speed" 1.7b bf16 "$NT" 4096 0 amx_bf16 f32
FS_REPS=1 timeout 60 "$KB/forward_speed" 1.7b bf16 "$NT" 4096 0 amx_bf16 f16
stamp "135m: libgomp's default spin, then fastllm's"
timeout 30 "$KB/forward_speed" 135m f32 "$NT" 512 64 avx512
GOMP_SPINCOUNT=3000 timeout 30 "$KB/forward_speed" 135m f32 "$NT" 512 64 avx512
stamp done
