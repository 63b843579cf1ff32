"""Live parity against the installed transformers (runs only where torch + transformers import).

Loads the fixture checkpoints with ``Qwen2_5_VLForConditionalGeneration.from_pretrained`` and
compares logits, M-RoPE ids and greedy ``generate`` with the JAX port, so a transformers version
other than the one that wrote the fixtures is checked too.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.inference import decode_step, prefill
from models.qwen2_5_vl import forward, prepare_inputs
from tests.models.conftest import FIXTURES, first_row_inputs, get_model, load_case

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen2_5_VLForConditionalGeneration"):
    pytest.skip("transformers without Qwen2.5-VL", allow_module_level=True)

MAJOR = int(transformers.__version__.split(".")[0])


def _hf(case):
    m = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        os.path.join(FIXTURES, case), dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def _torch_inputs(inputs, config):
    out = {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()}
    ids = out["input_ids"].long()
    out["input_ids"] = ids
    if MAJOR >= 5:
        out["mm_token_type_ids"] = torch.where(ids == config.image_token_id, 1,
                                               torch.where(ids == config.video_token_id, 2, 0)).int()
    return out


def _hf_rope(hf, tin):
    kw = dict(image_grid_thw=tin.get("image_grid_thw"), video_grid_thw=tin.get("video_grid_thw"),
              second_per_grid_ts=tin.get("second_per_grid_ts"), attention_mask=tin.get("attention_mask"))
    if MAJOR >= 5:
        return hf.model.get_rope_index(tin["input_ids"], tin["mm_token_type_ids"], **kw)
    return hf.model.get_rope_index(tin["input_ids"], **kw)


def _match_installed_semantics(hf, model, inputs):
    """Inputs for which our M-RoPE ids should equal the installed transformers' ids.

    transformers 5.17 truncates ``second_per_grid_ts`` to whole seconds in ``get_rope_index``
    (5.23 and 4.x scale by the exact value, as we do); when the installed version does that, feed
    our side truncated seconds so rope ids, logits and generate are compared like for like.
    """
    mask = np.asarray(inputs.get("attention_mask", np.ones_like(inputs["input_ids"]))).astype(bool)
    hf_pos = _hf_rope(hf, _torch_inputs(inputs, model.config))[0].numpy()[:, mask]
    ours = lambda inp: np.asarray(prepare_inputs(model.config, **inp).position_ids)[:, mask]
    if np.array_equal(ours(inputs), hf_pos):
        return inputs
    truncated = dict(inputs, second_per_grid_ts=np.trunc(inputs["second_per_grid_ts"]))
    if np.array_equal(ours(truncated), hf_pos):
        print(f"transformers {transformers.__version__} truncates second_per_grid_ts; comparing with truncated seconds")
        return truncated
    raise AssertionError(f"M-RoPE ids differ from transformers {transformers.__version__}:\n{ours(inputs)}\n{hf_pos}")


def test_live_logits_and_rope_index(case):
    inputs, _ = load_case(case)
    model = get_model(case)
    if MAJOR < 5:  # transformers 4.x continues text after the largest id of a vision span
        model = _with_legacy_rope(model)
    hf = _hf(case)
    inputs = _match_installed_semantics(hf, model, inputs)
    tin = _torch_inputs(inputs, model.config)
    with torch.no_grad():
        ref = hf(**tin).logits.float().numpy()
        pos, _ = _hf_rope(hf, tin)
    mask = inputs["attention_mask"].astype(bool)
    # feed HF's own position ids: logits parity independent of rope-index version differences
    ours = np.asarray(forward(model, **inputs, position_ids=pos.numpy()))
    np.testing.assert_allclose(ours[mask], ref[mask], atol=3e-4, rtol=1e-4)
    p = prepare_inputs(model.config, **inputs)
    np.testing.assert_array_equal(np.asarray(p.position_ids)[:, mask], pos.numpy()[:, mask])


def _with_legacy_rope(model):
    import copy
    import dataclasses
    model = copy.copy(model)
    model.config = dataclasses.replace(model.config, rope_index_legacy=True)
    return model


def test_live_greedy_generate(case):
    inputs, d = load_case(case)
    model = get_model(case)
    if MAJOR < 5:
        model = _with_legacy_rope(model)
    hf = _hf(case)
    row = _match_installed_semantics(hf, model, first_row_inputs(inputs, d))
    tin = _torch_inputs(row, model.config)
    with torch.no_grad():
        gen = hf.generate(**tin, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = gen[0, row["input_ids"].shape[1]:].tolist()
    out = prefill(model, row, max_length=64)
    tok, cache, got = jnp.argmax(out.logits, -1), out.cache, []
    for _ in range(len(want)):
        got.append(int(tok[0]))
        logits, cache = decode_step(model, cache, tok)
        tok = jnp.argmax(logits, -1)
    assert got == want
