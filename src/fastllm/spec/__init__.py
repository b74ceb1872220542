"""Floor 0, spec: what a model is, as data (the tensor table, configs, families),
fastllm's errors and the bounded file reads configs are read with. Imports
nothing else of fastllm.
"""
