"""The quantize kernel family (issue 40): FP8 casts as TE makes them, an amax pass and a cast
(optionally transposed, TE's cast-transpose) for each FP8 format, which a pipeline built for FP8
launches around its GEMMs (through the runtime's Fp8Call)."""

from .family import QUANTIZE, fp8_amax, fp8_cast, fp8_kernels

__all__ = ["QUANTIZE", "fp8_amax", "fp8_cast", "fp8_kernels"]
