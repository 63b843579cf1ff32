"""`mmjax bench decode` and its helpers: roofline bytes, compiled-program statistics, the decode step
updating its cache in place (no copy of the cache), N steps in one jit equal to N host-driven steps,
the decode-attention variants equal to dense attention (the multiply-reduce form:
tests/models/test_decode_attention.py)."""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mmjax.drivers.bench.decode_attention import split_k_attention
from mmjax.drivers.bench.roofline import kv_bytes, program_stats, weight_bytes

from mmjax.drivers.bench import decode as bench_decode
from mmjax.drivers.cli import main
from models.attention import dense_attention, resolve_attention
from models.causal_lm import model as causal_lm
from models.causal_lm.config import CausalLMConfig
from models.kv_cache import KVCache
from models.qwen2_5_vl import model as qwen_vl
from models.text_decoder import layer_param_shapes
from tests.models.helpers import random_decode_qkv, small_config


@pytest.fixture(scope="module")
def tiny():
    return bench_decode.tiny_model()


def test_weight_and_kv_bytes_count_what_a_step_reads(tiny):
    c = tiny.config.text
    per_layer = sum(math.prod(s) for s in layer_param_shapes(c).values())
    want = 4 * (per_layer + c.hidden_size + c.vocab_size * c.hidden_size + 3 * c.hidden_size)  # f32, lm_head, B=3
    assert weight_bytes(tiny.language_model, 3) == want
    for dtype in (jnp.float32, jnp.float8_e4m3fn):
        cache = KVCache.empty(c, 2, 40, jnp.float32, dtype)
        arrays = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if cache.k_scale is not None else [])
        assert kv_bytes(c, 2, 40, dtype) == sum(a.nbytes for a in arrays)


HLO = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %p = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %x = f32[1024,1024]{1,0} get-tuple-element(%p), index=1
  %c = f32[1024,1024]{1,0} copy(%x)
  %f = f32[1024,1024]{1,0} fusion(%c), kind=kLoop, calls=%fc
  ROOT %t = (s32[], f32[1024,1024]{1,0}) tuple(%i, %f)
}

ENTRY %main (a: f32[1024,1024], b: bf16[8,4096,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %b = bf16[8,4096,1024]{2,1,0} parameter(1)
  %u = bf16[8,4096,1024]{2,1,0} dynamic-update-slice(%b, %s, %z, %z, %z)
  %d = f32[16]{0} custom-call(%a), custom_call_target="gemm"
  %w = (s32[], f32[1024,1024]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[1024,1024]{1,0} get-tuple-element(%w), index=1
}
"""


def test_program_stats_counts_kernels_copies_and_large_outputs():
    st = program_stats(HLO, large_bytes=4 << 20)
    # entry: dynamic-update-slice + custom-call; loop body: copy + fusion (parameters, tuples, while free)
    assert st == {"ops": 4, "copies": 1, "large": ["c copy 4.0MiB", "f fusion 4.0MiB"]}
    with pytest.raises(ValueError, match="hlo_text: expected the text of a compiled HLO module"):
        program_stats("not hlo")


def _cache(cfg_text, batch=2, slots=1024, length=20):
    return bench_decode.rewind(KVCache.empty(cfg_text, batch, slots, jnp.float32), length)


@pytest.mark.parametrize("port", ["qwen2_5_vl", "causal_lm"])
def test_compiled_decode_step_updates_the_cache_in_place(port):
    """The donated cache is aliased to the output, no instruction but the in-place writes produces a
    cache-sized buffer and the temporaries (per-layer working set) stay below a copy of the cache."""
    cfg = small_config(layers=4)
    if port == "qwen2_5_vl":
        model, step = qwen_vl.Qwen2_5_VL(cfg, dtype=jnp.float32, key=jax.random.key(0)), qwen_vl.decode_step
    else:
        lm_cfg = CausalLMConfig(family="qwen3", text=cfg.text)
        model = causal_lm.CausalLM(lm_cfg, dtype=jnp.float32, key=jax.random.key(0))
        step = causal_lm.decode_step
    cache = _cache(cfg.text)
    compiled = step.lower(model, cache, jnp.asarray([1, 2], jnp.int32)).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= cache.k.nbytes + cache.v.nbytes
    assert mem.temp_size_in_bytes < cache.k.nbytes + cache.v.nbytes
    assert program_stats(compiled.as_text(), large_bytes=cache.k.nbytes)["large"] == []


def test_steps_in_one_jit_equal_host_driven_steps(tiny):
    c = tiny.config.text
    attn = resolve_attention("dense")
    key = jax.random.key(3)
    cache = bench_decode.make_cache(c, 2, 64, jnp.float32, jnp.float32, key)
    cache = bench_decode.rewind(cache, 30)
    host = jax.tree_util.tree_map(jnp.copy, cache)
    tok = jnp.asarray([3, 7], jnp.int32)
    loop_cache, loop_tok = bench_decode.greedy_steps(tiny, cache, tok, attn, 4)
    toks = []
    for _ in range(4):
        host, tok = bench_decode.greedy_step(tiny, host, tok, attn)
        toks.append(tok)
    np.testing.assert_array_equal(np.asarray(loop_tok), np.asarray(toks[-1]))
    assert int(loop_cache.length) == int(host.length) == 34
    np.testing.assert_allclose(np.asarray(loop_cache.k), np.asarray(host.k), atol=1e-5)
    # the loop carries a (large) cache in place: aliased, no cache-sized temporaries or outputs
    big = _cache(c, slots=4096)
    compiled = bench_decode.greedy_steps.lower(tiny, big, tok, attn, 4).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= big.k.nbytes + big.v.nbytes
    assert mem.temp_size_in_bytes < big.k.nbytes + big.v.nbytes
    assert program_stats(compiled.as_text(), large_bytes=big.k.nbytes)["large"] == []




def test_split_k_attention_equals_dense():
    q, k, v, valid = random_decode_qkv(s=320)
    pos = jnp.full((2, 1), 300, jnp.int32)
    valid = valid.at[:, 300].set(True)
    ref = dense_attention(q, k, v, q_positions=pos, kv_valid=valid)
    got = split_k_attention(q, k, v, q_positions=pos, kv_valid=valid)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)
    with pytest.raises(ValueError, match=r"q_positions / kv_valid: expected \[B, 1\]"):
        split_k_attention(q, k, v, q_positions=jnp.zeros((2, 2), jnp.int32), kv_valid=valid)


@pytest.mark.parametrize("args, err", [
    (["--variants", "default,nope"], r"--variants: expected comma-separated names of default"),
    (["--xla-option", "no_equals"], r"--xla-option: expected KEY=VALUE"),
    (["--contexts", "8", "--host-steps", "8"], r"--contexts: expected contexts > steps \+ 1 = 9"),
])
def test_bad_arguments_exit_2(args, err, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "decode", *args, "--out", ""])
    assert e.value.code == 2
    assert re.search(err, capsys.readouterr().err)


def test_xla_option_values_are_typed():
    assert bench_decode.xla_options(["a=true", "b=False", "c=12", "d=", "e=x,y"]) == (
        ("a", True), ("b", False), ("c", 12), ("d", ""), ("e", "x,y"))


@pytest.mark.slow
def test_bench_decode_runs_on_cpu_and_writes_json_and_plot(tmp_path, capsys):
    assert main(["bench", "decode", "--out", str(tmp_path), "--batches", "2", "--contexts", "64", "--steps", "3",
                 "--reps", "1", "--variants", "default,einsum_attn,reduce_attn"]) == 0
    out = capsys.readouterr().out
    assert "roofline ms" in out and "in-jit ms" in out
    files = sorted(os.listdir(tmp_path))
    assert [f.rsplit(".", 1)[1] for f in files] == ["json", "png"]
    result = json.loads((tmp_path / files[0]).read_text())
    rows = result["rows"]
    assert [(r["variant"], r["batch"], r["context"]) for r in rows] == [("default", 2, 64), ("einsum_attn", 2, 64),
                                                                        ("reduce_attn", 2, 64)]
    for r in rows:
        assert r["roofline_ms"] > 0 and r["in_jit_ms"] > 0 and r["sync_ms"] > 0 and r["ops"] > 0
        assert r["tokens_per_s"] == pytest.approx(2e3 / r["async_ms"])
    assert result["roofline_gbps"] > 0 and set(result["bandwidth"]) == {"copy_gbps", "read_gbps"}


def test_make_cache_fills_every_slot_and_checks_the_dtype(tiny):
    c = tiny.config.text
    cache = bench_decode.make_cache(c, 2, 3000, jnp.float32, jnp.float32, jax.random.key(0))
    assert cache.k.shape == (c.num_hidden_layers, 2, 3000, c.num_key_value_heads, c.head_dim)
    assert np.all(np.abs(np.asarray(cache.k)).sum(-1) > 0) and not np.array_equal(cache.k, cache.v)
    fp8 = bench_decode.make_cache(c, 1, 64, jnp.float32, jnp.float8_e4m3fn, jax.random.key(0))
    assert fp8.k.dtype == jnp.float8_e4m3fn and fp8.k_scale.shape == fp8.k.shape[:-1]
    with pytest.raises(ValueError, match="kv_dtype: expected the model dtype float32 or float8_e4m3fn"):
        bench_decode.make_cache(c, 1, 64, jnp.float32, jnp.bfloat16, jax.random.key(0))
