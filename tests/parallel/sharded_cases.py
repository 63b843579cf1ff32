"""Sharded prefill / decode / generate against one device, run on 4 virtual CPU devices.

Collected only when JAX has at least 4 devices: `tests/parallel/test_parallel.py` runs this file in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set before JAX starts), so
the rest of the suite keeps its single device. Tiny models: Qwen2.5-VL with 8 query / 4 key-value
heads (tp 4, and tp 2 x sp 2) and the committed Llama / Qwen3 fixtures (tp 2, loaded straight into
the layout). The default selection covers tp 2 x sp 2 (dense and sparse) and tp 2 (text LM loaded into the
layout), `mmjax generate --devices 2` and the greedy step of `mmjax bench decode` on tp 2 x sp 2;
``-m slow`` adds tp 4 (dense and sparse), tp 2 and sp 4 alone (the decode step on tp 2 too), ring attention
(2 key-value heads over sp 4 and tp 2 x sp 2), chunked prefill, the frame split of the vision tower alone,
left-padded text-LM batches (Llama with biases, Qwen3-MoE) and the collectives of a decode step.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import mmjax
from mmjax.drivers.cli import main as cli_main
from mmjax.parallel import make_mesh, shard_model
from mmjax.parallel import run as parallel_run
from mmjax.parallel.attention import decode_attention, prefill_attention, zigzag_perms
from mmjax.parallel.vision import video_features
from mmjax.patterns import AShape, Dense, KernelOptions
from models.attention import resolve_attention
from models.causal_lm import model as causal_lm
from models.qwen2_5_vl import Qwen2_5_VL, Qwen2_5_VLConfig, VisionConfig
from models.qwen2_5_vl import model as qwen_vl
from models.text_decoder import TextConfig
from tests.drivers.test_generate import EXPECTED as GENERATE_EXPECTED
from tests.drivers.test_generate import FLAGS as GENERATE_FLAGS
from tests.models.helpers import IMG, VE, VID, VS, small_config, video_prompt
from tests.models.text_lm_cases import case_dir, load_text_case, row0

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (run by tests/parallel/test_parallel.py)")

LAYERS, HEADS, KV_HEADS = 2, 8, 4
MESHES = {"tp2": (2, 1), "tp4": (4, 1), "tp2_sp2": (2, 2), "sp4": (1, 4)}


def random_model(cfg, seed=7):
    """A Qwen2.5-VL of ``cfg`` with N(0, 0.02) weights (norms 1) drawn on the host: no per-shape compiles."""
    model = nnx.eval_shape(lambda: Qwen2_5_VL(cfg, key=jax.random.key(0)))
    rng = np.random.default_rng(seed)

    def fill(path, x):
        name = str(path[1].key)
        value = np.ones(x.shape) if "norm" in name else 0.02 * rng.standard_normal(x.shape)
        return jnp.asarray(value, x.dtype)
    nnx.update(model, jax.tree_util.tree_map_with_path(fill, nnx.state(model)))
    return model


def vl_config():
    text = TextConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, head_dim=16,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6,
                      mrope_section=(2, 3, 3))
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                          fullatt_block_indexes=(1,), window_size=56, tokens_per_second=2)
    return Qwen2_5_VLConfig(text=text, vision=vision, image_token_id=IMG, video_token_id=VID,
                            vision_start_token_id=VS, vision_end_token_id=VE)


def sparse_config_for(cfg):
    """A-shape and dense heads mixed inside GQA groups, a different plan per layer."""
    kw = {"block_q": 16, "block_k": 16}
    pats = (AShape(sink=4, local=16, **kw), Dense(**kw))
    c = cfg.text
    layers = tuple(tuple(pats[(i + h // 3) % 2] for h in range(c.num_attention_heads))
                   for i in range(c.num_hidden_layers))
    return mmjax.SparseConfig(layers, options=KernelOptions(implementation="reference"))


def sparse_config():
    return sparse_config_for(vl_config())


@pytest.fixture(scope="module")
def vl():
    cfg = vl_config()
    inputs = video_prompt(cfg, frames=10, rng=np.random.default_rng(0))
    inputs["input_ids"] = np.concatenate([inputs["input_ids"], [[5]]], axis=1)  # T = 87: no multiple of 2 or 4
    return cfg, random_model(cfg), inputs


_REF = {}


def reference(vl, attention):
    """Single-device prefill and 3 greedy tokens (computed once per attention)."""
    key = type(attention).__name__
    if key not in _REF:
        _, model, inputs = vl
        t = inputs["input_ids"].shape[1]
        _REF[key] = (mmjax.prefill(model, inputs, attention, max_length=t + 4),
                     mmjax.generate(model, inputs, 3, attention=attention).tokens)
    return _REF[key]


def sharded_model(cfg, mesh):
    return shard_model(random_model(cfg), mesh)


def check_prefill(ref, out, t, mesh):
    # float32 sums in another order on the mesh: a few ulps relative, not only absolute (a logit of -0.36 differed by
    # 2.3e-6 in one CI run)
    tol = dict(atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), **tol)
    np.testing.assert_allclose(np.asarray(out.cache.k)[:, :, :t], np.asarray(ref.cache.k)[:, :, :t], **tol)
    np.testing.assert_allclose(np.asarray(out.cache.v)[:, :, :t], np.asarray(ref.cache.v)[:, :, :t], **tol)
    tp = "tp" if mesh.shape["tp"] > 1 else None
    sp = "sp" if mesh.shape["sp"] > 1 else None
    assert out.cache.k.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        None, None, sp, tp, None)), 5)
    assert out.cache.k.shape[2] % mesh.shape["sp"] == 0


@pytest.mark.parametrize("name", ["tp2_sp2"] + [pytest.param(n, marks=pytest.mark.slow) for n in ("tp4", "tp2", "sp4")])
def test_dense_prefill_and_greedy_generate_equal_one_device(vl, name):
    cfg, _, inputs = vl
    mesh = make_mesh(*MESHES[name])
    model = sharded_model(cfg, mesh)
    ref, ref_tokens = reference(vl, "dense")
    t = inputs["input_ids"].shape[1]
    check_prefill(ref, mmjax.prefill(model, inputs, max_length=t + 4, mesh=mesh), t, mesh)
    np.testing.assert_array_equal(mmjax.generate(model, inputs, 3, mesh=mesh).tokens, ref_tokens)


@pytest.mark.parametrize("name", [pytest.param("tp4", marks=pytest.mark.slow), "tp2_sp2"])
def test_sparse_prefill_equals_one_device(vl, name):
    cfg, _, inputs = vl
    mesh = make_mesh(*MESHES[name])
    model = sharded_model(cfg, mesh)
    ref, ref_tokens = reference(vl, sparse_config())
    dense, _ = reference(vl, "dense")
    assert np.abs(np.asarray(ref.logits) - np.asarray(dense.logits)).max() > 1e-3  # the patterns do drop keys
    t = inputs["input_ids"].shape[1]
    check_prefill(ref, mmjax.prefill(model, inputs, sparse_config(), max_length=t + 4, mesh=mesh), t, mesh)
    if name == "tp4":  # decoding attends densely: the same program as the dense case's
        np.testing.assert_array_equal(mmjax.generate(model, inputs, 3, attention=sparse_config(), mesh=mesh).tokens,
                                      ref_tokens)


@pytest.mark.slow
def test_chunked_prefill_on_heads_mesh_equals_one_device(vl):
    cfg, _, inputs = vl
    mesh = make_mesh(2, 1)
    model = sharded_model(cfg, mesh)
    ref, _ = reference(vl, "dense")
    t = inputs["input_ids"].shape[1]
    check_prefill(ref, mmjax.prefill(model, inputs, max_length=t + 4, chunk_tokens=48, mesh=mesh), t, mesh)


@pytest.mark.slow
def test_videos_split_by_frames_equal_one_device(vl):
    cfg, model, _ = vl
    grids = ((3, 4, 8), (5, 4, 4))  # 3 and 5 temporal patches over 4 devices: padded
    n = sum(t * h * w for t, h, w in grids)
    pixels = jnp.asarray(np.random.default_rng(1).standard_normal((n, cfg.vision.patch_dim)), jnp.float32)
    ref = qwen_vl.vision_features(model, pixels, grids)
    mesh = make_mesh(2, 2)
    out = video_features(sharded_model(cfg, mesh), pixels, grids, None, mesh)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)


@pytest.mark.parametrize("mesh_shape, pieces", [((2, 2), 2), ((4, 1), 8), ((1, 2), 3)])
def test_video_uploaded_in_pieces_equals_one_device(vl, mesh_shape, pieces):
    """`mmjax.video_upload.video_features` on a mesh: piece i holds run i of every device's own frames; the
    features equal one device's and come back split by frames (8 temporal patches)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mmjax import video_upload
    cfg, model, _ = vl
    grid = (8, 4, 4)
    pixels = np.random.default_rng(4).standard_normal((8 * 16, cfg.vision.patch_dim)).astype(np.float32)
    ref = qwen_vl.vision_features(model, jnp.asarray(pixels), (grid,), 1)
    mesh = make_mesh(*mesh_shape)
    out = video_upload.video_features(sharded_model(cfg, mesh), pixels, grid, 1, mesh, pieces=pieces)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(tuple(mesh.axis_names))), 2)


def test_prefill_with_a_streamed_video_equals_one_device(vl):
    """mmjax.prefill on tp 2 x sp 2 with a video of 8 temporal patches (uploaded in 2 pieces of each device's
    frames, `frames_per_chunk=1`) gives one device's logits and cache."""
    cfg, model, _ = vl
    inputs = video_prompt(cfg, frames=8, rng=np.random.default_rng(5))
    t = inputs["input_ids"].shape[1]
    ref = mmjax.prefill(model, inputs, "dense", max_length=t + 4, frames_per_chunk=1)
    mesh = make_mesh(2, 2)
    out = mmjax.prefill(sharded_model(cfg, mesh), inputs, "dense", max_length=t + 4, frames_per_chunk=1, mesh=mesh)
    check_prefill(ref, out, t, mesh)


def test_program_inputs_laid_out_on_the_mesh_are_not_copied():
    """`parallel.run._on_mesh`: arrays over exactly the mesh's devices (the frame-split visual features) go into
    the program as they are; host and single-device arrays are replicated; None stays None."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = make_mesh(2, 2)
    feats = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P(("tp", "sp"))))
    one = jax.device_put(jnp.ones(3), jax.devices()[1])
    kept, host, single, none = parallel_run._on_mesh((feats, np.arange(5), one, None), mesh)
    assert kept is feats and none is None
    for a in (host, single):
        assert a.sharding.device_set == set(mesh.devices.flat) and a.sharding.is_fully_replicated


@pytest.mark.parametrize("mesh_shape", [(2, 1), pytest.param((2, 2), marks=pytest.mark.slow),
                                        pytest.param((1, 2), marks=pytest.mark.slow)])  # 2 key-value heads: tp <= 2
def test_moe_experts_split_over_tp_equal_one_device(mesh_shape):
    """Qwen3-MoE fixture (8 experts): each tp device holds 8 / tp of them; prefill (one piece, with sequence
    chunks of the MLP, and on a heads-only mesh chunked), decode and greedy ids equal one device."""
    mesh = make_mesh(*mesh_shape)
    model, _ = mmjax.load(case_dir("qwen3_moe"), dtype=jnp.float32, mesh=mesh)
    tp = mesh_shape[0]
    assert {s.data.shape[1] for s in model.language_model.e_gate_up[...].addressable_shards} == {8 // tp}
    assert {s.data.shape[1] for s in model.language_model.e_down[...].addressable_shards} == {8 // tp}
    ref, _ = mmjax.load(case_dir("qwen3_moe"), dtype=jnp.float32)
    _, d = load_text_case("qwen3_moe")
    inputs = row0(d)
    want = mmjax.prefill(ref, inputs, mlp_chunk=4)
    out = mmjax.prefill(model, inputs, mlp_chunk=4, mesh=mesh)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(want.logits), atol=1e-5)
    tokens = jnp.asarray([3])
    np.testing.assert_allclose(np.asarray(mmjax.decode_step(model, out.cache, tokens, mesh=mesh)[0]),
                               np.asarray(mmjax.decode_step(ref, want.cache, tokens)[0]), atol=1e-5)
    if mesh_shape[1] == 1:
        chunked = mmjax.prefill(model, inputs, chunk_tokens=5, mesh=mesh)
        np.testing.assert_allclose(np.asarray(chunked.logits), np.asarray(want.logits), atol=1e-5)
        with jax.set_mesh(mesh):  # as mmjax.decode_step runs it: the experts' shares added, never gathered
            compiled = parallel_run.decode_program.lower(
                causal_lm.decode_step, model, out.cache, tokens,
                attention=decode_attention(resolve_attention("dense"), mesh), mesh=mesh).compile().as_text()
        layers = model.config.text.num_hidden_layers
        assert len(re.findall(r"= \S+ all-reduce\(", compiled)) == 2 * layers  # attention output + experts
        assert len(re.findall(r"= \S+ all-gather\(", compiled)) == 1  # the vocabulary-split logits only
    np.testing.assert_array_equal(mmjax.generate(model, inputs, 4, mesh=mesh).tokens,
                                  mmjax.generate(ref, inputs, 4).tokens)


def test_text_lm_loads_into_layout_and_generates_as_one_device():
    mesh = make_mesh(2, 1)
    model, _ = mmjax.load(case_dir("llama"), dtype=jnp.float32, mesh=mesh)
    lm = model.language_model
    assert [s.data.shape for s in lm.wq[...].addressable_shards] == [(3, 64, 2, 16)] * 2  # 4 heads over 2
    assert [s.data.shape for s in lm.w_down[...].addressable_shards] == [(3, 64, 64)] * 2  # 128 features
    assert [s.data.shape for s in lm.embed[...].addressable_shards] == [(448, 64)] * 2  # whole on each device
    assert [s.data.shape for s in lm.lm_head[...].addressable_shards] == [(224, 64)] * 2  # vocabulary 448 split
    ref, _ = mmjax.load(case_dir("llama"), dtype=jnp.float32)
    _, d = load_text_case("llama")
    np.testing.assert_array_equal(mmjax.generate(model, row0(d), 6, mesh=mesh).tokens,
                                  mmjax.generate(ref, row0(d), 6).tokens)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama_tied_bias", "qwen3_moe"])
def test_text_lm_left_padded_batch_equals_one_device(case):
    mesh = make_mesh(2, 1)
    model, _ = mmjax.load(case_dir(case), dtype=jnp.float32, mesh=mesh)
    ref, _ = mmjax.load(case_dir(case), dtype=jnp.float32)
    inputs, _ = load_text_case(case)  # two rows, one left-padded
    out, want = mmjax.prefill(model, inputs, mesh=mesh), mmjax.prefill(ref, inputs)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(want.logits), atol=1e-5)
    tokens = jnp.asarray([3, 4])
    np.testing.assert_allclose(np.asarray(mmjax.decode_step(model, out.cache, tokens, mesh=mesh)[0]),
                               np.asarray(mmjax.decode_step(ref, want.cache, tokens)[0]), atol=1e-5)


@pytest.mark.slow
def test_decode_step_has_two_all_reduces_per_layer():
    """Heads split: one all-reduce after the output projection and one after the down projection
    per layer (the embedding table is whole on each device, so its lookup needs none); nothing gathers
    the cache."""
    mesh = make_mesh(2, 1)
    model, _ = mmjax.load(case_dir("qwen3"), dtype=jnp.float32, mesh=mesh)
    pre = mmjax.prefill(model, row0(load_text_case("qwen3")[1]), mesh=mesh)
    compiled = parallel_run.decode_program.lower(
        causal_lm.decode_step, model, pre.cache, jnp.zeros((1,), jnp.int32),
        attention=decode_attention(resolve_attention("dense"), mesh), mesh=mesh).compile().as_text()
    layers = model.config.text.num_hidden_layers
    assert len(re.findall(r"= \S+ all-reduce\(", compiled)) == 2 * layers
    tied = model.language_model.lm_head is None  # logits through the whole embedding table: nothing to gather
    assert len(re.findall(r"= \S+ all-gather\(", compiled)) == (0 if tied else 1)  # the vocabulary-split logits


def test_bad_meshes_are_named_errors(vl):
    cfg, _, inputs = vl
    model = random_model(cfg)
    devices = np.asarray(jax.devices()[:2])
    with pytest.raises(ValueError, match="mesh: expected axes named 'tp'"):
        mmjax.prefill(model, inputs, mesh=Mesh(devices, ("x",)))
    with pytest.raises(ValueError, match="mesh: expected a jax.sharding.Mesh"):
        mmjax.prefill(model, inputs, mesh="tp2")
    with pytest.raises(ValueError, match="not laid out on the mesh"):
        mmjax.prefill(model, inputs, mesh=make_mesh(2, 1))
    two_kv = random_model(small_config(layers=1))  # 2 key-value heads
    with pytest.raises(ValueError, match="'tp' axis size 4 must divide the decoder's num_key_value_heads=2"):
        shard_model(two_kv, make_mesh(4, 1))
    with pytest.raises(ValueError, match="chunk_tokens: a sequence-parallel mesh"):
        mesh = make_mesh(2, 2)
        mmjax.prefill(sharded_model(cfg, mesh), inputs, chunk_tokens=32, mesh=mesh)
    with pytest.raises(ValueError, match="tp \\* sp: expected at most the 4 devices"):
        make_mesh(4, 2)


@pytest.mark.parametrize("flags", [["--devices", "2"],
                                   pytest.param(["--devices", "2", "--sequence-parallel", "2"],
                                                marks=pytest.mark.slow)])
def test_generate_cli_on_devices_gives_transformers_greedy_ids(flags, capsys):
    rc = cli_main(["generate", *GENERATE_FLAGS, *flags, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["tokens"] == GENERATE_EXPECTED["generated_ids"]


def test_generate_cli_devices_errors_are_one_line(capsys):
    assert cli_main(["generate", *GENERATE_FLAGS, "--devices", "8"]) == 2
    assert "--devices: expected at most the 4 cpu devices available, got 8" in capsys.readouterr().err
    assert cli_main(["generate", *GENERATE_FLAGS, "--devices", "4", "--sequence-parallel", "3"]) == 2
    assert "--sequence-parallel: expected a divisor of --devices 4, got 3" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 4), (2, 2)])
def test_ring_prefill_when_kv_heads_do_not_split_equals_one_device(shape):
    """2 key-value heads over tp * sp = 4: dense ring attention (zigzag query chunks, K / V round the ring)."""
    cfg = small_config(layers=2)
    inputs = video_prompt(cfg, frames=6, rng=np.random.default_rng(2))  # T = 54: chunks of 7 (with 2 padded)
    t = inputs["input_ids"].shape[1]
    one = random_model(cfg)
    ref = mmjax.prefill(one, inputs, max_length=t + 4)
    mesh = make_mesh(*shape)
    model = shard_model(random_model(cfg), mesh)
    check_prefill(ref, mmjax.prefill(model, inputs, max_length=t + 4, mesh=mesh), t, mesh)
    np.testing.assert_array_equal(mmjax.generate(model, inputs, 3, mesh=mesh).tokens,
                                  mmjax.generate(one, inputs, 3).tokens)
    with pytest.raises(ValueError, match="sequence-parallel prefill runs ring attention, which is dense"):
        mmjax.prefill(model, inputs, sparse_config_for(cfg), mesh=mesh)


def test_zigzag_pairs_cover_every_chunk_once():
    for n in (1, 2, 3, 4, 8):
        send0, send1 = zigzag_perms(n)
        for perm in (send0, send1):
            assert sorted(d for _, d in perm) == list(range(n))  # a permutation of the devices
        got = {d: [] for d in range(n)}
        for slot, perm in enumerate((send0, send1)):
            for src, dst in perm:
                got[dst].append(2 * src + slot)
        assert all(sorted(got[j]) == sorted({j, 2 * n - 1 - j}) for j in range(n))  # device j: chunks j, 2n-1-j


@pytest.mark.slow
def test_sequence_parallel_prefill_and_decode_never_gather_the_cache():
    """tp 2 x sp 2, a prompt of 70 tokens (sp divides it): the compiled prefill and decode step hold only
    their slice of the KV cache (no all-gather of a cache-shaped [L, B, S, K, D] array)."""
    cfg = vl_config()
    inputs = video_prompt(cfg, frames=8, rng=np.random.default_rng(3))
    t = inputs["input_ids"].shape[1]
    mesh = make_mesh(2, 2)
    model = sharded_model(cfg, mesh)
    p = qwen_vl.prepare_inputs(cfg, **inputs)
    _, vid = qwen_vl.visual_inputs(model, p)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    arrays = tuple(None if a is None else jax.device_put(a, rep)
                   for a in (p.input_ids, None, vid, p.position_ids, p.attention_mask, p.token_types, p.rope_deltas))
    prefill_hlo = parallel_run.prefill_program.lower(
        qwen_vl.prefill_language_model, model, *arrays, attention=prefill_attention(resolve_attention("dense"), mesh, 4),
        max_length=t + 30, hidden_layers=(), mlp_chunk=None, kv_dtype=None, mesh=mesh).compile().as_text()
    cache = mmjax.prefill(model, inputs, max_length=t + 30, mesh=mesh).cache
    decode_hlo = parallel_run.decode_program.lower(
        qwen_vl.decode_step, model, cache, jnp.zeros((1,), jnp.int32),
        attention=decode_attention(resolve_attention("dense"), mesh), mesh=mesh).compile().as_text()
    for hlo in (prefill_hlo, decode_hlo):
        gathered = re.findall(r"= \w+\[(\d+),\d+,\d+,\d+,\d+\]\S* all-gather\(", hlo)
        assert gathered == [], gathered


@pytest.mark.parametrize("tp, sp", [pytest.param(2, 1, marks=pytest.mark.slow), (2, 2)])  # (2, 2) splits tp too
def test_bench_decode_step_on_mesh_equals_one_device(tp, sp):
    """`mmjax bench decode --devices N`'s greedy step: the cache made in its layout, the same tokens as
    the one-device step for 3 steps."""
    from mmjax.drivers.bench import decode as bench_decode

    one = bench_decode.tiny_model()
    c = one.config.text
    cache1 = bench_decode.rewind(bench_decode.make_cache(c, 2, 64, jnp.float32, jnp.float32, jax.random.key(3)), 40)
    mesh = make_mesh(tp, sp)
    model = shard_model(bench_decode.tiny_model(), mesh)
    cache2 = parallel_run.place_cache(bench_decode.rewind(
        bench_decode.make_cache(c, 2, 64, jnp.float32, jnp.float32, jax.random.key(3), mesh), 40), mesh)
    want = mmjax.parallel.cache_sharding(cache2, mesh).k
    assert cache2.k.sharding.is_equivalent_to(want, 5)
    np.testing.assert_array_equal(np.asarray(cache2.k), np.asarray(cache1.k))
    attn = resolve_attention("dense")
    tok1 = tok2 = jnp.array([5, 9], jnp.int32)
    for _ in range(3):
        cache1, tok1 = bench_decode.greedy_step(one, cache1, tok1, attn)
        cache2, tok2 = bench_decode.greedy_step_on_mesh(model, cache2, tok2, decode_attention(attn, mesh), mesh)
        np.testing.assert_array_equal(np.asarray(tok2), np.asarray(tok1))


@pytest.mark.slow
def test_bench_decode_cli_on_two_devices(tmp_path, capsys):
    assert cli_main(["bench", "decode", "--devices", "2", "--batches", "1", "--contexts", "64", "--host-steps", "3",
                     "--reps", "1", "--variants", "default,reduce_attn", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("decode_*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["variant"], r["devices"]) for r in rows] == [("default", 2), ("reduce_attn", 2)]
    assert all("error" not in r and r["async_ms"] > 0 for r in rows), rows
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "decode", "--devices", "2", "--sequence-parallel", "2", "--variants", "reduce_attn"])
    assert e.value.code == 2
    assert "--variants: a sequence-parallel decode" in capsys.readouterr().err


@pytest.mark.parametrize("chunk", [16, 60])
def test_sequence_parallel_chunked_position_wise_work_stays_on_its_device(vl, chunk):
    """sp 2 with the norms / projections / MLP in chunks of 16 tokens (`models.common.map_chunks` under the
    mesh; 60: each device's 46 tokens fit one chunk, the 92 do not): the same prefill as one device, and no
    all-gather of a whole-sequence float array in the program."""
    cfg, model1, inputs = vl
    mesh = make_mesh(1, 2)
    model = sharded_model(cfg, mesh)
    t = inputs["input_ids"].shape[1]
    ref = mmjax.prefill(model1, inputs, max_length=t + 4, mlp_chunk=chunk)
    check_prefill(ref, mmjax.prefill(model, inputs, max_length=t + 4, mlp_chunk=chunk, mesh=mesh), t, mesh)
    p = qwen_vl.prepare_inputs(cfg, **inputs)
    _, vid = qwen_vl.visual_inputs(model, p)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    arrays = tuple(None if a is None else jax.device_put(a, rep)
                   for a in (p.input_ids, None, vid, p.position_ids, p.attention_mask, p.token_types, p.rope_deltas))
    slots = parallel_run.round_slots(t + 4, mesh)
    with jax.set_mesh(mesh):
        hlo = parallel_run.prefill_program.lower(
            qwen_vl.prefill_language_model, model, *arrays,
            attention=prefill_attention(resolve_attention("dense"), mesh, KV_HEADS, t), max_length=slots,
            hidden_layers=(), mlp_chunk=chunk, kv_dtype=None, mesh=mesh).compile().as_text()
    gathered = re.findall(rf"= (?:f32|bf16)\[1,{slots},[\d,]+\]\S* all-gather\(", hlo)
    assert gathered == [], gathered


@pytest.mark.parametrize("tp, sp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_llava_onevision_videos_split_by_frames_equal_one_device(tp, sp):
    """LLaVA-OneVision on a mesh: the video's 5 frames (not a multiple of 2: one zero frame pads) encoded
    split over the devices give the one-device features, and the prefill the one-device logits."""
    from mmjax.drivers.bench import prefill as bench_prefill
    from mmjax.parallel.vision import llava_video_features
    from models.llava_onevision import LlavaOnevision
    from models.llava_onevision import model as llava_ov

    cfg = bench_prefill.tiny_llava_config()
    one = LlavaOnevision(cfg, dtype=jnp.float32, key=jax.random.key(5))
    mesh = make_mesh(tp, sp)
    model = shard_model(LlavaOnevision(cfg, dtype=jnp.float32, key=jax.random.key(5)), mesh)
    inputs = bench_prefill.llava_video_inputs(cfg, 5 * 9 + 1, seed=2)
    inputs["pixel_values_videos"] = inputs["pixel_values_videos"].astype(np.float32)
    videos = jnp.asarray(inputs["pixel_values_videos"])
    assert videos.shape[1] == 5
    np.testing.assert_allclose(np.asarray(llava_video_features(model, videos, None, mesh)),
                               np.asarray(llava_ov.video_features(one, videos)), atol=2e-6)
    t = inputs["input_ids"].shape[1]
    ref = mmjax.prefill(one, inputs, max_length=t + 4)
    check_prefill(ref, mmjax.prefill(model, inputs, max_length=t + 4, mesh=mesh), t, mesh)


def test_text_lm_sequence_parallel_prefill_and_greedy_ids_equal_one_device():
    """A text LM (Llama fixture, 1-D positions, no token types) with its prompt split over sp 2 (right-padded
    to the cache's slots): the one-device logits, cache and greedy ids."""
    mesh = make_mesh(1, 2)
    model, _ = mmjax.load(case_dir("llama"), dtype=jnp.float32, mesh=mesh)
    ref, _ = mmjax.load(case_dir("llama"), dtype=jnp.float32)
    _, d = load_text_case("llama")
    inputs = row0(d)
    t = np.asarray(inputs["input_ids"]).shape[1]
    check_prefill(mmjax.prefill(ref, inputs, max_length=t + 5), mmjax.prefill(model, inputs, max_length=t + 5,
                                                                             mesh=mesh), t, mesh)
    np.testing.assert_array_equal(mmjax.generate(model, inputs, 5, mesh=mesh).tokens,
                                  mmjax.generate(ref, inputs, 5).tokens)
