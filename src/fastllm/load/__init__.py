"""Floor 3, load: weights from files into the C core, the packed-weights cache,
and where models come from (paths, the Hugging Face cache).
"""
