"""fastllm: CPU LLM inference with a plain-C run loop.

    from fastllm import Model
    model = Model.from_pretrained()          # SmolLM2-135M-Instruct
    print(model.generate("The capital of France is", max_new_tokens=20))
"""
from . import _openmp  # noqa: F401  (first: starts OpenMP with fastllm's wait policy)
from .errors import FastLLMError, ModelFileError
from .model import ContextFullWarning, GenerationStats, Model, ResourceLimitWarning
from .sampling import SamplingParams
from .session import Session

__version__ = "0.1.0"
__all__ = ["Model", "Session", "SamplingParams", "GenerationStats", "ContextFullWarning",
           "ResourceLimitWarning", "FastLLMError", "ModelFileError", "__version__"]
