"""The text-LM golden fixtures (tests/models/fixtures/text_lm, see tools/make_text_lm_golden.py)."""

import os

import jax.numpy as jnp
import numpy as np

from models import llama, qwen3

TEXT_LM = os.path.join(os.path.dirname(__file__), "fixtures", "text_lm")
FAMILY_OF = {"llama": llama, "llama_tied_bias": llama, "qwen3": qwen3, "qwen3_moe": qwen3}
TEXT_CASES = tuple(FAMILY_OF)


def case_dir(case):
    return os.path.join(TEXT_LM, case)


def load_text_case(case):
    """(inputs {input_ids, attention_mask}, the whole npz as a dict)."""
    d = dict(np.load(os.path.join(TEXT_LM, f"{case}.npz")))
    return {"input_ids": d["input_ids"], "attention_mask": d["attention_mask"]}, d


def row0(d):
    """Row 0 alone, unpadded, as in the golden generate call."""
    return {"input_ids": d["input_ids"][:1, -int(d["generate_row0_prompt_len"]):]}


_MODELS = {}


def get_text_model(case, dtype=jnp.float32):
    key = (case, jnp.dtype(dtype).name)
    if key not in _MODELS:
        _MODELS[key] = FAMILY_OF[case].from_hf(case_dir(case), dtype=dtype)
    return _MODELS[key]
