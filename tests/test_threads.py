"""The OpenMP runtime starts with fastllm's short spin-then-sleep wait, unless
the user set a wait policy, and the setting leaks nowhere else.

libgomp prints the settings it started with under OMP_DISPLAY_ENV=verbose;
other runtimes print nothing of the kind, and those checks are skipped.
"""
import os
import re
import subprocess
import sys

import pytest

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_DISPLAY_ENV")


def start(code: str, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def started_spin_count(**env_extra) -> str:
    out = start("import fastllm", OMP_DISPLAY_ENV="verbose", **env_extra)
    m = re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    if m is None:
        pytest.skip("the OpenMP runtime is not libgomp: it does not show its spin count")
    return m.group(1)


def test_default_is_a_short_spin():
    from fastllm.core._openmp import SPIN_COUNT
    assert started_spin_count() == SPIN_COUNT
    assert int(SPIN_COUNT) < 300000  # libgomp's own default, which collapses on busy cores


@pytest.mark.parametrize("env, want", [({"GOMP_SPINCOUNT": "7"}, "7"),
                                       ({"OMP_WAIT_POLICY": "passive"}, "0"),
                                       ({"OMP_WAIT_POLICY": "active"}, "30000000000")])
def test_a_setting_of_the_users_own_is_kept(env, want):
    assert started_spin_count(**env) == want


def test_the_setting_reaches_no_child_process():
    code = ("import os, subprocess, sys, fastllm\n"
            "from fastllm.core._openmp import wait_policy\n"
            "print(wait_policy())\n"
            "print([k for k in ('GOMP_SPINCOUNT', 'KMP_BLOCKTIME') if k in os.environ])\n"
            "subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get(\"GOMP_SPINCOUNT\"))'])\n")
    lines = start(code).stdout.splitlines()
    assert lines[0].endswith("(fastllm default)")
    assert lines[1:] == ["[]", "None"]


def test_wait_policy_says_when_the_user_set_it():
    out = start("from fastllm.core._openmp import wait_policy; print(wait_policy())", GOMP_SPINCOUNT="42")
    assert out.stdout.strip() == "GOMP_SPINCOUNT=42 (set by the user)"


def test_info_shows_the_wait_policy():
    from pathlib import Path
    tiny = Path(__file__).parent / "data" / "tiny-llama"
    out = start(f"import sys; from fastllm.cli.main import main; sys.exit(main(['info', '--model', {str(tiny)!r}]))",
                GOMP_SPINCOUNT="42")
    assert "OpenMP wait" in out.stdout and "GOMP_SPINCOUNT=42 (set by the user)" in out.stdout
