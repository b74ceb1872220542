"""config.json bytes -> ModelConfig, and what a loader computes from it
before any weight is read (RoPE frequencies, parameter count, the memory
a context needs)."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _target import instrumented, main  # noqa: E402

with instrumented():
    from fastllm.spec.config import ModelConfig
    from fastllm.spec.errors import ModelFileError

_DIR = tempfile.mkdtemp(prefix="fuzz-config-")
_PATH = os.path.join(_DIR, "config.json")


def TestOneInput(data: bytes):
    with open(_PATH, "wb") as f:
        f.write(data)
    try:
        cfg = ModelConfig.from_file(_PATH)
    except ModelFileError as e:
        assert str(_PATH) in str(e), e   # every refusal names the file
        return
    cfg.n_params()
    cfg.context_bytes(min(cfg.max_position_embeddings, 1 << 30), "f32")
    cfg.rope_inv_freq(min(cfg.max_position_embeddings, 64))
    cfg.rope_tables(min(cfg.max_position_embeddings, 8))


if __name__ == "__main__":
    main(TestOneInput)
