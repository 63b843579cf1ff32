"""Flax NNX ports of long-context VLMs with Hugging Face checkpoint conversion.

* ``models.qwen2_5_vl``: Qwen2.5-VL (``from_hf``, ``save`` / ``load``, ``forward``, presets "3b" / "7b").
* ``models.llama``, ``models.qwen3``: Llama 3.x, Qwen3 dense and MoE (same entry points; ``models.causal_lm``).
* ``models.attention``: the injectable attention protocol (dense XLA, cuDNN, per-layer hooks).
* ``models.text_decoder``, ``models.kv_cache``, ``models.moe``, ``models.rotary``, ``models.common``,
  ``models.safetensors_io``: shared pieces (``models.qwen2_text``: the decoder's Qwen2 names).

Nothing here imports ``mmjax``: attention is injected by the caller (see ``mmjax.inference``).
"""
