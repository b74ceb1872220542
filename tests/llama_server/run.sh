#!/usr/bin/env bash
# llama.cpp's own server tests against `fastllm serve` (fastllm_launcher.py
# says how its settings are translated). The tests come from the
# llama-cpp-python sdist on PyPI, which vendors llama.cpp's source: fetched
# here, checked against its SHA-256, and never kept in this repository.
#
#   bash tests/llama_server/run.sh               # the files below; known failures skipped
#   bash tests/llama_server/run.sh --all FILE..  # every test of FILEs, failures counted, not skipped
#
# LLAMA_CPP_SDIST=path uses an sdist already here. The tests' own
# requirements beyond the test extras are none: utils' wget (fetching models
# from the hub, which never happens here) is stood in for by the launcher.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
FILES=(test_chat_completion.py test_completion.py test_tool_call.py test_security.py test_ignore_eos.py
       test_tokenize.py test_compat_anthropic.py test_compat_oai_responses.py test_embedding.py)
ALL=0
if [ "${1:-}" = "--all" ]; then ALL=1; shift; fi
if [ $# -gt 0 ]; then FILES=("$@"); fi

WORK="$(mktemp -d /tmp/fastllm-llama-server-tests.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
SDIST="${LLAMA_CPP_SDIST:-$WORK/llama_cpp_python-$VERSION.tar.gz}"
if [ ! -f "$SDIST" ]; then
    python3 - "$SDIST" "$VERSION" <<'PY'
# The file's address comes from the package index's simple page (PEP 503),
# as pip finds it: PyPI's /packages/source/ shortcut is not served everywhere.
import html, re, sys, urllib.request
out, version = sys.argv[1], sys.argv[2]
index = "https://pypi.org/simple/llama-cpp-python/"
name = f"llama_cpp_python-{version}.tar.gz"
page = urllib.request.urlopen(index, timeout=60).read().decode()
links = [html.unescape(h) for h in re.findall(r'href="([^"]+)"', page)]
urls = [u.split("#")[0] for u in links if u.split("#")[0].endswith("/" + name)]
if not urls:
    sys.exit(f"{index} lists no {name}")
urllib.request.urlretrieve(urllib.request.urljoin(index, urls[0]), out)
PY
fi
echo "$SHA256  $SDIST" | sha256sum -c --quiet
SRC="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$SDIST" -C "$WORK" "$SRC/tools/server/tests" "$SRC/models/templates"
cd "$WORK/$SRC/tools/server/tests"
UNIT=()
for f in "${FILES[@]}"; do UNIT+=("unit/$f"); done
if [ "$ALL" = 0 ]; then export FASTLLM_PEER_KNOWN="$HERE/known_failures.txt"; fi
# -m "not slow": llama.cpp's slow tests each fetch a real model (Llama 3.1
# 8B, Qwen2.5 7B, ...) from the hub, none of which is here.
PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -p fastllm_launcher -p no:cacheprovider \
    -m "not slow" -q -rs --durations=5 "${UNIT[@]}"
