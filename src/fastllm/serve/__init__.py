"""Floor 6, serve: the continuous-batching engine, batch generation, and the
HTTP server with its OpenAI, Anthropic and embeddings APIs.
"""
