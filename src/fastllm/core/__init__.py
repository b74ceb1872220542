"""Floor 1, core: the Cython boundary to the C run loop (_core, cfastllm.pxd) and
the OpenMP start-up. Imports only spec.

Nothing is imported here: _openmp must set the OpenMP wait policy before
_core is loaded (fastllm/__init__.py imports it first).
"""
