"""Floor 5, generate: a loaded Model, its sessions, sampling, speculative
decoding, constrained decoding and tool-call parsing.
"""
