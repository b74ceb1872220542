"""What every fuzz target shares: fastllm imported from this checkout and
instrumented for atheris when it is there (the replay tests run without)."""
import os
import sys
import warnings

import glob

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A checkout built in place (setup.py build_ext --inplace) is fuzzed as it
# is; elsewhere (an unpacked sdist in CI) the installed fastllm is.
if glob.glob(os.path.join(ROOT, "src", "fastllm", "core", "_core*.so")) and os.path.join(ROOT, "src") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "src"))
warnings.simplefilter("ignore")   # a fuzzed config may warn (a multimodal wrapper): not a finding

atheris = None
if os.path.basename(sys.argv[0]).startswith("fuzz_"):   # run as a fuzzer, not replayed by pytest
    import atheris


def instrumented():
    """A context manager that instruments the imports inside it when fuzzing."""
    if atheris is None:
        import contextlib
        return contextlib.nullcontext()
    return atheris.instrument_imports()


def main(test_one_input, instrument_all=False):
    """Fuzzes test_one_input with the libFuzzer options of the command line.
    instrument_all also instruments every module loaded by then (json's and
    numpy's Python code, say), not only the imports made in instrumented()."""
    if instrument_all:
        atheris.instrument_all()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
