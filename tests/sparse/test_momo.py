"""MOMO on CPU: union and trim == a NumPy Algorithm 2; layout invariants; end to end ==
masked dense attention on the final layout plus the delta correction; sampled rows ==
dense attention; hyper-parameter validation."""

import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.patterns import momo as momo_module
from mmjax.sparse.patterns.momo import (
    Momo,
    assemble_layout,
    delta_correct,
    forced_blocks,
    rerank_pick,
    run_values,
    union_trim,
)
from pallas_kernels.qsa_topk.common import SCAN_ORDERS
from tests.pallas_kernels.helpers import masked_dense_attention, random_qkv, rel_err


def numpy_algorithm2(ids, scores, *, q_len, kv_len, gamma, chi, beta, k_trim, sink_blocks, local, lse=None):
    """Per (b, n, query block): mean score of every repeated id over the gamma-rows of the
    block that selected it (or, given ``lse``, the sum of exp(score - lse) over them); drop
    forced ids; keep the k_trim best (ties: lower id)."""
    b, n, tg, _ = ids.shape
    nq = -(-q_len // chi)
    per = chi // gamma
    out = np.full((b, n, nq, k_trim), -1, np.int64)
    for bi in range(b):
        for ni in range(n):
            for c in range(nq):
                first = c * chi + kv_len - q_len
                lo = max(first - local, 0) // beta
                acc: dict[int, list[float]] = {}
                for g in range(c * per, min((c + 1) * per, tg)):
                    for j, sc in zip(ids[bi, ni, g], scores[bi, ni, g]):
                        if j >= 0 and sink_blocks <= j < lo:
                            w = float(sc) if lse is None else float(np.exp(np.float32(sc) - lse[bi, ni, g]))
                            acc.setdefault(int(j), []).append(w)
                agg = (lambda x: np.mean(np.float32(x))) if lse is None else (lambda x: np.sum(np.float32(x)))
                ranked = sorted(acc, key=lambda j: (-agg(acc[j]), j))[:k_trim]
                out[bi, ni, c, : len(ranked)] = ranked
    return out


@pytest.mark.parametrize("seed,q_len,kv_len,gamma,chi,beta,k,k_trim,sink_blocks,local", [
    (0, 256, 256, 4, 32, 16, 5, 6, 1, 16),
    (1, 200, 777, 8, 64, 16, 9, 4, 2, 0),
    (2, 129, 129, 1, 16, 16, 3, 3, 0, 40),
])
def test_union_trim_matches_numpy_algorithm2(seed, q_len, kv_len, gamma, chi, beta, k, k_trim,
                                            sink_blocks, local):
    rng = np.random.default_rng(seed)
    b, n = 2, 3
    tg = -(-q_len // gamma)
    nk = -(-kv_len // beta)
    pos = np.arange(tg) * gamma + kv_len - q_len
    lo_row = np.maximum(pos - local, 0) // beta
    ids = np.full((b, n, tg, k), -1, np.int32)
    scores = np.full((b, n, tg, k), -np.inf, np.float32)
    for idx in np.ndindex(b, n, tg):
        cand = np.arange(sink_blocks, lo_row[idx[2]])
        # small id ranges make repeats across the rows of a query block likely
        cand = cand[cand < sink_blocks + 12] if rng.random() < 0.5 else cand
        m = min(k, cand.size, int(rng.integers(0, k + 1)))
        ids[idx][:m] = rng.choice(cand, size=m, replace=False)
        scores[idx][:m] = rng.normal(size=m).astype(np.float32) * 3
    got, vals = union_trim(jnp.asarray(ids), jnp.asarray(scores), q_len=q_len, kv_len=kv_len,
                           gamma=gamma, query_block=chi, block=beta, k_trim=k_trim,
                           sink_blocks=sink_blocks, local=local)
    want = numpy_algorithm2(ids, scores, q_len=q_len, kv_len=kv_len, gamma=gamma, chi=chi, beta=beta,
                            k_trim=k_trim, sink_blocks=sink_blocks, local=local)
    np.testing.assert_array_equal(np.asarray(got), want)
    vals = np.asarray(vals)
    np.testing.assert_array_equal(np.isneginf(vals), np.asarray(got) < 0)
    assert (np.diff(np.where(np.isneginf(vals), -1e30, vals), axis=-1) <= 0).all()
    lay = assemble_layout(got, q_len=q_len, kv_len=kv_len, query_block=chi, block=beta,
                          sink_blocks=sink_blocks, local=local)
    f_ids, f_count = forced_blocks(q_len, kv_len, query_block=chi, block=beta,
                                   sink_blocks=sink_blocks, local=local)
    blocks, count = np.asarray(lay.kv_blocks), np.asarray(lay.kv_block_count)
    for idx in np.ndindex(b, n, lay.num_q_blocks):
        listed = blocks[idx][: count[idx]]
        expect = set(f_ids[idx[2]][: f_count[idx[2]]]) | {j for j in want[idx] if j >= 0}
        assert list(listed) == sorted(expect)
        assert listed.max() < nk


def test_union_trim_mass_rule_matches_numpy():
    """rule="mass": blocks ranked by the summed softmax mass of the sampled rows that kept
    them, so a block two rows keep beats one a single row scores a little higher."""
    rng = np.random.default_rng(5)
    b, n, q_len, kv_len, gamma, chi, beta, k, k_trim = 1, 2, 128, 384, 4, 32, 16, 4, 3
    tg, nk = q_len // gamma, kv_len // beta
    ids = np.stack([np.stack([rng.choice(np.arange(2, 12), size=k, replace=False) for _ in range(tg)])
                    for _ in range(b * n)]).reshape(b, n, tg, k).astype(np.int32)
    scores = rng.normal(size=(b, n, tg, k)).astype(np.float32)
    lse = (3.0 + rng.normal(size=(b, n, tg))).astype(np.float32)
    geo = dict(q_len=q_len, kv_len=kv_len, gamma=gamma, block=beta, k_trim=k_trim, sink_blocks=1, local=0)
    got, vals = union_trim(jnp.asarray(ids), jnp.asarray(scores), query_block=chi, rule="mass",
                           lse=jnp.asarray(lse), **geo)
    want = numpy_algorithm2(ids, scores, chi=chi, beta=beta, lse=lse,
                            **{x: geo[x] for x in ("q_len", "kv_len", "gamma", "k_trim", "sink_blocks", "local")})
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (np.asarray(vals)[np.asarray(got) >= 0] > 0).all()
    with pytest.raises(ValueError, match="lse"):
        union_trim(jnp.asarray(ids), jnp.asarray(scores), query_block=chi, rule="mass", **geo)
    with pytest.raises(ValueError, match="rule"):
        union_trim(jnp.asarray(ids), jnp.asarray(scores), query_block=chi, rule="max", **geo)


def test_union_stages_and_rerank_fp8_name_bad_arguments():
    ids = jnp.zeros((1, 2, 3, 8), jnp.int32)
    with pytest.raises(ValueError, match="^rule: expected one of"):
        run_values(ids, jnp.zeros((1, 2, 3, 8)), rule="max", big=10)
    with pytest.raises(ValueError, match=r"^ids, sc: expected two arrays of one shape"):
        run_values(ids, jnp.zeros((1, 2, 3, 7)), rule="mass", big=10)
    with pytest.raises(ValueError, match="^rerank_fp8: expected a bool"):
        Momo(rerank_fp8=1)


def test_forced_blocks_cover_sink_window_and_diagonal():
    ids, count = forced_blocks(100, 300, query_block=32, block=16, sink_blocks=2, local=20)
    # query block 0 covers positions 200..231: window from 180 -> blocks 11..14, sink 0, 1
    assert list(ids[0][: count[0]]) == [0, 1, 11, 12, 13, 14]
    # last query block covers positions 296..299: blocks (276 // 16 = 17) .. 18
    assert list(ids[-1][: count[-1]]) == [0, 1, 17, 18]


def test_delta_correction_is_eq3():
    rng = np.random.default_rng(0)
    out_star = jnp.asarray(rng.normal(size=(1, 10, 2, 4)), jnp.float32)
    lse_star = jnp.asarray(rng.normal(size=(1, 2, 10)), jnp.float32)
    out_g = jnp.asarray(rng.normal(size=(1, 4, 2, 4)), jnp.float32)
    lse_g = jnp.asarray(rng.normal(size=(1, 2, 4)), jnp.float32)
    out, lse = delta_correct(out_star, lse_star, out_g, lse_g, 3)
    for t in range(10):
        g = t // 3
        np.testing.assert_allclose(out[:, t], out_star[:, t] + out_g[:, g] - out_star[:, 3 * g], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(lse[:, :, ::3]), np.asarray(lse_g))
    np.testing.assert_array_equal(np.asarray(lse[:, :, 1::3]), np.asarray(lse_star[:, :, 1::3]))


E2E = [
    # b, t, s, n, kh, d, pattern kwargs, dtype
    (1, 300, 400, 2, 1, 32, dict(gamma=4, block=16, k=4, k_exact=1, k_trim=3, query_block=32,
                                 topk="estimated", sink=16, local=16), jnp.float32),
    (2, 330, 330, 2, 1, 16, dict(gamma=8, block=16, k=3, k_trim=4, query_block=16, topk="exact",
                                 sink=0, local=0), jnp.float32),
    (1, 384, 384, 4, 2, 32, dict(gamma=16, block=16, k=4, k_exact=2, k_trim=3, query_block=64,
                                 topk="tournament", sink=32, local=32), jnp.bfloat16),
    (1, 300, 400, 2, 1, 32, dict(gamma=4, block=16, k=4, k_exact=1, k_trim=3, query_block=32,
                                 topk="exact", sink=16, local=16, rerank=2, rerank_stride=2), jnp.float32),
]


@pytest.mark.parametrize("case", E2E)
@pytest.mark.parametrize("options", [KernelOptions(implementation="reference"), KernelOptions(interpret=True)])
def test_end_to_end_equals_masked_dense_plus_correction(case, options):
    b, t, s, n, kh, d, kw, dtype = case
    q, k, v = random_qkv(t + s + d, b, t, s, n, kh, d, dtype)
    pattern = Momo(**kw)
    out, lse = pattern.attend(q, k, v, options=options)
    plan = pattern.plan(q, k, v, options=options)
    sparse, sparse_lse = masked_dense_attention(q, k, v, plan.layout.to_dense_mask())
    causal = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + s - t)[None, None]
    dense, dense_lse = masked_dense_attention(q, k, v, causal)
    g = pattern.gamma
    expected = sparse + jnp.repeat(dense[:, ::g] - sparse[:, ::g], g, axis=1)[:, :t]
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, n, t)
    assert rel_err(out, expected) < tol
    assert rel_err(out[:, ::g], dense[:, ::g]) < tol  # rows i = 0 mod gamma are dense
    np.testing.assert_allclose(np.asarray(lse[:, :, ::g]), np.asarray(dense_lse[:, :, ::g]),
                               atol=1e-4 if dtype == jnp.float32 else 3e-2)
    np.testing.assert_allclose(np.asarray(lse[:, :, 1::g]), np.asarray(sparse_lse[:, :, 1::g]),
                               atol=1e-4 if dtype == jnp.float32 else 3e-2)
    # the layout is really sparse here, so the test would notice a dense fallback
    assert float(np.asarray(plan.layout.density()).max()) < 0.9


def test_plan_with_the_mosaic_block_sparse_kernel_measures_with_the_default_kernels():
    """KernelOptions(implementation="mosaic_gpu") names the block-sparse kernel; the exact top-k (which the fused
    Mosaic GPU QSA does not take) and the re-rank run their default (here on a CPU, the reference): the same plan
    as with no option."""
    q, k, v = random_qkv(5, 1, 256, 256, 2, 1, 32, jnp.float32)
    pattern = Momo(gamma=4, block=16, k=4, k_exact=1, k_trim=3, query_block=32, topk="exact", sink=16, local=16,
                   rerank=2, rerank_stride=2)
    got = pattern.plan(q, k, v, options=KernelOptions(implementation="mosaic_gpu"))
    want = pattern.plan(q, k, v, options=KernelOptions())
    np.testing.assert_array_equal(np.asarray(got.layout.kv_blocks), np.asarray(want.layout.kv_blocks))
    np.testing.assert_array_equal(np.asarray(got.qsa.block_idx), np.asarray(want.qsa.block_idx))


@pytest.mark.parametrize("options,hopper,want", [
    (KernelOptions(), True, ("mosaic_gpu", 128)),
    (KernelOptions(), False, (None, 64)),
    (KernelOptions(interpret=True), True, (None, 64)),
    (KernelOptions(implementation="triton"), True, ("triton", 64)),
    (KernelOptions(implementation="mosaic_gpu"), False, ("mosaic_gpu", 128)),
])
def test_qsa_kernel_is_the_fused_mosaic_kernel_by_default_on_hopper(monkeypatch, options, hopper, want):
    """MOMO's QSA + top-k: the fused Mosaic GPU kernel (128-row tiles) when asked for, or by default on an sm90 GPU,
    for a config it takes; otherwise the named / default implementation with the Triton tile."""
    monkeypatch.setattr(momo_module, "is_sm90", lambda: hopper)
    q = jnp.zeros((1, 4096, 4, 128), jnp.bfloat16)
    assert Momo(topk="estimated", k_exact=8).qsa_kernel(q, options) == want
    assert Momo(topk="exact", k_exact=8).qsa_kernel(q, options)[0] != "mosaic_gpu"  # a config it does not take
    assert Momo(topk="estimated", k_exact=8).qsa_kernel(q.astype(jnp.float32), options)[0] != "mosaic_gpu"


@pytest.mark.parametrize("kw,name", [
    (dict(gamma=0), "gamma"), (dict(gamma=3), "gamma"), (dict(block=48), "block"),
    (dict(query_block=100), "query_block"), (dict(k=0), "k"), (dict(k_exact=200), "k_exact"), (dict(k_exact=-1, topk="exact"), "k_exact"),
    (dict(k_trim=0), "k_trim"), (dict(topk="heap"), "topk"), (dict(sink=-1), "sink"),
    (dict(trim_rule="max"), "trim_rule"), (dict(scan="reverse"), "scan"),
    (dict(local=1.5), "local"),
])
def test_bad_hyper_parameters_raise_value_error_naming_them(kw, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        Momo(**kw)


@pytest.mark.parametrize("options", [KernelOptions(implementation="reference"), KernelOptions(interpret=True)])
def test_rerank_picks_the_block_the_unsampled_rows_attend_to(options):
    """Sampled rows (every 16th) look at key block A, the other 30 rows of the query block at block B: the
    sampled rows' mass ranks A first; re-ranking the two best candidates with every row keeps B."""
    t = s = 128
    d = 16
    u, w = np.eye(d)[0], np.eye(d)[1]
    rng = np.random.default_rng(0)
    q = 0.05 * rng.normal(size=(t, d))
    q += np.where((np.arange(t) % 16 == 0)[:, None], 6.0 * u, 6.0 * w)
    k = 0.05 * rng.normal(size=(s, d))
    k[16:32] += u  # block A (id 1)
    k[32:48] += 0.6 * u + 0.8 * w  # block B (id 2)
    q, k = jnp.asarray(q[None, :, None], jnp.float32), jnp.asarray(k[None, :, None], jnp.float32)
    kw = dict(gamma=16, block=16, k=2, k_trim=1, query_block=32, topk="exact", sink=0, local=16)
    last = -1  # the last query block: rows 96..127, candidates before its window (blocks < 5)

    def chosen(pattern):
        lay = pattern.plan(q, k, k, options=options).layout
        return set(np.asarray(lay.kv_blocks)[0, 0, last, : int(lay.kv_block_count[0, 0, last])].tolist())

    plain, reranked = chosen(Momo(rerank=0, **kw)), chosen(Momo(rerank=2, **kw))
    assert 1 in plain and 2 not in plain
    assert 2 in reranked and 1 not in reranked


def test_rerank_arguments_name_themselves():
    with pytest.raises(ValueError, match="^rerank:"):
        Momo(rerank=-1)
    with pytest.raises(ValueError, match="^rerank_stride:"):
        Momo(rerank=1, rerank_stride=3)
    with pytest.raises(ValueError, match="^rerank_stride:"):
        Momo(rerank=1, rerank_stride=16)  # 128 / 16 = 8 rows per program
    with pytest.raises(ValueError, match="^rerank: expected rerank \\* k_trim <="):
        Momo(gamma=16, k=4, k_exact=1, k_trim=4, query_block=32, rerank=3)  # union of 2 rows x 4 = 8 < 12


def test_build_layout_is_the_plan_layout():
    q, k, v = random_qkv(1, 1, 200, 200, 2, 1, 16)
    pattern = Momo(gamma=4, block=16, k=3, k_exact=1, query_block=16, sink=16, local=16, topk="exact")
    lay = pattern.build_layout(q, k)
    plan = pattern.plan(q, k, v)
    np.testing.assert_array_equal(np.asarray(lay.kv_blocks), np.asarray(plan.layout.kv_blocks))
    np.testing.assert_array_equal(np.asarray(lay.kv_block_count), np.asarray(plan.layout.kv_block_count))
    assert (pattern.block_q, pattern.block_k) == (16, 16)


def test_k_larger_than_number_of_blocks_raises():
    q, k, v = random_qkv(0, 1, 64, 64, 2, 1, 16)
    with pytest.raises(ValueError, match="^k:"):
        Momo(k=5, k_exact=2, block=16, query_block=16).attend(q, k, v, options=KernelOptions(implementation="reference"))


def test_auto_trim_rule_is_mass_unless_the_estimated_scan_runs_in_id_order():
    assert Momo().rule == "mass"  # estimated, golden scan
    assert Momo(scan="natural").rule == "mean"
    assert Momo(topk="exact", scan="natural").rule == "mass"
    assert Momo(trim_rule="mean").rule == "mean"


def test_golden_scan_changes_only_the_estimated_selection():
    q, k, v = random_qkv(7, 1, 512, 1024, 2, 1, 32)
    opts = KernelOptions(implementation="reference")
    kw = {"gamma": 4, "block": 16, "k": 8, "k_exact": 2, "query_block": 32, "sink": 16, "local": 16}
    ids = {}
    for topk in ("exact", "estimated"):
        for scan in SCAN_ORDERS:
            ids[topk, scan] = np.asarray(Momo(topk=topk, scan=scan, **kw).plan(q, k, v, options=opts).qsa.block_idx)
    np.testing.assert_array_equal(ids["exact", "golden"], ids["exact", "natural"])
    assert (ids["estimated", "golden"] != ids["estimated", "natural"]).any()


def test_rerank_pick_keeps_the_candidates_with_the_most_mass():
    """The k_trim candidates with the most mass (ties to the earlier one); empty candidates (-1) only fill slots
    nothing else can; bad shapes and counts are named."""
    rng = np.random.default_rng(5)
    cands = rng.permutation(40)[None, None, None, :12].astype(np.int32)
    cands = np.concatenate([cands, np.array([[[[-1, -1]]]], np.int32)], -1)  # C = 14, two empty
    mass = rng.uniform(0.1, 1.0, size=cands.shape).astype(np.float32)
    mass[..., 3] = mass[..., 5]  # a tie: the earlier candidate wins it
    got = np.asarray(rerank_pick(jnp.asarray(cands), jnp.asarray(mass), k_trim=6))
    best = sorted(range(12), key=lambda j: (-mass[0, 0, 0, j], j))[:6]
    np.testing.assert_array_equal(got[0, 0, 0], cands[0, 0, 0, best])
    few = np.asarray(rerank_pick(jnp.asarray(cands[..., 8:]), jnp.asarray(mass[..., 8:]), k_trim=6))
    assert sorted(few[0, 0, 0].tolist()) == sorted(cands[0, 0, 0, 8:12].tolist() + [-1, -1])
    with pytest.raises(ValueError, match="^k_trim: expected 1 <= k_trim <= 14"):
        rerank_pick(jnp.asarray(cands), jnp.asarray(mass), k_trim=15)
    with pytest.raises(ValueError, match="^mass: expected the candidates' shape"):
        rerank_pick(jnp.asarray(cands), jnp.asarray(mass[..., 2:]), k_trim=6)
    with pytest.raises(ValueError, match="^candidates: expected a 4-D array"):
        rerank_pick(jnp.asarray(cands[0]), jnp.asarray(mass[0]), k_trim=6)


def test_rerank_share_scores_the_query_blocks_union_trim_is_least_sure_of():
    """`Momo(rerank_share=f)`: in each (batch, head) the ceil(f * nq) query blocks with the largest union tail keep
    the re-ranked lists of `rerank_share=1`, the others union + trim's first k_trim; the share is checked by name."""
    q, k, v = random_qkv(6, 1, 512, 512, 2, 1, 16)
    kw = dict(gamma=4, block=16, k=4, k_exact=1, k_trim=4, query_block=32, sink=16, local=16, topk="exact",
              rerank=4, rerank_stride=2)
    some, every = Momo(rerank_share=0.4, **kw), Momo(rerank_share=1.0, **kw)
    res = every.qsa(q, k, v)
    cands = every.union_candidates(res, 512, 512)
    tail = np.asarray(cands.tail)
    assert cands.ids.shape == (1, 2, 16, 16) and ((tail >= 0) & (tail <= 1)).all() and tail.max() > 0
    got = np.asarray(some.rerank_candidates(q, k, cands, res.lse_gamma))
    full = np.asarray(every.rerank_candidates(q, k, cands, res.lse_gamma))
    for h in range(2):
        chosen = set(np.argsort(-tail[0, h], kind="stable")[:7].tolist())  # ceil(0.4 * 16)
        for i in range(16):
            want = full[0, h, i] if i in chosen else np.asarray(cands.ids)[0, h, i, :4]
            np.testing.assert_array_equal(got[0, h, i], want)
    assert not np.array_equal(got, full)
    np.testing.assert_array_equal(np.asarray(some.plan(q, k, v).layout.kv_blocks),
                                  np.asarray(assemble_layout(jnp.asarray(got), q_len=512, kv_len=512, query_block=32,
                                                             block=16, sink_blocks=1, local=16).kv_blocks))
    assert Momo(trim_rule="mean", rerank_share=0.5).rerank_fraction == 1.0 and Momo().rerank_fraction == 0.625
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(ValueError, match="^rerank_share: expected a number in \\(0, 1\\]"):
            Momo(rerank_share=bad)


def test_default_reranks_four_times_the_kept_blocks_with_every_second_row():
    """`Momo()` re-ranks (4 x k_trim candidates, every 2nd row); the factor is capped by the union of a query block's
    sampled selections and off below 2; the stride falls back to every row where 2 would leave < 16 rows."""
    p = Momo()
    assert (p.rerank, p.rerank_stride, p.rerank_factor, p.rerank_rows) == (None, None, 4, 2)
    small = dict(k=4, k_exact=1, k_trim=4)
    assert Momo(gamma=16, query_block=32, **small).rerank_factor == 2  # union 2 rows x 4 = 8 = 2 x k_trim
    assert Momo(gamma=32, query_block=32, **small).rerank_factor == 0  # union 4: nothing to re-rank
    assert Momo(gamma=16, query_block=16, **small).rerank_rows == 1
    assert (Momo(rerank=0).rerank_factor, Momo(rerank=2, rerank_stride=4).rerank_rows) == (0, 4)


def test_default_plan_is_the_explicit_rerank_plan():
    q, k, v = random_qkv(3, 1, 256, 256, 2, 1, 16)
    kw = dict(gamma=4, block=16, k=4, k_exact=1, k_trim=4, query_block=32, sink=16, local=16, topk="exact")
    auto = Momo(**kw).plan(q, k, v).layout
    explicit = Momo(rerank=4, rerank_stride=2, **kw).plan(q, k, v).layout
    plain = Momo(rerank=0, **kw).plan(q, k, v).layout
    np.testing.assert_array_equal(np.asarray(auto.kv_blocks), np.asarray(explicit.kv_blocks))
    assert not np.array_equal(np.asarray(auto.kv_blocks), np.asarray(plain.kv_blocks))
