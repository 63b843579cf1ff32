"""mmjax: modality-aware sparse prefill (MMInference, MOMO) and speculative decoding (Sparrow) for
long-context vision-language models, in JAX / Pallas.

Layers, each importing only the ones before it: ``pallas_kernels`` (attention kernels) <-
``models`` (Flax ports, attention injected) <- ``mmjax.sparse`` (patterns, layouts, search) <-
``mmjax.inference`` (prefill, decode) <- ``mmjax.speculative`` (Sparrow, generate) <-
``mmjax.drivers`` (CLI, benchmarks).
"""

from mmjax import io, parallel, patterns, speculative
from mmjax.inference import PrefillOutput, decode_step, prefill
from mmjax.load import load
from mmjax.quantize import quantize_fp8
from mmjax.sparse import (Calibration, CalibrationRecorder, LayoutSet, Modality, RowSplit, SearchSpace, SparseConfig,
                          attention_recall, build_layout, plot_layout, search, sparse_attention)
from mmjax.speculative import GenerateOutput, generate

__version__ = "0.1.0"

__all__ = ["Calibration", "CalibrationRecorder", "GenerateOutput", "LayoutSet", "Modality", "PrefillOutput",
           "RowSplit", "SearchSpace", "SparseConfig", "attention_recall", "build_layout", "decode_step", "generate",
           "io", "load", "parallel", "patterns", "plot_layout", "prefill", "quantize_fp8", "search", "sparse_attention", "speculative"]
