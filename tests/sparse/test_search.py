"""mmjax.search (MMInference Algorithm 4): planted boundary types are found, the budget
excludes candidates, calibration files and the CLI round-trip, bad inputs name themselves."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax import Calibration, CalibrationRecorder, Modality, SearchSpace, SparseConfig
from mmjax.drivers.cli import main as cli_main
from mmjax.sparse.patterns import AShape, Grid, KBoundary, KernelOptions, NoBoundary, QBoundary, TwoDBoundary
from mmjax.sparse.synthetic import interleaved_kinds, planted_qkv
from models.attention import dense_attention

REF = KernelOptions(implementation="reference")
NAMES = ("text", "video")
SPACE = SearchSpace(ashape=((16, 32), (128, 32)), vertical_slash=(), grid_local=(32,), grid_sink=8,
                    grid_flags=((False, True, False),), grid_strides=("search",), grid_stride_space=(32, 48, 64, 96, 128), last_q=16,
                    block_q=32, block_k=16)


def _planted(plants, s=512, seed=0, text_keys=None):
    """Frames of 48 video tokens after text segments of 16 (25% text, MM-NIAH-like)."""
    kinds = interleaved_kinds(s, frame_tokens=48, text_tokens=16, video_id=1)
    q, k, v = planted_qkv(jax.random.PRNGKey(seed), kinds, plants, head_dim=32, frame_tokens=48, text_tokens=16,
                          text_keys=text_keys)
    return Calibration(((q, k, v),), Modality.from_token_types(kinds[None], names=NAMES))


def test_search_finds_the_planted_boundary_types():
    cal = _planted(("none", "k", "q", "2d"))
    config, report = mmjax.search(cal, space=SPACE, budget=0.9, options=REF, progress=False, return_report=True)
    none, kb, qb, two = config.layers[0]
    assert isinstance(none, NoBoundary) and isinstance(none.pattern, Grid)  # lines for every row
    assert kb == KBoundary(AShape(sink=128, local=32, block_q=32, block_k=16))  # all text keys as sinks
    assert isinstance(qb, QBoundary)
    qp = dict(qb.patterns)
    assert isinstance(qp["video"], Grid) and qp["text"] == AShape(sink=16, local=32, block_q=32, block_k=16)
    assert isinstance(two, TwoDBoundary)
    tp = dict(two.patterns)
    assert isinstance(tp[("video", "video")], Grid)
    assert tp[("text", "text")] == AShape(sink=128, local=32, block_q=32, block_k=16)
    for h, row in enumerate(report[0]):
        assert row[row["choice"]]["error"] < 0.05  # the planted structure is captured
        assert all(row[t]["cost"] <= row["budget"] for t in row if isinstance(row[t], dict) and row[t]["pattern"])
    # The chosen plans run as a SparseConfig and match their own masks' dense attention.
    q, k, v = cal.layers[0]
    out = mmjax.sparse_attention(q, k, v, config.layers[0], cal.modality, options=REF)
    ref = dense_attention(q, k, v, q_positions=jnp.arange(512)[None], kv_valid=jnp.ones((1, 512), bool))
    err = np.linalg.norm(np.asarray(out - ref), axis=(1, 3)) / np.linalg.norm(np.asarray(ref), axis=(1, 3))
    assert err.max() < 0.05


def test_budget_excludes_candidates_over_it():
    cal = _planted(("k", "k"), s=256, seed=3, text_keys=32)  # text keys at positions 0-15 and 64-79
    space = SearchSpace(ashape=((16, 32), (128, 32)), vertical_slash=(), grid_local=(), grid_flags=(),
                        boundaries=("NoBoundary",), block_q=32, block_k=16)
    big, rep_big = mmjax.search(cal, space=space, budget=2.0, options=REF, progress=False, return_report=True)
    assert big.layers[0][0] == NoBoundary(AShape(sink=128, local=32, block_q=32, block_k=16))
    small_budget = AShape(sink=16, local=32, block_q=32, block_k=16)
    small, rep = mmjax.search(cal, space=space, budget=small_budget, options=REF, progress=False,
                              return_report=True)
    assert small.layers[0][0] == NoBoundary(small_budget)  # the better, costlier sink is excluded
    assert rep[0][0]["NoBoundary"]["cost"] <= rep[0][0]["budget"] < rep_big[0][0]["NoBoundary"]["cost"]
    tiny, rep = mmjax.search(cal, space=space, budget=1e-4, options=REF, progress=False, return_report=True)
    assert rep[0][0]["choice"].startswith("fallback") and tiny.layers[0][0] == NoBoundary(small_budget)


def test_calibration_npz_and_cli_round_trip(tmp_path, capsys):
    cal = _planted(("q", "none"), s=192, seed=5)
    path = tmp_path / "cal.npz"
    cal.save(path)
    back = Calibration.load(path)
    assert back.modality.names == NAMES and back.num_layers == 1 and back.num_heads == 2
    np.testing.assert_array_equal(np.asarray(back.modality.ids), np.asarray(cal.modality.ids))
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"ashape": [[16, 32]], "vertical_slash": [], "grid_local": [], "grid_flags": [],
                                 "boundaries": ["NoBoundary", "QBoundary"], "block_q": 32, "block_k": 16}))
    out = tmp_path / "config.json"
    assert cli_main(["search", "--calibration", str(path), "--out", str(out), "--space", str(space),
                     "--budget", "1.0", "--implementation", "reference", "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    config = SparseConfig.load(out)
    assert config.num_layers == 1 and config.num_heads == 2
    a = AShape(sink=16, local=32, block_q=32, block_k=16)
    assert all(p in (NoBoundary(a), QBoundary({"text": a, "video": a}, default=a)) for p in config.layers[0])
    direct = mmjax.search(path, space=SearchSpace(ashape=((16, 32),), vertical_slash=(), grid_local=(),
                                                  grid_flags=(), boundaries=("NoBoundary", "QBoundary"),
                                                  block_q=32, block_k=16),
                          budget=1.0, options=REF, progress=False)
    assert direct == config


def test_recorder_captures_layers_under_jit():
    rec = CalibrationRecorder(max_tokens=8)
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 4, 8))
    k = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 2, 8))
    kinds = jnp.asarray([[0] * 6 + [2] * 10], jnp.int32)
    pos, valid = jnp.arange(16)[None], jnp.ones((1, 16), bool)
    for layer in range(2):
        fn = rec.layer_attention(layer)
        out = jax.jit(lambda q, k: fn(q, k, k, layer=layer, q_positions=pos, kv_valid=valid, modality=kinds))(q, k)
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense_attention(q, k, k, q_positions=pos,
                                                                               kv_valid=valid)), rtol=1e-4, atol=1e-5)
    cal = rec.calibration()
    assert cal.num_layers == 2 and np.shape(cal.layers[1][0]) == (1, 8, 4, 8)
    np.testing.assert_array_equal(np.asarray(cal.layers[0][1]), np.asarray(k))
    assert cal.modality.spans == (((0, 0, 6), (2, 6, 16)),)


BAD = [
    (lambda a: a.pop("v_0"), r"calibration: missing \['v_0'\]"),
    (lambda a: a.update(k_0=a["k_0"][..., :4], v_0=a["v_0"][..., :4]), r"calibration k_0: expected \[B=1, S>=64, K dividing N=2, D=8\]"),
    (lambda a: a.update(q_0=a["q_0"][0]), r"calibration q_0: expected \[B, T, N, D\]; received shape \[64, 2, 8\]"),
    (lambda a: a.update(q_1=a["q_0"]), r"calibration: missing \['k_1', 'v_1'\]"),
    (lambda a: a.update(modality=a["modality"][:, :10]), r"modality: expected ids of shape \[1, 64\]"),
    (lambda a: a.update(extra=1), r"calibration: unexpected key 'extra'"),
    (lambda a: a.update(modality=a["modality"].astype(np.float32)), r"calibration modality: expected integer ids"),
    (lambda a: a.pop("modality"), r"modality: expected per-token modality ids"),
    (lambda a: a.update(v_0=a["v_0"].astype(np.int32)), r"calibration v_0: expected a float dtype"),
]


@pytest.mark.parametrize("edit,match", BAD)
def test_malformed_calibration_names_the_argument(edit, match):
    rng = np.random.default_rng(0)
    arrays = {"q_0": rng.normal(size=(1, 64, 2, 8)).astype(np.float32),
              "k_0": rng.normal(size=(1, 64, 1, 8)).astype(np.float32),
              "v_0": rng.normal(size=(1, 64, 1, 8)).astype(np.float32),
              "modality": np.zeros((1, 64), np.int32)}
    edit(arrays)
    with pytest.raises(ValueError, match=match):
        mmjax.search(arrays, space=SPACE, options=REF, progress=False)


def test_bad_search_arguments(tmp_path):
    cal = _planted(("none",), s=128)
    with pytest.raises(ValueError, match="space: expected a SearchSpace"):
        mmjax.search(cal, space={"ashape": []}, progress=False)
    with pytest.raises(ValueError, match=r"budget: expected None, a Pattern or a density > 0"):
        mmjax.search(cal, space=SPACE, budget=-1.0, options=REF, progress=False)
    with pytest.raises(ValueError, match=r"boundaries: expected a non-empty subset"):
        SearchSpace(boundaries=("Diagonal",))
    with pytest.raises(ValueError, match=r"ashape: expected a tuple of \(int, int\) pairs"):
        SearchSpace(ashape=((1, 2, 3),))
    with pytest.raises(ValueError, match="space: expected at least one candidate"):
        SearchSpace(ashape=(), vertical_slash=(), grid_local=())
    with pytest.raises(ValueError, match=r"modality: expected ids of shape \[1, 128\]"):
        mmjax.search(cal, modality=np.zeros((1, 7), np.int32), space=SPACE, options=REF, progress=False)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"bad.npz: cannot read a calibration .npz"):
        mmjax.search(str(bad), progress=False)
