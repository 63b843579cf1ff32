"""Live parity of the text LMs against the installed transformers (runs only where torch + transformers import).

Loads the text-LM fixture checkpoints with ``AutoModelForCausalLM.from_pretrained`` and compares logits (left-padded
batch) and greedy ``generate`` with ``models.llama`` / ``models.qwen3`` and ``mmjax.generate``, so a transformers
version other than the one that wrote the fixtures is checked too.
"""

import numpy as np
import pytest

import mmjax
from tests.models.text_lm_cases import FAMILY_OF, TEXT_CASES, case_dir, get_text_model, load_text_case, row0

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(params=TEXT_CASES)
def case(request):
    return request.param


def _hf(case):
    return transformers.AutoModelForCausalLM.from_pretrained(case_dir(case), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def test_live_logits(case):
    inputs, _ = load_text_case(case)
    mask = inputs["attention_mask"]
    pos = np.where(mask > 0, np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        ref = _hf(case)(input_ids=torch.from_numpy(inputs["input_ids"]), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(pos)).logits.float().numpy()
    ours = np.asarray(FAMILY_OF[case].forward(get_text_model(case), **inputs))
    np.testing.assert_allclose(ours[mask > 0], ref[mask > 0], atol=2e-4, rtol=0)


def test_live_greedy_generate(case):
    _, d = load_text_case(case)
    row = row0(d)
    with torch.no_grad():
        ids = torch.from_numpy(row["input_ids"])
        gen = _hf(case).generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
    want = gen[0, ids.shape[1]:].tolist()
    assert mmjax.generate(get_text_model(case), row, max_new_tokens=6).tokens[0].tolist() == want
