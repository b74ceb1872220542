"""The tokenizer's exceptions."""
from ..errors import FastLLMError


class TokenizerError(FastLLMError, ValueError):
    """Invalid input to a tokenizer, or an invalid tokenizer definition."""


class UnsupportedTokenizerError(TokenizerError):
    """The tokenizer.json uses a component (or option) fastllm does not implement."""
