"""Bad model files get a clear ModelFileError naming the file, never a hang,
a crash or a silently wrong model."""
import os

import pytest

from fastllm.errors import ModelFileError
from fastllm.files import check_regular, read_bounded

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def test_read_bounded_reads_a_regular_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"{}")
    assert read_bounded(p, 2, "config.json") == b"{}"


def test_read_bounded_refuses_a_file_past_the_limit(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"{ }")
    with pytest.raises(ModelFileError, match=r"config.json.*3 bytes.*more than the 2"):
        read_bounded(p, 2, "config.json")


@needs_fifo
def test_a_fifo_is_refused_without_blocking(tmp_path):
    p = tmp_path / "model.safetensors"
    os.mkfifo(p)
    with pytest.raises(ModelFileError, match="FIFO"):
        read_bounded(p, 100, "model.safetensors")
    with pytest.raises(ModelFileError, match="FIFO"):
        check_regular(p, "model.safetensors")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_is_refused():
    with pytest.raises(ModelFileError, match="character device"):
        read_bounded("/dev/zero", 100, "config.json")


def test_a_missing_file_names_the_path(tmp_path):
    with pytest.raises(ModelFileError, match=r"nope.*cannot open config.json"):
        read_bounded(tmp_path / "nope", 100, "config.json")
