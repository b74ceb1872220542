"""Exceptions that name the file and what is wrong with it."""
from pathlib import Path


class FastLLMError(Exception):
    """Base class of fastllm's own errors."""


class ModelFileError(FastLLMError, ValueError):
    """A model file is missing, malformed or unsupported."""

    def __init__(self, path, problem):
        self.path = Path(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path is not None else problem)


class ConversionError(ModelFileError):
    """A GGUF file that cannot be imported, or a folder that cannot be
    written as one; the message names the file."""
