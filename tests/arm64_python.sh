#!/usr/bin/env bash
# fastllm end to end on aarch64, under emulation: the package cross-built for
# aarch64 runs the default model in Debian's python3.11 for arm64 under
# qemu-user, on the portable path and on each aarch64 path as the CPU level
# chooses it:
#   generic      neoverse-n1, FASTLLM_SIMD=generic: the reference, on 2 threads
#                (the slowest run; its bits are those of 1 thread)
#   neon         cortex-a72   (NEON only)
#   dotprod      neoverse-n1  (+ SDOT), and again with 2 threads
#   i8mm         max          (+ SMMLA, BF16, SVE)
# tests/arm64_e2e.py says what each run saves and the bounds it is held to.
#
# tests/arm64_sysroot.sh makes the aarch64 Python and package. Needs
# qemu-user, gcc-aarch64-linux-gnu, the arm64 architecture in dpkg (dpkg
# --add-architecture arm64 && apt-get update, as root) and, on the host,
# Python with numpy and Cython. From the checkout root, optionally naming the
# GGUF file (default: the default model's):
#
#   bash tests/arm64_python.sh [MODEL.gguf]
#
# About 10 minutes of CPU time; each run is bounded by ARM64_TIMEOUT seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
TIMEOUT=${ARM64_TIMEOUT:-900}
PY=${PYTHON:-python}
WORK=$(mktemp -d /tmp/fastllm-arm64-python.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
MODEL=${1:-$($PY -c "from fastllm.load.hub import default_gguf_path; print(default_gguf_path())")}

bash tests/arm64_sysroot.sh "$WORK"
SYSROOT=$WORK/sysroot

echo "== the default model on each path ($MODEL)"
guest() {   # CPU, name of the run, SIMD path, threads, then qemu's -E settings
    local cpu=$1 name=$2 path=$3 threads=$4
    shift 4
    timeout "$TIMEOUT" qemu-aarch64 -L "$SYSROOT" -cpu "$cpu" -E PYTHONPATH="$WORK/pkg:$WORK/site" "$@" \
        "$SYSROOT/usr/bin/python3.11" -S tests/arm64_e2e.py run "$path" "$MODEL" "$WORK/$name.npz" --threads "$threads" \
        > "$WORK/$name.log" 2>&1 || { echo "FAIL $name:"; tail -n 20 "$WORK/$name.log"; return 1; }
}
pids=()
guest neoverse-n1 generic generic 2 -E FASTLLM_SIMD=generic & pids+=($!)
guest cortex-a72 neon neon 1 & pids+=($!)
guest neoverse-n1 dotprod dotprod 1 & pids+=($!)
guest max i8mm i8mm 1 & pids+=($!)
guest neoverse-n1 dotprod-2threads dotprod 2 & pids+=($!)
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
[ $status = 0 ] || exit 1
cat "$WORK"/generic.log
$PY tests/arm64_e2e.py compare "$WORK/generic.npz" "$WORK/neon.npz" "$WORK/dotprod.npz" "$WORK/i8mm.npz" \
    "$WORK/dotprod-2threads.npz"
