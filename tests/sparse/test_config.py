"""SparseConfig: JSON round trip, malformed files fail with a message naming the place,
and the per-layer hook the models call runs the layer's per-head patterns."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax import SparseConfig
from mmjax.sparse.patterns import AShape, Dense, Grid, KernelOptions, TriShape, VerticalSlash
from mmjax.sparse.patterns.momo import Momo
from models.attention import dense_attention, resolve_attention
from tests.pallas_kernels.helpers import random_qkv

SMALL = dict(block_q=32, block_k=16)
REF = KernelOptions(implementation="reference")


def _config():
    a = AShape(sink=16, local=48, **SMALL)
    vs = VerticalSlash(vertical_size=16, slash_size=16, last_q=16, keep_first=8, keep_local=16, max_blocks=7, **SMALL)
    g = Grid(stride_space=(48, 64), last_q=16, local=32, use_hline=False, **SMALL)
    return SparseConfig(((a, vs, g, Dense(**SMALL)),
                         (TriShape(sink=8, local=32, last=16, **SMALL), a, a, Momo(k=4, k_exact=2, k_trim=None))))


def test_round_trip_through_file(tmp_path):
    cfg = _config()
    path = tmp_path / "cfg.json"
    cfg.save(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 2 and data["num_layers"] == 2 and data["num_heads"] == 4
    assert data["layers"][0][2] == {"pattern": "Grid", "params": {
        "stride": "search", "use_hline": False, "use_vline": True, "use_slash": True, "max_stride": 1024,
        "local": 32, "phases": 1, "sink": 0, "last_q": 16, "stride_space": [48, 64], "block_q": 32, "block_k": 16,
        "frame_first": True}}
    back = SparseConfig.load(path)
    assert back == cfg and back.layers[0][2].stride_space == (48, 64)
    assert SparseConfig.from_json(back.to_json()) == cfg
    uni = SparseConfig.uniform(Dense(), num_layers=3, num_heads=2)
    assert SparseConfig.from_json(uni.to_json()) == uni and uni.num_layers == 3 and uni.num_heads == 2


def _good():
    return _config().to_dict()


def _edit(fn):
    d = _good()
    fn(d)
    return d


MALFORMED = [
    (lambda d: d.pop("schema_version"), "schema_version: missing; expected 2"),
    (lambda d: d.update(schema_version=3), r"schema_version: expected one of \(1, 2\); received 3"),
    (lambda d: d.update(extra=1), "unexpected keys"),
    (lambda d: d.update(num_heads=5), r"layers\[0\]: expected a list of num_heads=5 head patterns; received 4"),
    (lambda d: d["layers"][1].pop(), r"layers\[1\]: expected a list of num_heads=4 head patterns; received 3"),
    (lambda d: d.update(num_layers=3), "layers: expected a list of num_layers=3 layers; received 2"),
    (lambda d: d.update(num_heads="4"), "num_heads: expected an int >= 1"),
    (lambda d: d["layers"][0].__setitem__(1, {"pattern": "Diagonal", "params": {}}),
     r"layers\[0\]\[1\]\.pattern: expected one of \[.*'VerticalSlash'\]; received 'Diagonal'"),
    (lambda d: d["layers"][0][0]["params"].update(window=3),
     r"layers\[0\]\[0\] \(AShape\)\.params: unknown parameter\(s\) \['window'\]"),
    (lambda d: d["layers"][0][0]["params"].update(local=0),
     r"layers\[0\]\[0\] \(AShape\)\.local: expected an int >= 1; received 0"),
    (lambda d: d["layers"][0][0]["params"].update(local="64"),
     r"layers\[0\]\[0\] \(AShape\)\.local: expected int; received '64'"),
    (lambda d: d["layers"][0][2]["params"].update(use_slash=1),
     r"layers\[0\]\[2\] \(Grid\)\.use_slash: expected bool; received 1"),
    (lambda d: d["layers"][0][2]["params"].update(stride_space=[48, "x"]),
     r"layers\[0\]\[2\] \(Grid\)\.stride_space: expected tuple\[int\]"),
    (lambda d: d["layers"][1][3]["params"].update(topk="best"), r"layers\[1\]\[3\] \(Momo\)\.topk: expected one of"),
    (lambda d: d["layers"][0].__setitem__(0, ["AShape"]), r"layers\[0\]\[0\]: expected an object"),
]


@pytest.mark.parametrize("edit,match", MALFORMED)
def test_malformed_config_fails_with_clear_message(tmp_path, edit, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_edit(edit)))
    with pytest.raises(ValueError, match=match):
        SparseConfig.load(path)


def test_not_json_and_bad_construction(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{schema_version: 1")
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON \(Expecting property name"):
        SparseConfig.load(path)
    with pytest.raises(ValueError, match=r"layers\[1\]: expected 2 heads \(as layers\[0\]\); received 1"):
        SparseConfig(((Dense(), Dense()), (Dense(),)))
    with pytest.raises(ValueError, match=r"layers\[0\]\[1\]: expected an mmjax.sparse.patterns pattern"):
        SparseConfig(((Dense(), "grid"),))
    with pytest.raises(ValueError, match=r"layer_idx: expected an int in \[0, 2\)"):
        _config().layer_attention(2)


def test_layer_attention_plugs_into_the_model_hook():
    cfg = SparseConfig(((AShape(sink=16, local=32, **SMALL), Dense(**SMALL), Dense(**SMALL), AShape(sink=16, local=32, **SMALL)),
                        (Dense(**SMALL),) * 4), options=REF)
    q, k, v = random_qkv(2, 1, 96, 96, 4, 2, 16)
    types = jnp.asarray(np.repeat([[0, 2, 2, 0]], 24, axis=1).reshape(1, 96), jnp.int32)
    attn = resolve_attention(cfg)
    assert attn.scannable  # one body for every layer: the traced layer index picks the plan
    pos, valid = jnp.arange(96)[None], jnp.ones((1, 96), bool)
    out = attn.for_layer(0)(q, k, v, layer=0, q_positions=pos, kv_valid=valid, modality=types)
    want = mmjax.sparse_attention(q, k, v, cfg.layers[0], types, options=REF)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)
    traced = jax.jit(lambda layer: attn.uniform(q, k, v, layer=layer, q_positions=pos, kv_valid=valid,
                                                modality=types))
    np.testing.assert_allclose(np.asarray(traced(0)), np.asarray(want), atol=1e-6)
    np.testing.assert_allclose(np.asarray(traced(1)), np.asarray(dense_attention(q, k, v, q_positions=pos,
                                                                                 kv_valid=valid)), atol=2e-5)
    per_layer = cfg.layer_attention(0)(q, k, v, layer=0, q_positions=pos, kv_valid=valid, modality=types)
    np.testing.assert_allclose(np.asarray(per_layer), np.asarray(want), atol=1e-6)
    dense = dense_attention(q, k, v, q_positions=pos, kv_valid=valid)
    assert np.abs(np.asarray(out) - np.asarray(dense)).max() > 1e-3  # layer 0 is sparse
    out1 = attn.for_layer(1)(q, k, v, layer=1, q_positions=pos, kv_valid=valid, modality=types)
    np.testing.assert_allclose(np.asarray(out1), np.asarray(dense), atol=2e-5)
    # Decode over a cache (T != S) is exact dense attention with the cache's validity mask.
    qd, valid_d = q[:, -1:], valid.at[:, 80:].set(False)
    got = attn.for_layer(0)(qd, k, v, layer=0, q_positions=jnp.array([[79]]), kv_valid=valid_d, modality=None)
    want_d = dense_attention(qd, k, v, q_positions=jnp.array([[79]]), kv_valid=valid_d)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want_d))
    with pytest.raises(ValueError, match=r"q: expected \[B, T, N=4, D\]"):
        attn.for_layer(0)(q[:, :, :2], k[:, :, :1], v[:, :, :1], layer=0, q_positions=pos, kv_valid=valid,
                          modality=types)
    # A padded prefill (kv_valid not all true) is exact dense attention, never a sparse
    # result that ignores the padding.
    pad_valid = valid.at[:, :10].set(False)
    got_p = attn.for_layer(0)(q, k, v, layer=0, q_positions=pos, kv_valid=pad_valid, modality=types)
    want_p = dense_attention(q, k, v, q_positions=pos, kv_valid=pad_valid)
    np.testing.assert_allclose(np.asarray(got_p), np.asarray(want_p), atol=1e-6)


def _wrapped_config():
    from mmjax.sparse.patterns import KBoundary, NoBoundary, QBoundary, TwoDBoundary
    a = AShape(sink=16, local=48, **SMALL)
    return SparseConfig(((NoBoundary(Dense(**SMALL)), KBoundary(a),
                          QBoundary({"video": Grid(stride_space=(48,), **SMALL)}, default=a),
                          TwoDBoundary({("video", "text"): a, ("text", "text"): Dense(**SMALL)}, default=a)),))


def test_round_trip_with_boundary_wrappers(tmp_path):
    cfg = _wrapped_config()
    cfg.save(tmp_path / "w.json")
    data = json.loads((tmp_path / "w.json").read_text())
    assert data["layers"][0][1]["params"]["pattern"]["pattern"] == "AShape"
    assert {e["query"] for e in data["layers"][0][3]["params"]["patterns"]} == {"video", "text"}
    assert data["layers"][0][3]["params"]["default"]["pattern"] == "AShape"
    assert data["layers"][0][3]["params"]["skip_missing"] is False
    assert SparseConfig.load(tmp_path / "w.json") == cfg
    # skip_missing round-trips; files written before default / skip_missing existed still load.
    from mmjax.sparse.patterns import TwoDBoundary
    skip = SparseConfig(((TwoDBoundary({("video", "text"): Dense(**SMALL)}, skip_missing=True),),))
    assert SparseConfig.from_json(skip.to_json()) == skip
    old = skip.to_dict()
    del old["layers"][0][0]["params"]["default"], old["layers"][0][0]["params"]["skip_missing"]
    assert SparseConfig.from_dict(old).layers[0][0] == TwoDBoundary({("video", "text"): Dense(**SMALL)})


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["layers"][0][1]["params"].pop("pattern"), r"layers\[0\]\[1\] \(KBoundary\)\.params: missing"),
    (lambda d: d["layers"][0][1]["params"]["pattern"]["params"].update(local=-1),
     r"layers\[0\]\[1\] \(KBoundary\)\.pattern \(AShape\)\.local: expected an int >= 1"),
    (lambda d: d["layers"][0][2]["params"].update(patterns=[1]),
     r"layers\[0\]\[2\] \(QBoundary\)\.patterns: expected an object"),
    (lambda d: d["layers"][0][2]["params"]["patterns"].update(audio={"pattern": "Nope"}),
     r"layers\[0\]\[2\] \(QBoundary\)\.patterns\['audio'\]\.pattern: expected one of"),
    (lambda d: d["layers"][0][3]["params"]["patterns"][0].pop("key"),
     r"layers\[0\]\[3\] \(TwoDBoundary\)\.patterns: expected a list of"),
    (lambda d: d["layers"][0][3]["params"].update(extra=1), r"\(TwoDBoundary\)\.params: unknown parameter"),
    (lambda d: d["layers"][0][3]["params"].update(skip_missing=1), r"\(TwoDBoundary\)\.skip_missing: expected bool"),
    (lambda d: d["layers"][0][3]["params"].update(skip_missing=True),
     r"\(TwoDBoundary\)\.default / skip_missing: expected at most one"),
])
def test_malformed_wrapper_fails_with_clear_message(edit, match):
    d = _wrapped_config().to_dict()
    edit(d)
    with pytest.raises(ValueError, match=match):
        SparseConfig.from_dict(d)


def test_prefill_with_a_config_runs_the_tiny_vlm():
    """A config's logits equal the model's logits with exactly the built masks: layer 1 heads
    0-1 run QBoundary (video rows: a 16-token window, text rows: dense causal), everything else
    dense. The expected run injects masked dense attention per head, not the sparse kernels."""
    import jax

    from mmjax.inference import prefill
    from mmjax.sparse.patterns import QBoundary
    from models.qwen2_5_vl import Qwen2_5_VL
    from tests.models.helpers import small_config, video_prompt
    from tests.pallas_kernels.helpers import masked_dense_attention

    cfg = small_config()
    model = Qwen2_5_VL(cfg, dtype=jnp.float32, key=jax.random.key(7))
    inputs = video_prompt(cfg, frames=12, rng=np.random.default_rng(0))  # 102 tokens, 96 video
    dense = np.asarray(prefill(model, inputs).logits)
    uniform = SparseConfig.uniform(Dense(**SMALL), num_layers=3, num_heads=4, options=REF)
    np.testing.assert_allclose(np.asarray(prefill(model, inputs, attention=uniform).logits), dense, atol=1e-4)
    q_video_sparse = QBoundary({"video": AShape(sink=0, local=16, **SMALL)}, default=Dense(**SMALL))
    mixed = SparseConfig(((Dense(**SMALL),) * 4, (q_video_sparse, q_video_sparse, Dense(**SMALL), Dense(**SMALL)),
                          (Dense(**SMALL),) * 4), options=REF)
    got = np.asarray(prefill(model, inputs, attention=mixed).logits)

    def masked_layer(q, k, v, *, layer, q_positions, kv_valid, modality):
        t = q.shape[1]
        causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
        window = mmjax.build_layout(q[:, :, :2], k, q_video_sparse, modality).to_dense_mask()  # [B, 2|1, T, S]
        mask = jnp.concatenate([jnp.broadcast_to(window, (q.shape[0], 2, t, t)),
                                jnp.broadcast_to(causal, (q.shape[0], 2, t, t))], axis=1)
        return masked_dense_attention(q, k, v, mask)[0].astype(q.dtype)

    def plain(q, k, v, *, layer, q_positions, kv_valid, modality):
        return dense_attention(q, k, v, q_positions=q_positions, kv_valid=kv_valid)

    want = np.asarray(prefill(model, inputs, attention=[plain, masked_layer, plain]).logits)
    np.testing.assert_allclose(got, want, atol=1e-4)
    # The masks matter: video rows really lose keys (the result is not the dense one).
    assert np.abs(got - dense).max() > 1e-3


# A file in schema version 1 (what the version before the Grid family wrote), verbatim.
V1_JSON = """{"schema_version": 1, "num_layers": 1, "num_heads": 4, "layers": [[
 {"pattern": "Grid", "params": {"stride_space": [48, 64], "max_stride": 1024, "use_hline": false,
  "use_vline": true, "use_slash": true, "last_q": 16, "local": 32, "phases": 1, "block_q": 32, "block_k": 16}},
 {"pattern": "Grid", "params": {"stride_space": [64], "use_hline": true, "use_vline": true, "use_slash": false}},
 {"pattern": "Momo", "params": {"gamma": 16, "block": 64, "k": 4, "k_exact": 2, "k_trim": null,
  "query_block": 128, "topk": "estimated", "sink": 64, "local": 128}},
 {"pattern": "QBoundary", "params": {"patterns": {"video": {"pattern": "Grid", "params": {"stride_space": [48],
  "max_stride": 1024, "use_hline": true, "use_vline": true, "use_slash": true, "last_q": 64, "local": 1024,
  "phases": 1, "block_q": 128, "block_k": 64}}}, "default": {"pattern": "AShape", "params": {"sink": 128,
  "local": 4096, "block_q": 128, "block_k": 64}}}}]]}"""


def test_version_1_json_loads_with_its_meaning():
    """v1 Grid: use_slash was the local band -> local (0 when off), no stride diagonals,
    stride searched; v1 Momo ranked by mean score."""
    cfg = SparseConfig.from_json(V1_JSON)
    g0, g1, momo, qb = cfg.layers[0]
    assert g0 == Grid(stride="search", stride_space=(48, 64), use_hline=False, use_vline=True, use_slash=False,
                      last_q=16, local=32, **SMALL)
    assert g1 == Grid(stride="search", stride_space=(64,), use_hline=True, use_vline=True, use_slash=False, local=0)
    assert momo.trim_rule == "mean" and momo.k == 4
    video = dict(qb.patterns)["video"]
    assert video == Grid(stride="search", stride_space=(48,), use_slash=False, local=1024)
    assert SparseConfig.from_json(cfg.to_json()) == cfg  # saved again as version 2
    assert json.loads(cfg.to_json())["schema_version"] == 2


def test_every_table3_variant_round_trips():
    from mmjax.sparse.pattern_search import SearchSpace
    cands = SearchSpace().candidates(frame_tokens=192)
    grids = [c for c in cands if isinstance(c, Grid)]
    assert len(cands) == 24 and len(grids) == 12 and {g.stride for g in grids} == {"frame", "search"}
    cfg = SparseConfig((tuple(cands),))
    assert SparseConfig.from_json(cfg.to_json()) == cfg
