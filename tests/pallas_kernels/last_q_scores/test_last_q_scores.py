"""`last_q_scores` against its definition written out in NumPy (the softmax of the estimation rows over their causal,
valid keys; column sums and sums along each offset) for the reference (every number of query heads scored per step,
GQA, chosen rows, invalid keys) and the Triton kernel in interpret mode; the kernel against the reference on more
shapes (ragged S, row counts that are not a power of two, several tiles per program, fp16 / bf16), chosen rows within
and beyond the kernel's span, with non-finite inputs and rows that see no key; the argument checks; `diagonal_sums`
and `heads_per_step`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.last_q_scores import last_q_scores
from pallas_kernels.last_q_scores.reference import STEP_BYTES, diagonal_sums, heads_per_step
from pallas_kernels.last_q_scores.triton import last_q_scores_triton
from tests.pallas_kernels.helpers import random_qkv


def _scores(q, k, last_q, rows=None, k_valid=None):
    """NumPy float64 (vertical, slash) ``[B, N, S]``."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    rows = np.broadcast_to(np.arange(t - last_q, t), (b, last_q)) if rows is None else np.asarray(rows)
    valid = np.ones((b, s), bool) if k_valid is None else np.asarray(k_valid)
    vertical, slash = np.zeros((b, n, s)), np.zeros((b, n, s))
    for bi in range(b):
        for h in range(n):
            for r in rows[bi]:
                pos = r + s - t
                keys = np.flatnonzero((np.arange(s) <= pos) & valid[bi])
                if not len(keys):
                    continue
                logit = k[bi, keys, h // (n // kh)] @ q[bi, r, h] / np.sqrt(d)
                a = np.exp(logit - logit.max())
                a /= a.sum()
                vertical[bi, h, keys] += a / last_q
                slash[bi, h, pos - keys] += a / last_q
    return vertical, slash


def _forms(form):
    rng = np.random.default_rng(5)
    return {"last rows": {}, "chosen rows": {"rows": rng.integers(0, 40, (2, 6)).astype(np.int32)},
            "invalid keys": {"k_valid": rng.random((2, 72)) > 0.3}}[form]


@pytest.mark.parametrize("step_heads", [1, 2, 4, None])
@pytest.mark.parametrize("form", ["last rows", "chosen rows", "invalid keys"])
def test_reference_matches_the_definition(step_heads, form):
    q, k, _ = random_qkv(4, 2, 40, 72, 8, 2, 16)  # 4 query heads per key / value head
    kw = _forms(form)
    vertical, slash = last_q_scores(q, k, last_q=6, step_heads=step_heads, implementation="reference", **kw)
    want_v, want_s = _scores(q, k, 6, **kw)
    np.testing.assert_allclose(np.asarray(vertical), want_v, atol=2e-6)
    np.testing.assert_allclose(np.asarray(slash), want_s, atol=2e-6)


@pytest.mark.parametrize("form", ["last rows", "chosen rows", "invalid keys"])
def test_kernel_matches_the_definition(form):
    q, k, _ = random_qkv(4, 2, 40, 72, 8, 2, 16)
    kw = _forms(form)
    vertical, slash = last_q_scores(q, k, last_q=6, implementation="triton", interpret=True, **kw)
    want_v, want_s = _scores(q, k, 6, **kw)
    np.testing.assert_allclose(np.asarray(vertical), want_v, atol=2e-6)
    np.testing.assert_allclose(np.asarray(slash), want_s, atol=2e-6)


def _assert_same(got, want, atol):
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == np.float32
        assert not np.isnan(g).any()
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w))
        fin = np.isfinite(w)
        np.testing.assert_allclose(g[fin], w[fin], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("b,t,s,n,kh,d,last_q,dtype,tiles", [
    (1, 100, 300, 8, 2, 24, 64, jnp.float32, {}),  # ragged S, padded D, 64 rows
    (2, 50, 50, 4, 4, 16, 20, jnp.float32, {}),  # T = S, 20 rows padded to 32, no GQA
    (1, 64, 517, 6, 3, 32, 16, jnp.bfloat16, {"lanes": 2, "chunks": 3}),  # several tiles per program
    (1, 33, 200, 4, 1, 16, 33, jnp.float16, {"block_k": 128, "stats_block": 64}),  # every query a row
])
def test_kernel_matches_the_reference(b, t, s, n, kh, d, last_q, dtype, tiles):
    q, k, _ = random_qkv(t + s, b, t, s, n, kh, d, dtype)
    valid = np.random.default_rng(s).random((b, s)) > 0.2
    for k_valid in (None, jnp.asarray(valid)):
        want = last_q_scores(q, k, last_q=last_q, k_valid=k_valid, implementation="reference")
        got = last_q_scores_triton(q, k, last_q=last_q, sm_scale=d ** -0.5, k_valid=k_valid, interpret=True,
                                   **tiles)
        _assert_same(got, want, 2e-6)


def test_chosen_rows_too_spread_for_the_kernel_go_through_the_reference():
    """Traced rows: `lax.cond` on their span (at most 64 positions for the kernel's scratch) picks the kernel or the
    reference; both must give the definition, repeated rows included. Concrete rows too spread are an error when
    the kernel is asked for by name."""
    q, k, _ = random_qkv(8, 2, 200, 260, 4, 2, 16)
    near = np.stack([np.arange(150, 158), np.array([199, 140, 170, 170, 136, 180, 190, 150])]).astype(np.int32)
    far = near.copy()
    far[1, 4] = 3  # a span of 196 in batch row 1
    run = jax.jit(lambda q, k, rows: last_q_scores(q, k, last_q=8, rows=rows, implementation="triton",
                                                   interpret=True))
    for rows in (near, far):
        want_v, want_s = _scores(q, k, 8, rows=rows)
        vertical, slash = run(q, k, rows)
        np.testing.assert_allclose(np.asarray(vertical), want_v, atol=2e-6)
        np.testing.assert_allclose(np.asarray(slash), want_s, atol=2e-6)
    with pytest.raises(ValueError, match=r"^rows: expected indices spanning at most 64 positions"):
        last_q_scores(q, k, last_q=8, rows=far, implementation="triton", interpret=True)


def test_kernel_follows_the_non_finite_rules_and_empty_rows():
    """A NaN query row adds nothing, an inf key is ranked first (+inf vertical) by the rows that see it, and a batch
    whose keys are all invalid scores 0: as the reference."""
    q, k, _ = random_qkv(9, 2, 24, 90, 4, 2, 16)
    q = q.at[0, 20, 1, 3].set(jnp.nan)  # one estimation row of head 1
    k = k.at[0, 30, 0, 5].set(jnp.inf).at[1, 89, 1, 0].set(jnp.nan)  # seen by every row / by the last row only
    k_valid = jnp.ones((2, 90), bool).at[1].set(False)
    for kv in (None, k_valid):
        want = last_q_scores(q, k, last_q=8, k_valid=kv, implementation="reference")
        got = last_q_scores(q, k, last_q=8, k_valid=kv, implementation="triton", interpret=True)
        _assert_same(got, want, 2e-6)
    vertical, slash = got
    assert np.isinf(np.asarray(vertical)[0, :2, 30]).all()  # heads 0 and 1 read key / value head 0
    assert np.isfinite(np.asarray(vertical)[0, 2:]).all()
    assert float(np.abs(np.asarray(vertical)[1]).max()) == 0.0 and float(np.abs(np.asarray(slash)[1]).max()) == 0.0
    np.testing.assert_allclose(np.asarray(slash)[0, 1].sum(), 7 / 8, rtol=1e-5)  # 7 of head 1's 8 rows take part


@pytest.mark.parametrize("lq, s", [(1, 9), (5, 5), (6, 40), (16, 23)])
def test_diagonal_sums_match_their_definition(lq, s):
    a = np.random.default_rng(lq * s).standard_normal((2, 3, lq, s)).astype(np.float32)
    want = np.zeros((2, 3, s))
    for r in range(lq):
        for d in range(s):
            if s - lq + r - d >= 0:
                want[..., d] += a[..., r, s - lq + r - d]
    np.testing.assert_allclose(np.asarray(diagonal_sums(a)), want, atol=1e-5)


def test_the_last_rows_named_give_what_the_default_gives():
    """rows=None sums diagonals without a gather (`diagonal_sums`); the same rows named go through the gather."""
    q, k, _ = random_qkv(6, 1, 24, 56, 4, 2, 16)
    rows = np.arange(24 - 8, 24, dtype=np.int32)[None]
    for got, want in zip(last_q_scores(q, k, last_q=8, implementation="reference"),
                         last_q_scores(q, k, last_q=8, rows=rows), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


@pytest.mark.parametrize("kw, match", [
    ({"last_q": 0}, r"^last_q: expected an int with 1 <= last_q <= T=16"),
    ({"last_q": 17}, r"^last_q: expected an int with 1 <= last_q <= T=16"),
    ({"last_q": True}, r"^last_q: expected an int with 1 <= last_q <= T=16"),
    ({"last_q": 4, "rows": np.zeros((1, 3), np.int32)}, r"^rows: expected an integer array of shape \[1, 4\]"),
    ({"last_q": 4, "k_valid": np.ones((1, 16), np.int32)}, r"^k_valid: expected a bool array of shape \[1, 16\]"),
    ({"last_q": 4, "implementation": "mosaic"}, r"^implementation: expected one of"),
    ({"last_q": 4, "rows": np.array([[0, 3, 16, 2]], np.int32)}, r"^rows: expected query indices in \[0, T=16\)"),
])
def test_bad_arguments_are_named(kw, match):
    q, k, _ = random_qkv(4, 1, 16, 16, 4, 1, 8)
    with pytest.raises(ValueError, match=match):
        last_q_scores(q, k, **kw)


def test_bad_shapes_and_dtypes_are_named():
    q, k, _ = random_qkv(4, 1, 16, 16, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^k: expected \[B=1, S >= T=16, K, D=8\]"):
        last_q_scores(q, k[:, :8], last_q=4)
    with pytest.raises(ValueError, match=r"^k: expected"):
        last_q_scores(q, k[..., :4], last_q=4)
    with pytest.raises(ValueError, match=r"^q / k: expected one dtype"):
        last_q_scores(q, k.astype(jnp.bfloat16), last_q=4)


@pytest.mark.parametrize("step_heads", [0, 3, 5])
def test_step_heads_must_divide_the_group(step_heads):
    q, k, _ = random_qkv(4, 1, 16, 16, 4, 1, 8)
    with pytest.raises(ValueError, match=r"^step_heads: expected None or a divisor of N / K = 4"):
        last_q_scores(q, k, last_q=4, step_heads=step_heads)


def test_heads_per_step_takes_the_most_heads_that_fit():
    """Seven query heads a key / value head (Qwen2.5-VL 7B), 64 rows: all seven at 128k, one at 1M; a divisor."""
    assert heads_per_step(1, 64, 131072, 7) == 7
    assert heads_per_step(1, 64, 1 << 20, 7) == 1
    assert heads_per_step(1, 64, 1 << 18, 8) == 4
    assert heads_per_step(1, 64, 1 << 18, 8, budget=4 * 64 * (1 << 18) * 2) == 2
    assert 4 * 64 * 131072 * 7 <= STEP_BYTES
