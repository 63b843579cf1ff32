"""Nothing silent in mmjax.sparse: non-finite scores rank first in every estimating pattern
(the NaN then reaches exactly the rows that see it), hyper-parameters are bounded, kernel
options are checked, and configs / calibrations are saved atomically."""

import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax import Calibration, SparseConfig
from mmjax.sparse.patterns import AShape, Dense, Grid, KernelOptions, Momo, TriShape, VerticalSlash
from pallas_kernels.last_q_scores import last_q_scores
from tests.fault_injection import interrupt_every_step
from tests.pallas_kernels.helpers import random_qkv

SMALL = dict(block_q=32, block_k=16)
REF = KernelOptions(implementation="reference")
T = 128
J = 70  # the key that goes bad
ESTIMATING = [
    VerticalSlash(vertical_size=8, slash_size=8, last_q=16, keep_first=4, keep_local=16, **SMALL),
    Grid(stride_space=(24, 32), last_q=16, local=16, use_hline=False, **SMALL),
    Momo(gamma=4, block=16, k=2, k_exact=1, query_block=32, sink=16, local=16, topk="exact"),
]


@pytest.mark.parametrize("pattern", ESTIMATING, ids=lambda p: type(p).__name__)
def test_a_non_finite_key_is_kept_and_reaches_exactly_the_rows_after_it(pattern):
    """Estimation ranks the key with a non-finite score first, so the layout keeps it and the
    kernel poisons every row at or after its position, and no row before it."""
    q, k, v = random_qkv(0, 1, T, T, 2, 1, 16)
    k = k.at[0, J, 0, 3].set(jnp.nan)
    out = np.asarray(mmjax.sparse_attention(q, k, v, pattern, options=REF))
    rows_nan = np.isnan(out[0]).any(-1).any(-1)
    np.testing.assert_array_equal(rows_nan, np.arange(T) >= J)
    assert np.isnan(out[0, J:]).all()


@pytest.mark.parametrize("pattern", ESTIMATING[:2], ids=lambda p: type(p).__name__)
def test_a_non_finite_value_reaches_the_rows_whose_layout_holds_its_key(pattern):
    q, k, v = random_qkv(1, 1, T, T, 2, 1, 16)
    v = v.at[0, J, 0, 3].set(jnp.inf)
    mask = np.asarray(mmjax.build_layout(q, k, pattern).to_dense_mask())  # v does not change the estimate
    out = np.asarray(mmjax.sparse_attention(q, k, v, pattern, options=REF))
    sees = np.einsum("bnt->btn", mask[..., J])  # [B, T, N]
    np.testing.assert_array_equal(np.isnan(out).all(-1), np.broadcast_to(sees, out.shape[:3]))


def test_estimation_drops_a_non_finite_query_row_and_never_returns_nan():
    q, k, _ = random_qkv(2, 1, 64, 64, 1, 1, 16)
    bad_q = q.at[0, 60, 0, 1].set(jnp.inf)
    vertical, slash = last_q_scores(bad_q, k, last_q=8)
    assert not np.isnan(np.asarray(vertical)).any() and not np.isnan(np.asarray(slash)).any()
    assert np.isfinite(np.asarray(vertical)).all()  # the bad row adds nothing: no key is forced
    bad_k = k.at[0, 5, 0, 0].set(-jnp.inf)
    vertical, _ = last_q_scores(q, bad_k, last_q=8)
    vertical = np.asarray(vertical)[0, 0]
    assert vertical[5] == np.inf and np.isfinite(np.delete(vertical, 5)).all()


@pytest.mark.parametrize("make,match", [
    (lambda: AShape(local=10**12), r"local: expected an int <= 1073741824 \(int32 positions\); received 1000000000000"),
    (lambda: AShape(sink=2**31), r"sink: expected an int <= 1073741824"),
    (lambda: TriShape(last=10**15), r"last: expected an int <= 1073741824"),
    (lambda: VerticalSlash(vertical_size=2**40), r"vertical_size: expected an int <= 1073741824"),
    (lambda: Grid(local=2**33), r"local: expected an int <= 1073741824"),
    (lambda: Momo(k=2**35), r"k: expected an int <= 1073741824"),
    (lambda: Dense(block_q=2**40), r"block_q: expected a power of two <= 1073741824"),
    (lambda: KernelOptions(sm_scale="abc"), r"sm_scale: expected a finite positive float; received 'abc'"),
    (lambda: KernelOptions(sm_scale=float("nan")), r"sm_scale: expected a finite positive float; received nan"),
    (lambda: KernelOptions(implementation="cuda"), r"implementation: expected None, 'reference', 'triton' or 'mosaic_gpu'"),
])
def test_hyper_parameters_are_bounded_and_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_huge_but_legal_windows_build_small_lists():
    """A window far wider than the sequence is clipped to the key blocks (no overflow, no
    giant lists): AShape(local=2**30) is dense causal."""
    q, k, v = random_qkv(3, 1, 64, 64, 1, 1, 16)
    layout = mmjax.build_layout(q, k, AShape(sink=0, local=2**30, **SMALL))
    assert layout.max_blocks <= 2 * 4
    causal = np.arange(64)[None, :] <= np.arange(64)[:, None]
    np.testing.assert_array_equal(np.asarray(layout.to_dense_mask())[0, 0], causal)


def _config(local):
    return SparseConfig(((AShape(sink=16, local=local, **SMALL), Dense(**SMALL)),))


def test_sparse_config_save_interrupted_at_every_step(tmp_path, monkeypatch):
    """The audit case: a failed SparseConfig.save left a 0-byte file."""
    path = tmp_path / "config.json"
    _config(32).save(path)
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        _config(64).save(path)

    def check(n):
        assert [x.name for x in tmp_path.iterdir()] == ["config.json"]
        local = SparseConfig.load(path).layers[0][0].local
        return {32: "old", 64: "new"}[local]

    _, found = interrupt_every_step(monkeypatch, lambda: _config(64).save(path, overwrite=True), check,
                                    reset=lambda: _config(32).save(path, overwrite=True))
    assert found[0] == "old" and "new" in found
    path.write_bytes(b'{"schema_version": 1, "x": "\xe9"}')
    with pytest.raises(ValueError, match=r"config.json: not UTF-8 text"):
        SparseConfig.load(path)


def test_calibration_save_interrupted_at_every_step(tmp_path, monkeypatch):
    def cal(seed):
        q, k, v = random_qkv(seed, 1, 32, 32, 2, 1, 16)
        return Calibration(((q, k, v),))

    old, new = cal(0), cal(1)
    path = tmp_path / "cal.npz"
    old.save(path)
    q0 = {"old": np.asarray(old.layers[0][0]), "new": np.asarray(new.layers[0][0])}

    def check(n):
        assert [x.name for x in tmp_path.iterdir()] == ["cal.npz"]
        got = np.asarray(Calibration.load(path).layers[0][0])
        return next(tag for tag, x in q0.items() if np.array_equal(got, x))

    _, found = interrupt_every_step(monkeypatch, lambda: new.save(path, overwrite=True), check,
                                    reset=lambda: old.save(path, overwrite=True), extras=[(np, "savez")])
    assert found[0] == "old" and "new" in found
    with pytest.raises(ValueError, match=r"calibration k_0: expected finite values .* index \[0, 4, 0, 2\]"):
        Calibration(((old.layers[0][0], old.layers[0][1].at[0, 4, 0, 2].set(jnp.nan), old.layers[0][2]),))

