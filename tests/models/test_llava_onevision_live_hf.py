"""Live LLaVA-OneVision parity against the installed transformers (runs only where torch + transformers import).

Loads the fixture snapshots with ``LlavaOnevisionForConditionalGeneration.from_pretrained`` (fp32, eager attention)
and compares logits and greedy ``generate`` with the JAX port on the fixture inputs, so a transformers version other
than the one that wrote the fixtures is checked too.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from models import llava_onevision as lo

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "LlavaOnevisionForConditionalGeneration"):
    pytest.skip("transformers without LLaVA-OneVision", allow_module_level=True)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "llava_onevision")
KEYS = ("input_ids", "attention_mask", "pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos")


@pytest.fixture(params=["ov", "ov_pool"])
def case(request):
    return request.param


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def test_logits_and_greedy_generate_match_installed_transformers(case):
    d = dict(np.load(os.path.join(FIXTURES, f"{case}.npz")))
    inputs = {k: d[k].astype(np.float32) if k.startswith("pixel") else d[k] for k in KEYS}
    hf = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        os.path.join(FIXTURES, case), dtype=torch.float32, attn_implementation="eager").eval()
    model = lo.from_hf(os.path.join(FIXTURES, case), dtype=jnp.float32)
    with torch.no_grad():
        ref = hf(**{k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()}).logits.float().numpy()
    ours = np.asarray(lo.forward(model, **inputs))
    mask = inputs["attention_mask"].astype(bool)
    assert np.abs(ours[mask] - ref[mask]).max() <= 2e-4
    ids = d["text_input_ids"]
    with torch.no_grad():
        gen = hf.generate(input_ids=torch.from_numpy(ids), max_new_tokens=6, do_sample=False, pad_token_id=400)
    out = mmjax.generate(model, {"input_ids": ids}, 6)
    np.testing.assert_array_equal(out.tokens[0], gen[0, ids.shape[1]:].numpy())
