"""tools/minference_index.py: MInference's index formats rebuilt in JAX (used by the side-by-side benchmark)."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from minference_index import (  # noqa: E402
    block_index_counts,
    merge_row_pairs,
    pooled_block_index,
    vertical_slash_index,
    vertical_slash_pairs,
)

B = 16  # a small block keeps the walks short; the rules do not depend on its size


def interleaved_walk(vertical, slash, end, block):
    """MInference's conversion for one query block as a plain walk: verticals (ascending) and slashes
    (descending) consumed by two pointers, a range saved when the next slash opens a new one or the slashes
    run out; a vertical is a column when it lies before the current range."""
    tiles, cols = [], []
    s = 0
    while slash[s] >= end:
        s += 1
    x = max(end - slash[s], block)
    s += 1
    lo, hi = x - block, x
    vi = 0
    v = vertical[vi]
    vi += 1
    while True:
        if v < hi:
            if v < lo:
                cols.append(v)
            if vi < len(vertical):
                v = vertical[vi]
                vi += 1
            else:
                v = end + block
        else:
            if s < len(slash):
                x = max(end - slash[s], block)
                s += 1
            else:
                tiles += list(range(lo, hi, block))
                break
            if x > hi + block:
                tiles += list(range(lo, hi, block))
                lo, hi = x - block, x
            elif x > hi:
                hi += block
    return tiles, cols


@pytest.mark.parametrize("seed,seq_len,nv,ns", [(0, 256, 12, 9), (1, 512, 30, 40), (2, 192, 5, 60)])
def test_vertical_slash_index_matches_the_walk(seed, seq_len, nv, ns):
    rng = np.random.default_rng(seed)
    heads = 3
    vert = np.stack([rng.choice(seq_len, nv, replace=False) for _ in range(heads)])[None]
    # offsets: the main diagonal plus random ones, some past every row (>= S) and some clustered
    sl = np.stack([np.concatenate([[0], rng.choice(np.arange(1, seq_len + 40), ns - 1, replace=False)])
                   for _ in range(heads)])[None]
    count, offsets, ccount, cols = jax.jit(vertical_slash_index, static_argnums=(2, 3))(
        jnp.asarray(vert, jnp.int32), jnp.asarray(sl, jnp.int32), seq_len, B)
    for h in range(heads):
        v_sorted = sorted(vert[0, h].tolist())
        s_sorted = sorted(sl[0, h].tolist(), reverse=True)
        for m in range(seq_len // B):
            tiles, want_cols = interleaved_walk(v_sorted, s_sorted, (m + 1) * B, B)
            n, c = int(count[0, h, m]), int(ccount[0, h, m])
            assert offsets[0, h, m, :n].tolist() == tiles, (h, m)
            assert cols[0, h, m, :c].tolist() == want_cols, (h, m)


def test_vertical_slash_index_covers_every_named_pair():
    rng = np.random.default_rng(3)
    seq_len, heads = 320, 2
    vert = np.stack([rng.choice(seq_len, 20, replace=False) for _ in range(heads)])[None]
    sl = np.stack([np.concatenate([[0, 1, 2], rng.choice(np.arange(3, seq_len), 25, replace=False)])
                   for _ in range(heads)])[None]
    count, offsets, ccount, cols = vertical_slash_index(jnp.asarray(vert), jnp.asarray(sl), seq_len, B)
    for h in range(heads):
        for m in range(seq_len // B):
            keys = set()
            for t in offsets[0, h, m, : int(count[0, h, m])].tolist():
                keys |= set(range(t, t + B))
            keys |= set(cols[0, h, m, : int(ccount[0, h, m])].tolist())
            for r in range(m * B, (m + 1) * B):
                named = {r - o for o in sl[0, h].tolist() if 0 <= r - o} | {c for c in vert[0, h].tolist() if c <= r}
                assert named <= keys, (h, m, r, sorted(named - keys)[:5])
    pairs = vertical_slash_pairs(count, ccount, B)
    assert pairs.shape == (1, heads)
    assert bool(jnp.all(pairs > 0))


def test_pooled_block_index_is_the_causal_top_k_of_pooled_scores():
    kq, kk = jax.random.split(jax.random.key(0))
    s, n, d, top_k = 8 * B, 2, 8, 3
    q = jax.random.normal(kq, (1, s, n, d))
    k = jax.random.normal(kk, (1, s, n, d))
    idx = np.asarray(pooled_block_index(q, k, top_k, B))
    counts = np.asarray(block_index_counts(jnp.asarray(idx)))
    qp = np.asarray(q).reshape(1, 8, B, n, d).mean(2)
    kp = np.asarray(k).reshape(1, 8, B, n, d).mean(2)
    for h in range(n):
        for m in range(8):
            score = qp[0, m, h] @ kp[0, : m + 1, h].T
            want = sorted(np.argsort(-score)[:top_k].tolist())
            got = idx[0, h, m, : counts[0, h, m]].tolist()
            assert counts[0, h, m] == min(m + 1, top_k)
            assert got == want, (h, m)


def test_merge_row_pairs_is_the_distinct_union():
    idx = jnp.asarray([[[[0, 5, 9], [1, 5, 7], [2, 3, 4]]]], jnp.int32)  # 3 rows (odd)
    count = jnp.asarray([[[2, 3, 1]]], jnp.int32)
    ids, merged = merge_row_pairs(idx, count)
    assert merged.tolist() == [[[4, 1]]]
    assert ids[0, 0, 0, :4].tolist() == [0, 1, 5, 7]
    assert ids[0, 0, 1, :1].tolist() == [2]


@pytest.mark.parametrize("call,match", [
    (lambda: pooled_block_index(jnp.zeros((1, 64, 2, 8)), jnp.zeros((1, 128, 2, 8)), 2, B), r"^q, k: expected"),
    (lambda: pooled_block_index(jnp.zeros((1, 40, 2, 8)), jnp.zeros((1, 40, 2, 8)), 2, B), r"^q: expected a length"),
    (lambda: merge_row_pairs(jnp.zeros((1, 2, 3, 4), jnp.int32), jnp.zeros((1, 2, 4), jnp.int32)), r"^idx, count:"),
    (lambda: vertical_slash_index(jnp.zeros((1, 2, 5), jnp.int32), jnp.zeros((1, 3, 5), jnp.int32), 64, B),
     r"^vertical, slash: expected"),
    (lambda: vertical_slash_index(jnp.zeros((1, 2, 5), jnp.int32), jnp.zeros((1, 2, 5), jnp.int32), 70, B),
     r"^seq_len: expected a multiple"),
])
def test_bad_input_raises_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
