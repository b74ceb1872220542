"""Running llama.cpp's convert_hf_to_gguf.py in this process, for the
make.py scripts under tests/data (CI has no llama.cpp: they are run by hand)."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path


def convert(converter: Path, folder: Path, out: Path, outtype: str = "f32") -> None:
    """convert_hf_to_gguf.py FOLDER --outtype OUTTYPE --outfile OUT, with its
    own conversion package importable (and patchable before the call)."""
    if str(converter.parent) not in sys.path:
        sys.path.insert(0, str(converter.parent))
    argv = sys.argv
    sys.argv = [str(converter), str(folder), "--outtype", outtype, "--outfile", str(out)]
    try:
        runpy.run_path(str(converter), run_name="__main__")
    finally:
        sys.argv = argv
