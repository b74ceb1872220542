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
# The sysroot is made of Debian's arm64 packages (apt-get download, no
# install) and the runtime dependencies' aarch64 wheels from PyPI; the
# extension is cythonized here and compiled by aarch64-linux-gnu-gcc with
# setup.py's flags. Needs qemu-user, gcc-aarch64-linux-gnu, the arm64
# architecture in dpkg (dpkg --add-architecture arm64 && apt-get update, as
# root) and, on the host, Python with numpy and Cython. From the checkout root,
# optionally naming the GGUF file (default: the default model's):
#
#   bash tests/arm64_python.sh [MODEL.gguf]
#
# About 10 minutes of CPU time; each run is bounded by ARM64_TIMEOUT seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
CC=${CC:-aarch64-linux-gnu-gcc}
TIMEOUT=${ARM64_TIMEOUT:-900}
PY=${PYTHON:-python}
WORK=$(mktemp -d /tmp/fastllm-arm64-python.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
MODEL=${1:-$($PY -c "from fastllm.hub import default_gguf_path; print(default_gguf_path())")}

if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    echo "tests/arm64_python.sh needs Debian's arm64 packages: dpkg --add-architecture arm64 && apt-get update" >&2
    exit 1
fi

echo "== sysroot: Debian's python3.11 for arm64, and the dependencies' aarch64 wheels"
SYSROOT=$WORK/sysroot
mkdir -p "$WORK/debs" "$SYSROOT"
# python3.11 and the shared libraries it and the wheels load (libgomp for
# OpenMP, libstdc++ for numpy).
(cd "$WORK/debs" && apt-get download -qq python3.11-minimal:arm64 libpython3.11-minimal:arm64 \
    libpython3.11-stdlib:arm64 libpython3.11-dev:arm64 libc6:arm64 libexpat1:arm64 zlib1g:arm64 libffi8:arm64 \
    libbz2-1.0:arm64 liblzma5:arm64 libssl3:arm64 libuuid1:arm64 libgcc-s1:arm64 libgomp1:arm64 \
    libstdc++6:arm64 2>&1 | grep -v "unsandboxed" || true)
for deb in "$WORK"/debs/*.deb; do dpkg -x "$deb" "$SYSROOT"; done
DEPS=$($PY -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
# shellcheck disable=SC2086
$PY -m pip install -q --target "$WORK/site" --only-binary=:all: --implementation cp --python-version 3.11 \
    --abi cp311 --platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 \
    --platform manylinux_2_34_aarch64 $DEPS

echo "== fastllm for aarch64"
mkdir -p "$WORK/build" "$WORK/pkg"
cp -r src/fastllm "$WORK/pkg/"
find "$WORK/pkg" \( -name '*.so' -o -name '*.c' -o -name '__pycache__' \) -prune -exec rm -rf {} +
# setup.py's Cython directives and compiler flags, after those Python's own
# build adds (-fwrapv -fno-strict-aliasing -DNDEBUG).
CFLAGS="-shared -fPIC -DNDEBUG -fwrapv -fno-strict-aliasing -O3 -g0 -fno-fast-math -ffp-contract=off -std=gnu11
        -fopenmp -I$SYSROOT/usr/include -I$SYSROOT/usr/include/python3.11"
for mod in _core _bpe; do
    $PY -m cython -3 -X boundscheck=False -X wraparound=False -I src "src/fastllm/$mod.pyx" -o "$WORK/build/$mod.c"
done
# shellcheck disable=SC2086
$CC $CFLAGS -Icsrc -I"$WORK/site/numpy/_core/include" -DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION \
    "$WORK/build/_core.c" $(ls csrc/*.c | grep -v /test_) -lm -o "$WORK/pkg/fastllm/_core.cpython-311-aarch64-linux-gnu.so" \
    2> "$WORK/build.log" || { cat "$WORK/build.log"; exit 1; }
# shellcheck disable=SC2086
$CC $CFLAGS "$WORK/build/_bpe.c" -o "$WORK/pkg/fastllm/_bpe.cpython-311-aarch64-linux-gnu.so"

echo "== the default model on each path ($MODEL)"
# -S: no site-packages, so nothing of the host's Python is imported.
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
