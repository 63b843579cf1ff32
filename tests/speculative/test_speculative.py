"""Speculative decoding: trees, acceptance (greedy + lossless sampling), cache surgery, generate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

import mmjax
from mmjax.inference import decode_step, prefill
from mmjax.speculative import Sampling, SparrowDraft, TargetDraft, TreeConfig
from mmjax.speculative.draft import DraftConfig
from mmjax.speculative.sampling import target_log_probs
from mmjax.speculative.tree import add_level, empty_pool, level_offset, select_tree
from mmjax.speculative.verify import accept_greedy, accept_sampling
from models.qwen2_5_vl import Qwen2_5_VL
from models.qwen2_5_vl.model import cached_forward, forward
from models.qwen2_text import compact_cache
from pallas_kernels import tree_decode_attention
from tests.models.helpers import IMG, VE, VS, small_config, video_prompt


def _model(scale=6.0, seed=7):
    """A tiny random target whose greedy continuations do not collapse into one repeated token."""
    cfg = small_config()
    model = Qwen2_5_VL(cfg, dtype=jnp.float32, key=jax.random.key(seed))
    st = nnx.state(model.language_model, nnx.Param)
    nnx.update(model.language_model, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, st))
    return model


def image_prompt(cfg, rng, grid=(1, 4, 4)):
    n = int(np.prod(grid))
    ids = [5, 6, VS] + [IMG] * (n // 4) + [VE, 7, 8, 9]
    return dict(input_ids=np.asarray([ids]), image_grid_thw=np.asarray([grid]),
                pixel_values=rng.standard_normal((n, cfg.vision.patch_dim)).astype(np.float32))


@pytest.fixture(scope="module")
def target():
    return _model()


@pytest.fixture(scope="module")
def prompts(target):
    cfg = target.config
    rng = np.random.default_rng(0)
    return {"video": video_prompt(cfg, frames=2, rng=rng), "image": image_prompt(cfg, rng),
            "text": dict(input_ids=np.asarray([[3, 9, 14, 27, 2, 11]]))}


# ----------------------------------------------------------------------------- trees
def _random_pool(rng, tree, b=2):
    """A pool filled as the drafting loop fills it (random log-probs, frontier = best k per level)."""
    k = tree.top_k
    lp = lambda *s: np.log(rng.dirichlet(np.ones(k) * 0.5, size=s)).astype(np.float32)
    pool = empty_pool(b, tree)
    s1 = np.sort(lp(b), axis=-1)[:, ::-1]
    pool = add_level(pool, 0, jnp.asarray(rng.integers(0, 50, (b, k))), jnp.asarray(s1), -jnp.ones((b, k), jnp.int32), 1)
    f_idx, f_score = np.tile(np.arange(k), (b, 1)), s1
    for level in range(2, tree.depth + 1):
        c = f_score[:, :, None] + np.sort(lp(b, k), axis=-1)[..., ::-1]
        off = level_offset(level, tree)
        pool = add_level(pool, off, jnp.asarray(rng.integers(0, 50, (b, k * k))), jnp.asarray(c.reshape(b, -1)),
                         jnp.asarray(np.repeat(f_idx, k, axis=1)), level)
        sel = np.argsort(-c.reshape(b, -1), axis=1, kind="stable")[:, :k]
        f_idx, f_score = off + sel, np.take_along_axis(c.reshape(b, -1), sel, 1)
    return pool


@pytest.mark.parametrize("cfg", [TreeConfig(30, 4, 8), TreeConfig(48, 5, 10), TreeConfig(6, 3, 2)])
def test_select_tree_is_ancestor_closed_and_topological(cfg):
    pool = _random_pool(np.random.default_rng(1), cfg)
    t = select_tree(pool, jnp.asarray([1, 2]), cfg)
    par, depth, anc, path = map(np.asarray, (t.parent, t.depth, t.ancestors, t.path))
    sc = np.asarray(pool.score)
    for b in range(2):
        assert depth[b, 0] == 0 and (par[b, 1:] < np.arange(1, cfg.n_tree)).all()  # parents come first
        assert (depth[b, 1:] == depth[b, par[b, 1:]] + 1).all()
        assert (np.diff(depth[b]) >= 0).all()
        # the selected nodes are the total_tokens best scores of the pool
        chosen = np.sort(np.asarray(t.tokens[b, 1:]))
        assert len(chosen) == cfg.total_tokens
        assert np.isfinite(sc[b]).sum() >= cfg.total_tokens
        for i in range(cfg.n_tree):
            chain, j = {i}, i
            while j:
                j = par[b, j]
                chain.add(j)
            assert set(np.flatnonzero(anc[b, i])) == chain
            assert path[b, i, depth[b, i]] == i and path[b, i, 0] == 0
            kids = np.flatnonzero((par[b] == i) & (np.arange(cfg.n_tree) > 0))
            got = np.asarray(t.children[b, i])
            assert list(got[got >= 0]) == list(kids[:cfg.top_k])


def test_tree_config_validation():
    assert TreeConfig.parse("48-5-10") == TreeConfig(48, 5, 10) and str(TreeConfig(30, 4, 8)) == "30-4-8"
    with pytest.raises(ValueError, match="total_tokens"):
        TreeConfig(100, 2, 3)
    with pytest.raises(ValueError, match="depth"):
        TreeConfig(3, 0, 3)
    with pytest.raises(ValueError, match="total_tokens-depth-top_k"):
        TreeConfig.parse("30-4")


# ----------------------------------------------------------------------------- acceptance
def _chi2_pvalue(observed, p):
    p = np.asarray(p, np.float64)
    return stats.chisquare(observed, p / p.sum() * observed.sum()).pvalue


def _tree_and_logits(rng, cfg, v, b=1):
    pool = _random_pool(rng, cfg, b)
    pool = type(pool)(jnp.asarray(rng.integers(0, v, pool.tokens.shape), jnp.int32), pool.score, pool.parent, pool.depth)
    t = select_tree(pool, jnp.zeros((b,), jnp.int32), cfg)
    # make sibling tokens distinct (the drafter's top-k guarantees it)
    toks = np.asarray(t.tokens).copy()
    for bb in range(b):
        for i in range(cfg.n_tree):
            kids = np.flatnonzero((np.asarray(t.parent[bb]) == i) & (np.arange(cfg.n_tree) > 0))
            toks[bb, kids] = rng.permutation(v)[:len(kids)]
    t = type(t)(jnp.asarray(toks), t.parent, t.depth, t.ancestors, t.path, t.children)
    logits = jnp.asarray(rng.normal(size=(b, cfg.n_tree, v)) * 1.5, jnp.float32)
    return t, logits


def test_greedy_acceptance_follows_target_argmax():
    rng = np.random.default_rng(3)
    cfg = TreeConfig(12, 3, 3)
    t, logits = _tree_and_logits(rng, cfg, v=5)
    best = np.asarray(jnp.argmax(logits, -1))[0]
    path, count, bonus = (np.asarray(a)[0] for a in accept_greedy(t, logits))
    toks, par, children = np.asarray(t.tokens[0]), np.asarray(t.parent[0]), np.asarray(t.children[0])
    node, want = 0, [0]
    while True:
        nxt = [c for c in children[node] if c >= 0 and toks[c] == best[node]]
        if not nxt:
            break
        node = nxt[0]
        want.append(node)
    assert count == len(want) and list(path[:count]) == want and bonus == best[node]


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=4),
                                      Sampling(temperature=1.3, top_p=0.8)])
def test_speculative_sampling_is_lossless_chi_square(sampling):
    """The first emitted token follows the target distribution at the root, and, when it is a child
    of the root, the second one follows the target distribution at that child (chi-square)."""
    rng = np.random.default_rng(4)
    v, n_samples = 6, 40000
    cfg = TreeConfig(10, 3, 3)
    t, logits = _tree_and_logits(rng, cfg, v)
    rep = lambda a: jnp.broadcast_to(a, (n_samples,) + a.shape[1:])
    big = type(t)(*(rep(a) for a in (t.tokens, t.parent, t.depth, t.ancestors, t.path, t.children)))
    path, count, bonus = jax.jit(accept_sampling, static_argnames="sampling")(jax.random.key(0), big, rep(logits),
                                                                               sampling=sampling)
    path, count, bonus = map(np.asarray, (path, count, bonus))
    toks = np.asarray(t.tokens[0])
    seq = np.where(count[:, None] > np.arange(cfg.depth + 1)[None], toks[path], -1)
    emitted = np.concatenate([seq[:, 1:], np.full((n_samples, 1), -1)], axis=1)
    emitted[np.arange(n_samples), count - 1] = bonus
    p = np.exp(np.asarray(target_log_probs(logits[0], sampling)))
    first = np.bincount(emitted[:, 0], minlength=v)
    support = p[0] > 0
    assert first[~support].sum() == 0
    assert _chi2_pvalue(first[support], p[0][support]) > 1e-3
    kids = [c for c in np.asarray(t.children[0, 0]) if c >= 0]
    tested = 0
    for c in kids:
        rows = emitted[:, 0] == toks[c]
        if rows.sum() < 2000:
            continue
        second = np.bincount(emitted[rows, 1], minlength=v)
        sup = p[c] > 0
        assert second[~sup].sum() == 0
        assert _chi2_pvalue(second[sup], p[c][sup]) > 1e-3
        tested += 1
    assert tested >= 1


# ----------------------------------------------------------------------------- cache surgery
def test_tree_forward_of_a_chain_equals_sequential_decode(target, prompts):
    inputs = prompts["video"]
    t = inputs["input_ids"].shape[1]
    toks = [11, 23, 5]
    pre = prefill(target, inputs, max_length=t + 8)
    cache = pre.cache
    want = []
    for x in toks:
        logits, cache = decode_step(target, cache, jnp.asarray([x]))
        want.append(np.asarray(logits[0]))
    pre = prefill(target, inputs, max_length=t + 8)
    chain = np.tril(np.ones((1, 3, 3), bool))
    prefix = np.asarray(pre.cache.valid)
    pos = np.asarray(pre.cache.next_position)[:, None] + np.arange(3)
    slot = jnp.asarray(t, jnp.int32)
    logits, _, c2 = cached_forward(target, pre.cache, jnp.asarray([toks]), jnp.asarray(pos), slot, jnp.asarray(prefix),
                                   slot, jnp.asarray(chain), tree_attn=tree_decode_attention)
    np.testing.assert_allclose(np.asarray(logits[0]), np.stack(want), atol=2e-4)


def test_compact_cache_moves_accepted_slots():
    L, B, S, K, D = 2, 2, 12, 1, 3
    k = jnp.arange(L * B * S * K * D, dtype=jnp.float32).reshape(L, B, S, K, D)
    from models.qwen2_text import KVCache
    valid = jnp.zeros((B, S), bool).at[:, :4].set(True)
    cache = KVCache(k, -k, valid, jnp.asarray(4, jnp.int32), jnp.asarray([10, 20], jnp.int32))
    src = jnp.asarray([[0, 2, 5], [0, 1, 1]], jnp.int32)
    out = compact_cache(cache, jnp.asarray(4, jnp.int32), src, jnp.asarray([3, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.k[:, 0, 4:7]), np.asarray(k[:, 0, [4, 6, 9]]))
    np.testing.assert_array_equal(np.asarray(out.k[:, 1, 4]), np.asarray(k[:, 1, 4]))
    assert np.asarray(out.valid).tolist()[0] == [True] * 7 + [False] * 5
    assert np.asarray(out.valid).tolist()[1] == [True] * 5 + [False] * 7
    assert int(out.length) == 7 and np.asarray(out.next_position).tolist() == [13, 21]


# ----------------------------------------------------------------------------- generate
@pytest.mark.parametrize("kind", ["video", pytest.param("image", marks=pytest.mark.slow),
                                  pytest.param("text", marks=pytest.mark.slow)])  # ~45 s each on 2 cores
def test_greedy_speculative_equals_plain_greedy(target, prompts, kind):
    inputs = prompts[kind]
    plain = mmjax.generate(target, inputs, 14)
    for draft, tree in ((SparrowDraft.init(target, jax.random.key(1)), TreeConfig(30, 4, 8)),
                        (TargetDraft(), TreeConfig(12, 3, 3))):
        spec = mmjax.generate(target, inputs, 14, draft=draft, tree=tree)
        np.testing.assert_array_equal(spec.tokens, plain.tokens)
        assert spec.tau.sum() == 13  # every token after the first comes from a step


def test_greedy_speculative_batch_with_left_padding(target, prompts):
    v = prompts["video"]
    t = v["input_ids"].shape[1]
    ids = np.zeros((2, t), np.int64)
    ids[0] = v["input_ids"][0]
    ids[1, -5:] = [3, 9, 14, 27, 2]
    mask = np.zeros((2, t), np.int64)
    mask[0], mask[1, -5:] = 1, 1
    batch = {**v, "input_ids": ids, "attention_mask": mask}
    plain = mmjax.generate(target, batch, 10)
    spec = mmjax.generate(target, batch, 10, draft=TargetDraft(), tree=TreeConfig(12, 3, 3))
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    single = mmjax.generate(target, {"input_ids": ids[1:, -5:]}, 10)
    np.testing.assert_array_equal(plain.tokens[1], single.tokens[0])


@pytest.mark.parametrize("tree", [TreeConfig(30, 4, 8), TreeConfig(48, 5, 10)])
def test_oracle_draft_accepts_depth_plus_one(prompts, tree):
    """With the target as its own draft every tree level holds the target's argmax (a peaked target
    keeps the greedy path among the best-scored nodes), so tau = depth + 1 on every full step."""
    model = _model(scale=6.0, seed=11)
    lm = model.language_model
    lm.lm_head[...] = lm.lm_head[...] * 8.0
    out = mmjax.generate(model, prompts["video"], 3 * (tree.depth + 1) + 1, draft=TargetDraft(), tree=tree)
    assert (out.tau[:, 0] == tree.depth + 1).all(), out.tau[:, 0]
    np.testing.assert_array_equal(out.tokens, mmjax.generate(model, prompts["video"], out.tokens.shape[1]).tokens)


def test_sampled_speculative_first_token_matches_plain(target, prompts):
    """Same seed -> the first token (drawn from the prefill logits) agrees; every token, plain or
    speculative, lies in the target's top-k support given its prefix."""
    s = Sampling(temperature=1.0, top_k=5, seed=2)
    spec = mmjax.generate(target, prompts["text"], 8, s, draft=SparrowDraft.init(target, jax.random.key(0)),
                          tree=TreeConfig(10, 3, 4))
    plain = mmjax.generate(target, prompts["text"], 8, s)
    assert spec.tokens[0, 0] == plain.tokens[0, 0]
    # Every emitted token lies in the target's top-5 given the prompt and the tokens before it
    # (lossless sampling with top_k=5 draws from the target's truncated distribution).
    for out in (spec, plain):
        pre = prefill(target, prompts["text"])
        logits, cache = pre.logits, pre.cache
        for i, tok in enumerate(np.asarray(out.tokens)[0]):
            top5 = np.argsort(-np.asarray(logits)[0])[:5]
            assert tok in top5, (i, tok, top5)
            logits, cache = decode_step(target, cache, jnp.asarray([tok]))


def test_vata_draft_cache_holds_text_positions_only(target):
    """The draft's committed entries do not grow with the number of visual tokens."""
    cfg = target.config
    from mmjax.speculative.draft import kept_positions
    lengths = {}
    for vata in (True, False):
        for frames in (2, 4):
            inputs = video_prompt(cfg, frames=frames, rng=np.random.default_rng(0))
            d = SparrowDraft.init(target, jax.random.key(0), DraftConfig(vata=vata))
            pre = prefill(target, inputs, hidden_layers=(d.feature_layer,))
            n_keep = int(np.asarray(kept_positions(pre, vata)).sum())
            begin = jax.jit(lambda pre, first: d.begin(target, pre, first, n_keep, 8, TreeConfig(10, 3, 4)))
            state, _, _ = begin(pre, jnp.asarray([1]))
            lengths[vata, frames] = int(state.length)
    n_text = 7  # 1, 2, VS, VE, 3, 4 + the last position
    assert lengths[True, 2] == lengths[True, 4] == n_text - 1
    assert lengths[False, 4] - lengths[False, 2] == 16


def test_generate_bad_arguments(target, prompts):
    with pytest.raises(ValueError, match="max_new_tokens"):
        mmjax.generate(target, prompts["text"], 0)
    with pytest.raises(ValueError, match="sampling"):
        mmjax.generate(target, prompts["text"], 4, sampling="greedy")
    with pytest.raises(ValueError, match="draft"):
        mmjax.generate(target, prompts["text"], 4, draft=object())
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1.0)
    with pytest.raises(ValueError, match="hidden_states"):
        d = SparrowDraft.init(target, jax.random.key(0))
        d.begin(target, prefill(target, prompts["text"]), jnp.asarray([1]), 8, 8, TreeConfig(10, 3, 4))


def test_cache_surgery_rejects_bad_shapes(target, prompts):
    pre = prefill(target, prompts["text"], max_length=16)
    one = jnp.asarray(6, jnp.int32)
    with pytest.raises(ValueError, match="positions"):
        cached_forward(target, pre.cache, jnp.asarray([[1, 2]]), jnp.asarray([[6, 7, 8]]), one, pre.cache.valid,
                       one, jnp.ones((1, 2, 2), bool), tree_attn=tree_decode_attention)
    pre = prefill(target, prompts["text"], max_length=16)
    with pytest.raises(ValueError, match="block_mask"):
        cached_forward(target, pre.cache, jnp.asarray([[1, 2]]), jnp.asarray([[6, 7]]), one, pre.cache.valid, one,
                       jnp.ones((1, 3, 2), bool), tree_attn=tree_decode_attention)
    with pytest.raises(ValueError, match="src / count"):
        compact_cache(pre.cache, one, jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32))
