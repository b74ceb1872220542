#!/usr/bin/env bash
# fastllm's C core under AddressSanitizer and UndefinedBehaviorSanitizer:
#   1. csrc/test_core.c on every SIMD path this CPU has, LeakSanitizer on;
#   2. the extension built with both sanitizers into a scratch folder, and a
#      reduced pytest run against it: the C test, the tiny checkpoints of every
#      family on every SIMD path, the API's boundary checks and the 16-bit KV
#      cache (Python itself is not instrumented, so leaks are not checked here).
# Any report stops the run with a non-zero status. From the checkout root, in
# an environment with the test extras:
#
#   bash tests/sanitize.sh          # CC=clang to use clang's sanitizers
#
# .ci/run calls it after the main test run; about 3 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CC=${CC:-gcc}
WORK=$(mktemp -d /tmp/fastllm-sanitize.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

# The core's sources: every csrc/*.c but the tests, as setup.py takes them.
CORE=$(ls csrc/*.c | grep -v '^csrc/test_')

echo "== C test under ASan+UBSan+LSan"
$CC $SAN -g -O1 -fopenmp $CORE csrc/test_core.c -lm -o "$WORK/test_core"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 "$WORK/test_core" | tail -n 1

echo "== extension under ASan+UBSan"
mkdir -p "$WORK/lib"
cp -r src/fastllm "$WORK/lib/"
find "$WORK/lib" \( -name '*.so' -o -name '*.c' -o -name '__pycache__' \) -prune -exec rm -rf {} +
CC=$CC CFLAGS="$SAN" LDFLAGS="$SAN" python setup.py -q build_ext --build-lib "$WORK/lib" \
  --build-temp "$WORK/build" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
# The interpreter is not built with ASan: its runtime must come first.
PRELOAD="$($CC -print-file-name=libasan.so) $($CC -print-file-name=libubsan.so)"
cd "$WORK"   # so that neither the checkout's src/ nor an installed fastllm is imported
ln -s "$ROOT/tests" tests
ln -s "$ROOT/oracles" oracles
export LD_PRELOAD="$PRELOAD" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_odr_violation=0
export PYTHONPATH="$WORK/lib:$WORK"
python - <<'EOF'
import fastllm.core._core as core
assert core.__file__.startswith("/tmp/fastllm-sanitize."), f"not the sanitized build: {core.__file__}"
print("testing", core.__file__, "on", core.simd_path())
EOF
python -m pytest -q -p no:cacheprovider --disable-warnings -m "not slow" \
  tests/test_c_core.py tests/test_tiny_models.py tests/test_api.py tests/test_kv_cache.py
