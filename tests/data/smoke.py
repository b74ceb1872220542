"""Smoke test of an installed fastllm (the wheel test: cibuildwheel runs it
from a temporary folder, so `import fastllm` finds the installed package, not
src/). Loads the tiny model next to this file, generates greedily twice
(the two must agree) and once through the `fastllm` command.

    python tests/data/smoke.py
"""
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE / "tiny-llama"


def main() -> int:
    t0 = time.perf_counter()
    import fastllm
    from fastllm.core import _core
    t_import = time.perf_counter() - t0
    where = Path(fastllm.__file__).resolve()
    print(f"fastllm {fastllm.__version__} from {where.parent}")
    print(f"SIMD path: {_core.simd_path()}; import {t_import * 1000:.0f} ms")
    src = (HERE.parent.parent / "src").resolve()
    if src in where.parents:
        print(f"FAIL: fastllm was imported from the source tree {src}, not an installed wheel")
        return 1

    t0 = time.perf_counter()
    model = fastllm.Model.from_pretrained(MODEL, threads=2)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = model.generate("hello", max_new_tokens=8)
    t_gen = time.perf_counter() - t0
    again = model.generate("hello", max_new_tokens=8)
    # ascii(): random weights make odd characters, and a Windows console
    # or pipe may not be able to encode them.
    print(f"load {t_load * 1000:.0f} ms, 8 tokens {t_gen * 1000:.0f} ms: {ascii(first)}")
    if not first or first != again:
        print(f"FAIL: greedy generation gave {ascii(first)} then {ascii(again)}")
        return 1

    # The console script of the installed wheel (next to this Python).
    exe = Path(sysconfig.get_path("scripts")) / ("fastllm.exe" if os.name == "nt" else "fastllm")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fastllm"]
    # PYTHONIOENCODING: the CLI prints the generated text as is, which a
    # Windows pipe (cp1252) cannot always encode.
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    out = subprocess.run(cmd + ["run", "--model", str(MODEL), "-n", "8", "--threads", "2", "hello"],
                         capture_output=True, text=True, encoding="utf-8", errors="replace", env=env)
    if out.returncode != 0:
        print(f"FAIL: {' '.join(cmd)} run exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
        return 1
    print(f"{Path(cmd[0]).name} run: ok")
    print("smoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
