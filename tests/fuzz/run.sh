#!/usr/bin/env bash
# run.sh SECONDS: every tests/fuzz/fuzz_*.py for SECONDS each, coverage-guided
# (atheris), each on a scratch copy of its seed corpus so the committed one
# stays small. Fails on any finding: a crash, an uncaught exception, a
# timeout (10 s for one input) or memory past 2 GB; the input that did it is
# kept under the scratch folder that is printed.
set -euo pipefail
SECONDS_EACH="${1:?usage: run.sh SECONDS}"
HERE="$(cd "$(dirname "$0")" && pwd)"
SCRATCH="$(mktemp -d /tmp/fastllm-fuzz.XXXXXX)"
failed=()
for target in "$HERE"/fuzz_*.py; do
    name="$(basename "$target" .py)"
    name="${name#fuzz_}"
    mkdir -p "$SCRATCH/$name/corpus" "$SCRATCH/$name/findings"
    if [ -d "$HERE/corpus/$name" ]; then
        cp -r "$HERE/corpus/$name/." "$SCRATCH/$name/corpus/"
    fi
    dict=()
    if [ -f "$HERE/dicts/$name.dict" ]; then
        dict=(-dict="$HERE/dicts/$name.dict")   # values worth trying (huge counts)
    fi
    echo "== $name: ${SECONDS_EACH}s"
    if ! python "$target" "$SCRATCH/$name/corpus" -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 \
            -timeout=10 -artifact_prefix="$SCRATCH/$name/findings/" -print_final_stats=1 "${dict[@]}" \
            > "$SCRATCH/$name/log" 2>&1; then
        tail -n 40 "$SCRATCH/$name/log"
        failed+=("$name")
    else
        grep -E "^stat::number_of_executed_units|^Done" "$SCRATCH/$name/log" || true
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzzing found problems in: ${failed[*]} (inputs under $SCRATCH/*/findings)" >&2
    exit 1
fi
rm -rf "$SCRATCH"
