"""fastllm: CPU LLM inference with a plain-C run loop.

    from fastllm import Model
    model = Model.from_pretrained()          # SmolLM2-135M-Instruct
    print(model.generate("The capital of France is", max_new_tokens=20))
"""
from .core import _openmp  # noqa: F401  (first: starts OpenMP with fastllm's wait policy)
from .spec.version import __version__
from .spec.errors import FastLLMError, ModelFileError
from .generate.model import ContextFullWarning, GenerationStats, Model, ResourceLimitWarning
from .generate.sampling import SamplingParams
from .generate.session import Session
from .serve.batch import generate_batch, generate_tokens_batch

__all__ = ["Model", "Session", "SamplingParams", "GenerationStats", "ContextFullWarning",
           "ResourceLimitWarning", "FastLLMError", "ModelFileError", "__version__",
           "generate_batch", "generate_tokens_batch"]
