"""`last_q_scores` against its definition written out in NumPy (the softmax of the estimation rows over their causal,
valid keys; column sums and sums along each offset), for every number of query heads scored per step, GQA, chosen
rows and invalid keys; and `heads_per_step`'s budget."""

import numpy as np
import pytest

from mmjax.sparse.estimate import STEP_BYTES, diagonal_sums, heads_per_step, last_q_scores
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


@pytest.mark.parametrize("step_heads", [1, 2, 4, None])
@pytest.mark.parametrize("form", ["last rows", "chosen rows", "invalid keys"])
def test_last_q_scores_match_their_definition(step_heads, form):
    q, k, _ = random_qkv(4, 2, 40, 72, 8, 2, 16)  # 4 query heads per key / value head
    rng = np.random.default_rng(5)
    kw = {"last rows": {}, "chosen rows": {"rows": rng.integers(0, 40, (2, 6)).astype(np.int32)},
          "invalid keys": {"k_valid": rng.random((2, 72)) > 0.3}}[form]
    vertical, slash = last_q_scores(q, k, last_q=6, step_heads=step_heads, **kw)
    want_v, want_s = _scores(q, k, 6, **kw)
    np.testing.assert_allclose(np.asarray(vertical), want_v, atol=2e-6)
    np.testing.assert_allclose(np.asarray(slash), want_s, atol=2e-6)


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
    for got, want in zip(last_q_scores(q, k, last_q=8), last_q_scores(q, k, last_q=8, rows=rows), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


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


def test_heads_per_step_names_a_bad_argument():
    with pytest.raises(ValueError, match=r"^groups: expected an int >= 1; received 0"):
        heads_per_step(1, 64, 1024, 0)
