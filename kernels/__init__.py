"""Triton kernels of hf_kvplus, each beside its plain-torch twin.

Installed only as `hf_kvplus.kernels`. This file stays free of imports and code: from the repository
root a top-level `kernels` is found on the path, and Transformers probes that name (it belongs to a
PyPI package); it must find nothing to run here and conclude that package is absent.
"""
