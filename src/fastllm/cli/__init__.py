"""Floor 7, cli: the `fastllm` command (main), its bench and perplexity commands.
"""
