#!/usr/bin/env bash
# fastllm for aarch64, to run under qemu-user: into DIR go
#   DIR/sysroot  Debian's python3.11 for arm64 and the shared libraries it and
#                the wheels load (apt-get download and dpkg -x; nothing is
#                installed), for qemu-aarch64 -L;
#   DIR/site     the runtime dependencies' aarch64 wheels from PyPI;
#   DIR/pkg      the fastllm package, its extension cythonized here and
#                compiled by aarch64-linux-gnu-gcc with setup.py's flags.
# Run fastllm with
#   qemu-aarch64 -L DIR/sysroot -cpu CPU -E PYTHONPATH=DIR/pkg:DIR/site \
#       DIR/sysroot/usr/bin/python3.11 -S ...
# (-S: no site-packages, so nothing of the host's Python is imported).
# tests/arm64_python.sh and benchmarks/arm64_insn_count.py use it. Needs
# gcc-aarch64-linux-gnu, the arm64 architecture in dpkg (dpkg
# --add-architecture arm64 && apt-get update, as root) and, on the host,
# Python with Cython. From the checkout root:
#
#   bash tests/arm64_sysroot.sh DIR
set -euo pipefail
WORK=${1:?usage: tests/arm64_sysroot.sh DIR}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
cd "$(dirname "$0")/.."
CC=${CC:-aarch64-linux-gnu-gcc}
PY=${PYTHON:-python}

if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    echo "tests/arm64_sysroot.sh needs Debian's arm64 packages: dpkg --add-architecture arm64 && apt-get update" >&2
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
for mod in core/_core tokenizer/_bpe; do
    $PY -m cython -3 -X boundscheck=False -X wraparound=False -I src "src/fastllm/$mod.pyx" -o "$WORK/build/${mod#*/}.c"
done
# shellcheck disable=SC2086
$CC $CFLAGS -Icsrc -I"$WORK/site/numpy/_core/include" -DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION \
    "$WORK/build/_core.c" $(ls csrc/*.c | grep -v /test_) -lm -o "$WORK/pkg/fastllm/core/_core.cpython-311-aarch64-linux-gnu.so" \
    2> "$WORK/build.log" || { cat "$WORK/build.log"; exit 1; }
# shellcheck disable=SC2086
$CC $CFLAGS "$WORK/build/_bpe.c" -o "$WORK/pkg/fastllm/tokenizer/_bpe.cpython-311-aarch64-linux-gnu.so"

