"""The HTTP fuzz target's inputs drawn at random instead of by atheris:
no coverage feedback and no instrumentation, so about twice as many
requests a second, and it goes on past findings. Each distinct finding (by
its first line and innermost frame) is printed with the input that found
it, and appended to OUT as a JSON line; the input replays through
fuzz_http.TestOneInput. Exits 1 if anything was found.

    python tests/fuzz/random_http.py INPUTS [OUT.jsonl]

FASTLLM_FUZZ_SEED fixes the random inputs (printed when it is not set);
fuzz_http.py's environment variables (the progress log, known findings,
LIMIT) apply too.
"""
import json
import os
import random
import re
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_http  # noqa: E402


def restart_engines(h):
    """New engines and apps after a finding that may have left one stuck;
    the old ones are closed in the background, as one may never stop."""
    if h.bystander is not None:
        h.bystander.running = False
    for served in h.served:
        threading.Thread(target=served.close, daemon=True).start()
    h.start()


def finding_key(text: str) -> str:
    key = re.sub(r"\d+", "N", text.splitlines()[0].split(":")[0].split(" (")[0])
    frames = [line for line in text.splitlines() if line.startswith("  File")]
    return key + (frames[-1] if frames else "")   # the innermost frame tells exceptions apart


def run(inputs: int, out=None) -> int:
    seed = int(os.environ.get("FASTLLM_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    h, seen, found = fuzz_http.harness(), set(), 0
    while h.count < inputs:
        data = rng.randbytes(rng.choice([16, 64, 256, 1024]))
        try:
            h.run_one(data)
        except fuzz_http.Finding as f:
            found += 1
            text = str(f).encode("utf-8", "backslashreplace").decode()
            if finding_key(text) not in seen:
                seen.add(finding_key(text))
                print(f"--- finding {len(seen)} after {h.count} inputs (input {data.hex()})\n{text}\n", flush=True)
                if out:
                    with open(out, "a") as f:
                        f.write(json.dumps({"input": data.hex(), "finding": text}) + "\n")
            if "no answer" in text or "still has" in text or "/health" in text:
                restart_engines(h)
    took = time.monotonic() - h.started_at
    print(f"{h.count} inputs in {took:.0f} s ({h.count / took:.0f}/s): {found} findings, {len(seen)} distinct, "
          f"{h.known} known; statuses {dict(sorted(h.statuses.items(), key=str))}; "
          f"RSS {fuzz_http.rss_mb():.0f} MB")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(run(int(float(sys.argv[1])), sys.argv[2] if len(sys.argv) > 2 else None))
