"""SwiGLU of an fp8 gate / up GEMM's result, quantized per row to fp8 in one pass."""

from pallas_kernels.swiglu_quantize.api import swiglu_quantize
from pallas_kernels.swiglu_quantize.reference import swiglu_quantize_reference

__all__ = ["swiglu_quantize", "swiglu_quantize_reference"]
