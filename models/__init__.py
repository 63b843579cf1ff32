"""Flax NNX ports of long-context VLMs with Hugging Face checkpoint conversion.

* ``models.qwen2_5_vl``: Qwen2.5-VL (``from_hf``, ``save`` / ``load``, ``forward``, presets "3b" / "7b").
* ``models.attention``: the injectable attention protocol (dense XLA, cuDNN, per-layer hooks).
* ``models.qwen2_text``, ``models.rotary``, ``models.common``, ``models.safetensors_io``: shared pieces.

Nothing here imports ``mmjax``: attention is injected by the caller (see ``mmjax.inference``).
"""
