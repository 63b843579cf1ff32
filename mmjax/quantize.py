"""FP8 matmuls for a whole model's prefill: `quantize_fp8`."""

from __future__ import annotations

from flax import nnx

from mmjax.inference import check_model
from models.fp8_linear import FP8_MIN_ROWS, quantize_decoder, quantize_tower
from models.qwen2_5_vl import Qwen2_5_VL


def quantize_fp8(model, *, min_rows: int = FP8_MIN_ROWS):
    """A copy of ``model`` (any model `mmjax.prefill` runs) whose decoder also holds fp8 (e4m3) copies of its attention
    projections and dense MLP weights, scaled per output channel (`models.fp8_linear`). Calls with at least
    ``min_rows`` tokens (B x T: a prefill, a prefill chunk) run those matmuls as fp8 GEMMs with each token's
    activations scaled by their absolute maximum; smaller calls (decode steps, token trees), the LM head and MoE
    experts keep the model's weights. Qwen2.5-VL's vision tower runs its blocks' matmuls in fp8 too (LLaVA-OneVision's
    SigLIP tower keeps its weights). The bf16 arrays are shared with ``model``, not copied; the fp8 copies add half
    the bytes of the weights they copy (6.5 GB for the 7B decoder, 0.3 GB for its tower). One device only (no
    ``mesh``). Quantize after loading: checkpoints (`mmjax.load`, the ports' ``save``) hold the unquantized model."""
    check_model(model)
    graph, state = nnx.split(model)
    new = nnx.merge(graph, state)
    new.language_model = quantize_decoder(model.language_model, min_rows)
    if isinstance(model, Qwen2_5_VL):
        new.visual = quantize_tower(model.visual)
    return new
