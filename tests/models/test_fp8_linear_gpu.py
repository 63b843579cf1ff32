"""GPU check of the fp8 matmuls (`pytest -m gpu`): on an sm90 GPU the product runs as cuBLASLt's fp8 GEMM and equals
the product of the dequantized operands; the quantized prefill program compiles every fp8 dot to that GEMM."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from models.common import PREFILL_XLA_OPTIONS
from models.fp8_linear import fp8_matmul, quantize_rows, quantize_weight
from models.qwen2_5_vl import Qwen2_5_VL
from models.qwen2_5_vl import model as qwen_vl
from pallas_kernels.platform import is_sm90
from tests.models.helpers import small_config, video_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu" or not is_sm90(),
                                                  reason="needs an sm90 GPU")]


def test_fp8_matmul_is_a_cublas_fp8_gemm():
    x = jax.random.normal(jax.random.key(0), (4096, 3584), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (1, 3584, 4608)) * 3584 ** -0.5).astype(jnp.bfloat16)
    wq, ws = quantize_weight(w, 1)
    fn = jax.jit(fp8_matmul, compiler_options=PREFILL_XLA_OPTIONS)
    assert "__cublas$lt$matmul$f8" in fn.lower(x, wq[0], ws[0]).compile().as_text()
    got = np.asarray(fn(x, wq[0], ws[0]), np.float32)
    xq, xs = quantize_rows(x)
    want = np.asarray((xq.astype(jnp.float32) * xs) @ (wq[0].astype(jnp.float32) * ws[0][:, None]).T)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3  # bf16 result of the same fp8 operands


def test_quantized_prefill_program_uses_fp8_gemms():
    cfg = small_config(head_dim=32)
    model = mmjax.quantize_fp8(Qwen2_5_VL(cfg, dtype=jnp.bfloat16, key=jax.random.key(0)), min_rows=1)
    inputs = video_prompt(cfg, frames=2, rng=np.random.default_rng(0))
    p = qwen_vl.prepare_inputs(cfg, **inputs)
    img, vid = qwen_vl.visual_inputs(model, p, None)
    hlo = qwen_vl.prefill_language_model.lower(
        model, p.input_ids, img, vid, p.position_ids, p.attention_mask, p.token_types, p.rope_deltas,
        attention=mmjax.inference.resolve_attention("dense"), max_length=p.input_ids.shape[1] + 4).compile().as_text()
    assert hlo.count("__cublas$lt$matmul$f8") >= 4  # q/k/v, output, gate/up, down
    out = mmjax.prefill(model, inputs)
    assert np.isfinite(np.asarray(out.logits)).all()
