"""The Qwen2 names of the shared decoder (``models.text_decoder``) and KV cache (``models.kv_cache``).

Qwen2 / Qwen2.5-VL is the shared decoder with its default options (q/k/v biases, dense SwiGLU MLP);
``Qwen2Text`` is ``TextDecoder``. Kept so that code written against these names keeps working.
"""

from __future__ import annotations

from models.kv_cache import FP8_MAX, KVCache, compact_cache, dequantize_kv, quantize_kv
from models.text_decoder import (LayerInputs, TextConfig, TextDecoder, embed_tokens, layer_param_shapes, lm_logits,
                                 run_decoder)

Qwen2Text = TextDecoder

__all__ = ["FP8_MAX", "KVCache", "LayerInputs", "Qwen2Text", "TextConfig", "embed_tokens", "layer_param_shapes",
           "lm_logits", "run_decoder", "compact_cache", "dequantize_kv", "quantize_kv"]
