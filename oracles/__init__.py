"""Independent references that fastllm is checked against (test-only: they
use torch, transformers, tokenizers and tiktoken)."""
