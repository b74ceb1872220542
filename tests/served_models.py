"""Servers the API tests share: the default model as `fastllm serve` runs
it (its Q4_1 file, int8 activations), and a tiny random Qwen3.5 with its
chat template (tools, thinking). Test modules import these fixtures."""
import pytest

from fastllm import Model
from test_server import running


@pytest.fixture(scope="module")
def model(fastllm_home):
    return Model.from_pretrained(n_ctx=1024, threads=2)


@pytest.fixture(scope="module")
def server(model):
    with running(model, parallel=2) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def qwen_server(tiny_qwen):
    with running(tiny_qwen("qwen3.5"), parallel=2) as (url, engine):
        yield url, engine
