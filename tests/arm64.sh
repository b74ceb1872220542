#!/usr/bin/env bash
# fastllm's C core on aarch64, under emulation: csrc/test_core.c cross-built
# and run by qemu-user on three CPU levels, each checking every path its
# features allow against the portable one (int8 bit for bit, float within
# the bound, batched, one-token and threaded runs bit for bit):
#   cortex-a72   NEON only                      neon
#   neoverse-n1  + dotprod                      neon, dotprod
#   max          + i8mm, BF16 (and SVE)         neon, dotprod, i8mm, neon_bf16
# Needs Debian's qemu-user, gcc-aarch64-linux-gnu and libc6-dev-arm64-cross.
# From the checkout root (about 3 minutes on 3 cores; each CPU level is
# bounded by ARM64_TIMEOUT seconds):
#
#   bash tests/arm64.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CC=${CC:-aarch64-linux-gnu-gcc}
TIMEOUT=${ARM64_TIMEOUT:-900}
WORK=$(mktemp -d /tmp/fastllm-arm64.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# Static, so qemu needs no aarch64 sysroot at run time (libgomp included).
# setup.py's -ffp-contract=off, at -O2: Debian's GCC 12 cross compiler
# fails inside its vectorizer on test_core.c at -O3.
# The core's sources: every csrc/*.c but the tests, as setup.py takes them.
CORE=$(ls csrc/*.c | grep -v '^csrc/test_')
$CC -O2 -ffp-contract=off -std=gnu11 -Wall -Werror -fopenmp -static -Icsrc $CORE csrc/test_core.c \
    -lm -o "$WORK/test_core" 2> "$WORK/build.log" ||
    { cat "$WORK/build.log"; exit 1; }

status=0
for cpu in cortex-a72 neoverse-n1 max; do
    timeout "$TIMEOUT" qemu-aarch64 -cpu "$cpu" "$WORK/test_core" > "$WORK/$cpu.log" 2>&1 &
done
for cpu in cortex-a72 neoverse-n1 max; do
    wait -n || true
done
for cpu in cortex-a72 neoverse-n1 max; do
    paths=$(grep -oE '^ok  [a-z0-9_]+ +wtype=' "$WORK/$cpu.log" | awk '{print $2}' | sort -u | tr '\n' ' ')
    if tail -n 1 "$WORK/$cpu.log" | grep -qx "all passed"; then
        echo "ok   $cpu: $(head -n 1 "$WORK/$cpu.log"); paths run: $paths"
    else
        echo "FAIL $cpu:"
        grep -v '^ok\|^    kv_type' "$WORK/$cpu.log" | tail -n 20
        status=1
    fi
done
exit $status
