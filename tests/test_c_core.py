"""The C core builds and passes its own test with no Python in the loop."""
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"


@pytest.mark.slow   # builds and runs the C test: about 30 s of CPU
def test_c_core_alone(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or sysconfig.get_config_var("CC").split()[0]
    exe = tmp_path / "test_core"
    # every csrc/*.c but the tests, as setup.py takes them
    core = [str(p) for p in sorted(CSRC.glob("*.c")) if not p.name.startswith("test_")]
    build = subprocess.run([cc, "-O2", "-std=gnu11", "-Wall", "-Werror", "-fopenmp", f"-I{CSRC}", *core,
                            str(CSRC / "test_core.c"), "-lm", "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    # No time limit: the C test cannot wait on anything, and its run time is
    # the machine's (minutes on a busy one); a hang would show as CI's own.
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0 and "all passed" in run.stdout, run.stdout + run.stderr
