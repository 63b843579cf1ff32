"""tools/mosaic_sync_once.py: the variant moves the consumers' offset / resync handshakes out of the item loop (once
each), and the variant still lowers for CUDA on the persistent grid; a changed kernel is refused."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from mosaic_ab import load_module  # noqa: E402
from mosaic_sync_once import sync_once  # noqa: E402

from pallas_kernels import BlockLayout  # noqa: E402
from tests.pallas_kernels.helpers import lower_for_cuda  # noqa: E402

MODULE = os.path.join(ROOT, "pallas_kernels", "block_sparse", "mosaic_gpu.py")


def test_variant_moves_the_handshakes_out_of_the_item_loop(tmp_path):
    text = open(MODULE).read()
    variant = sync_once(text)
    assert variant.count("pl.when(wg == 1)(handshake)") == text.count("pl.when(wg == 1)(handshake)") == 1
    loop = variant.index("lax.fori_loop(0, my_items, run_item, jnp.int32(0))")
    assert variant.index("pl.when(wg == 1)(handshake)") < loop < variant.index("pl.when(wg == 0)(handshake)")
    with pytest.raises(ValueError, match="does not hold exactly one copy"):
        sync_once(variant)

    path = tmp_path / "mosaic_gpu_sync_once.py"
    path.write_text(variant)
    mod = load_module(str(path), "mosaic_gpu_sync_once")
    try:
        lay = BlockLayout.random_causal(jax.random.PRNGKey(0), 2048, 2048, keep=0.2, block_q=128, block_k=128, heads=4)
        lower_for_cuda((1, 2048, 4, 128), (1, 2048, 2, 128), jnp.bfloat16, lay,
                       attention=mod.block_sparse_attention_mosaic_gpu, sm_scale=0.1, persistent=True)
    finally:
        del sys.modules["mosaic_gpu_sync_once"]
