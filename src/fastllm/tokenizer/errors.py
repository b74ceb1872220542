"""The tokenizer's exceptions."""
from ..spec.errors import FastLLMError


class TokenizerError(FastLLMError, ValueError):
    """Invalid input to a tokenizer, or an invalid tokenizer definition."""


class UnsupportedTokenizerError(TokenizerError):
    """The tokenizer.json uses a component (or option) fastllm does not implement."""


def need_str(value, where, key):
    """value, once it is a string; a string field of tokenizer.json that
    holds anything else is refused at load, before encode trips on it."""
    if not isinstance(value, str):
        raise TokenizerError(f"{where}: {key} must be a string, got {value!r}")
    return value


def need_int(value, where, key):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TokenizerError(f"{where}: {key} must be a whole number, got {value!r}")
    return value
