"""Registers the kernels of the built-in formats (imported by kernels/dispatch.py, the one place kernels are asked for): the twins for every
format, then the KIVI and the rotated formats' own."""

from hf_kvplus.kernels import format_kernels, kivi_kernels, rotated_kernels

__all__ = ["format_kernels", "kivi_kernels", "rotated_kernels"]
