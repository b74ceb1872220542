"""Instructions per 32-weight block of the aarch64 int8 kernels, from the
disassembly, beside llama.cpp's ggml_vec_dot_* for the same features.

No ARM hardware is needed: each kernel's tile (quant_arm64.c's qrows for one
type, feature level and number of tokens) is compiled by the cross compiler
into a function of its own, and the innermost loop that holds its integer
dot products is counted (one loop pass: one 32-k block of 4 rows for NT
tokens). llama.cpp's arch/arm/quants.c is compiled for the same levels and
its ggml_vec_dot_q4_0_q8_0, q8_0_q8_0 and q4_K_q8_K loops counted the same
way (with i8mm, its SMMLA loop for 2 rows x 2 tokens). A static count says nothing of
latency, dependencies or memory; it is a count of work, not a speed.

    python benchmarks/arm64_block_instructions.py [LLAMA_CPP_DIR]
"""
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CC = "aarch64-linux-gnu-gcc"
CSRC = Path(__file__).resolve().parents[1] / "csrc"
LLAMA = Path(sys.argv[1] if len(sys.argv) > 1 else
             "/work/scratch/llama/llama_cpp_python-0.3.36/vendor/llama.cpp")
DOTS = ("sdot", "smmla", "smull")

# name: (target macro, level suffix, type, tokens)
TILES = {f"{t}_{lvl}_{nt}": (tgt, lvl, f"FLM_{t.upper()}", nt)
         for t in ("q4_0", "q8_0", "q4_k", "q6_k")
         for lvl, tgt, nts in (("neon", "NEON", (1, 4)), ("dotprod", "DOTPROD", (1, 2, 4)), ("i8mm", "I8MM", (2, 4)))
         for nt in nts}


def loops(obj, want=DOTS):
    """{function: (instructions, dot instructions by kind) of its smallest
    loop holding one of `want`}."""
    dis = subprocess.run(["aarch64-linux-gnu-objdump", "-d", obj], capture_output=True, text=True, check=True).stdout
    found = {}
    for chunk in re.split(r"\n(?=[0-9a-f]+ <)", dis):
        head = re.match(r"[0-9a-f]+ <(\w+)>:", chunk)
        if not head:
            continue
        ins = [line for line in chunk.split("\n")[1:] if re.match(r"\s+[0-9a-f]+:", line)]
        at = [int(line.split(":")[0], 16) for line in ins]
        op = [line.split("\t")[2] if len(line.split("\t")) > 2 else "" for line in ins]
        best = None
        for i, line in enumerate(ins):
            branch = re.search(r"\t(?:b\.\w+|b|cbnz|cbz|tbnz|tbz)\t(?:\w+, )?(?:#\w+, )?([0-9a-f]+) <", line)
            if branch and int(branch.group(1), 16) < at[i]:
                body = [o for a, o in zip(at, op) if int(branch.group(1), 16) <= a <= at[i]]
                if any(o.startswith(want) for o in body) and (best is None or len(body) < best[0]):
                    best = (len(body), {d: sum(o.startswith(d) for o in body) for d in DOTS})
        if best:
            found[head.group(1)] = best
    return found


def main():
    work = Path(tempfile.mkdtemp(prefix="fastllm-arm64-count."))
    src = ['#include "quant_arm64.c"']
    for name, (tgt, lvl, ty, nt) in TILES.items():
        src.append(f"{tgt} void {name}(float *o, int ldo, const FlmQ8 *x, int lda, const uint8_t *pp, int K, "
                   f"int rows, const FlmQuantType *L) {{ qrows_{lvl}(o, ldo, x, lda, pp, K, {ty}, {nt}, 0, rows, L); }}")
    (work / "tiles.c").write_text("\n".join(src) + "\n")
    subprocess.run([CC, "-O3", "-ffp-contract=off", "-std=gnu11", f"-iquote{CSRC}", "-c", str(work / "tiles.c"),
                    "-o", str(work / "tiles.o")], check=True)
    ours = loops(work / "tiles.o")
    print("fastllm (quant_arm64.c), instructions per 32 weights of one row for one token:")
    print(f"  {'tile':<18} {'loop':>5} {'per block':>9}")
    for name, (_, _, _, nt) in TILES.items():
        if name in ours:
            print(f"  {name:<18} {ours[name][0]:>5} {ours[name][0] / (4 * nt):>9.1f}")
        else:
            print(f"  {name:<18}     -   (no single loop found)")
    ggml = LLAMA / "ggml"
    quants = ggml / "src/ggml-cpu/arch/arm/quants.c"
    if not quants.exists():
        print(f"llama.cpp not found at {LLAMA}")
        return
    print("llama.cpp (arch/arm/quants.c), the same count:")
    for lvl, march in (("neon", "armv8-a"), ("dotprod", "armv8.2-a+dotprod"), ("i8mm", "armv8.6-a+dotprod+i8mm")):
        obj = work / f"llama_{lvl}.o"
        subprocess.run([CC, "-O3", f"-march={march}", "-DNDEBUG", f"-I{ggml}/include", f"-I{ggml}/src",
                        f"-I{ggml}/src/ggml-cpu", "-c", str(quants), "-o", str(obj)], check=True)
        theirs = loops(obj, ("smmla",) if lvl == "i8mm" else DOTS)
        for fn in ("ggml_vec_dot_q4_0_q8_0", "ggml_vec_dot_q8_0_q8_0", "ggml_vec_dot_q4_K_q8_K"):
            if fn not in theirs:
                continue
            n, dots = theirs[fn]
            # Row-token blocks of 32 per loop pass: a Q4_K pass is a superblock
            # (8 blocks; 2 rows x 2 tokens with SMMLA); a Q4_0/Q8_0 block takes
            # 2 SDOT, 4 SMULL, or (2 rows x 2 tokens) 4 SMMLA.
            if "q4_K" in fn:
                blocks = 8 * (4 if dots["smmla"] else 1)
            else:
                blocks = dots["smmla"] if dots["smmla"] else dots["sdot"] / 2 if dots["sdot"] else dots["smull"] / 4
            print(f"  {lvl:<8} {fn:<24} {n:>5} {n / blocks:>9.1f}")

if __name__ == "__main__":
    main()
