"""Speculative decoding benchmark: step costs of Sparrow-style drafting and tree verification.

On a GPU: Qwen2.5-VL-7B shape, random bf16 weights, batch 1. A prompt of ``text_tokens`` text
tokens plus V visual tokens (0.5k, 6k, 17k, 25k) is represented by a filled KV cache (random
contents: step costs do not depend on the values). Per V it times

* the draft round: committing the accepted path (``extend``, depth + 1 entries) plus growing the
  draft tree (``depth - 1`` expansions of ``top_k`` frontier nodes + tree selection), with the VATA
  cache (text positions only) and with the full visual KV (MSD-style: every prompt position);
* one plain decode step of the target (dense attention over the cache);
* the verification: one target pass over the ``total_tokens + 1`` tree tokens with the tree mask,
  greedy acceptance and cache compaction, with the split-K Pallas kernel
  (``pallas_kernels.tree_decode``) and with its pure-JAX reference (XLA);
* one whole speculative step (drafting + verification + commit), VATA draft.

From these it *projects* the decoding speedup for given accepted lengths tau (including the
Sparrow paper's 3.83): speedup = tau * t_decode / t_step. The projection assumes the acceptance
rates; with random weights the measured tau means nothing and is not reported.

On a CPU the same table runs on a tiny configuration (timings only show that everything runs).
"""

from __future__ import annotations

import dataclasses
import functools
import gc

import jax
import jax.numpy as jnp

from mmjax.drivers.args import ArgumentParser, add_result_args, int_list, positive_int, tree_list
from mmjax.drivers.bench.report import print_table, write_result
from mmjax.speculative.draft import DraftCache, SparrowDraft
from mmjax.speculative.sampling import Sampling
from mmjax.speculative.step import draft_tree, speculative_step, verify_tree
from mmjax.speculative.tree import Tree, TreeConfig
from mmjax.speculative.verify import accept_greedy
from mmjax.timing import device_name, time_fn
from models.kv_cache import KVCache, compact_cache
from models.qwen2_5_vl import model as qwen_vl
from models.qwen2_5_vl.config import Qwen2_5_VLConfig, VisionConfig, preset
from models.text_decoder import TextConfig
from pallas_kernels.tree_decode import tree_decode_attention


@dataclasses.dataclass(frozen=True)
class SpecBenchConfig:
    visual_tokens: tuple[int, ...] = (512, 6144, 17408, 25600)
    text_tokens: int = 64
    trees: tuple[str, ...] = ("30-4-8", "48-5-10")
    taus: tuple[float, ...] = (2.0, 3.0, 3.83, 4.5)
    generated_slots: int = 256
    reps: int = 10


def _tiny_model(dtype):
    text = TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 3, 3))
    vision = VisionConfig(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                          fullatt_block_indexes=(0,), window_size=56)
    return qwen_vl.Qwen2_5_VL(Qwen2_5_VLConfig(text=text, vision=vision), dtype=dtype, key=jax.random.key(0))


def _target_cache(c: TextConfig, prompt: int, slots: int, dtype, key) -> KVCache:
    shape = (c.num_hidden_layers, 1, slots, c.num_key_value_heads, c.head_dim)
    k1, k2 = jax.random.split(key)
    k = jax.random.normal(k1, shape, dtype)
    v = jax.random.normal(k2, shape, dtype)
    valid = jnp.arange(slots)[None] < prompt
    return KVCache(k, v, valid, jnp.asarray(prompt, jnp.int32), jnp.asarray([prompt], jnp.int32))


def _draft_cache(c: TextConfig, kept: int, slots: int, tree: TreeConfig, dtype, key) -> DraftCache:
    k1, k2 = jax.random.split(key)
    shape = (1, kept + slots, c.num_key_value_heads, c.head_dim)
    pool = (1, max(tree.expanded_slots, 1), c.num_key_value_heads, c.head_dim)
    return DraftCache(jax.random.normal(k1, shape, dtype), jax.random.normal(k2, shape, dtype),
                      jnp.arange(kept + slots)[None] < kept, jnp.asarray(kept, jnp.int32), jnp.zeros(pool, dtype),
                      jnp.zeros(pool, dtype))


@jax.jit
def _decode(model, cache, tok):
    return qwen_vl.decode_step(model, cache, tok)


def _draft_round_fn(tree: TreeConfig):
    @jax.jit
    def fn(model, draft, dstate, feats, root):
        d1 = tree.depth + 1
        toks = jnp.broadcast_to(root[:, None], (1, d1))
        pos = dstate.length + jnp.arange(d1, dtype=jnp.int32)[None]
        dstate, z, lg = draft.extend(model, dstate, toks, feats, pos, jnp.asarray([d1], jnp.int32))
        dstate, t = draft_tree(model, draft, dstate, root, z, lg, pos[:, -1], tree)
        return t.tokens, dstate.pool_k
    return fn


def _verify_fn(tree: TreeConfig, attn=tree_decode_attention):
    @jax.jit
    def fn(model, cache, tokens, ancestors, depth, parent, path, children):
        t = Tree(tokens, parent, depth, ancestors, path, children)
        logits, hidden, cache2 = verify_tree(model, cache, t, (model.config.text.num_hidden_layers - 1,), attn)
        path_, count, bonus = accept_greedy(t, logits)
        cache2 = compact_cache(cache2, cache.length, path_, count)
        return cache2.k[0, 0, 0, 0, 0], hidden[0, 0, 0, 0], bonus
    return fn


def run(cfg: SpecBenchConfig, model, on_gpu: bool, on_row=None) -> list[dict]:
    c = model.config.text
    dtype = model.language_model.embed[...].dtype
    key = jax.random.key(1)
    draft = SparrowDraft.init(model, key)
    rows = []
    for tree_s in cfg.trees:
        tree = TreeConfig.parse(tree_s)
        round_fn, verify_fn = _draft_round_fn(tree), _verify_fn(tree)
        verify_xla = _verify_fn(tree, functools.partial(tree_decode_attention, implementation="reference"))
        scratch = max(tree.n_tree, tree.expanded_slots)
        for vis in cfg.visual_tokens:
            prompt = cfg.text_tokens + vis
            row = {"tree": tree_s, "visual_tokens": vis, "prompt_tokens": prompt}
            feats = jax.random.normal(key, (1, tree.depth + 1, c.hidden_size), dtype)
            root = jnp.asarray([7], jnp.int32)
            for name, kept in (("vata", cfg.text_tokens + 1), ("full_kv", prompt)):
                dstate = _draft_cache(c, kept, cfg.generated_slots, tree, dtype, key)
                r = time_fn(lambda: round_fn(model, draft, dstate, feats, root), reps=cfg.reps)
                row[f"draft_round_{name}_ms"] = r["ms"]
                del dstate
            cache = _target_cache(c, prompt, prompt + cfg.generated_slots + scratch, dtype, key)
            tok = jnp.asarray([5], jnp.int32)
            row["decode_ms"] = time_fn(lambda: _decode(model, cache, tok), reps=cfg.reps)["ms"]
            # a tree of the configured shape: select from a drafted pool (values do not matter for timing)
            dstate = _draft_cache(c, cfg.text_tokens + 1, cfg.generated_slots, tree, dtype, key)
            t = jax.jit(lambda m, d, s, r: draft_tree(m, d, s, r, jnp.zeros((1, 1, c.hidden_size), dtype),
                                                      jnp.zeros((1, 1, c.vocab_size), jnp.float32) + jnp.arange(c.vocab_size) * 1e-3,
                                                      jnp.asarray([prompt], jnp.int32), tree)[1])(model, draft, dstate, root)
            targs = (t.tokens, t.ancestors, t.depth, t.parent, t.path, t.children)
            row["verify_ms"] = time_fn(lambda: verify_fn(model, cache, *targs), reps=cfg.reps)["ms"]
            row["verify_xla_attention_ms"] = time_fn(lambda: verify_xla(model, cache, *targs), reps=cfg.reps)["ms"]
            # one whole speculative step (VATA draft); the cache is donated, so re-create per call
            z = jnp.zeros((1, 1, c.hidden_size), dtype)
            lg = jnp.zeros((1, 1, c.vocab_size), jnp.float32)
            holder = {"cache": cache, "dstate": dstate}

            def step():
                out = speculative_step(model, draft, holder["cache"], holder["dstate"], root, z, lg, jax.random.key(0),
                                       tree=tree, sampling=_GREEDY)
                holder["cache"] = dataclasses.replace(out[0], length=jnp.asarray(prompt, jnp.int32),
                                                      next_position=jnp.asarray([prompt], jnp.int32),
                                                      valid=jnp.arange(out[0].max_length)[None] < prompt)
                holder["dstate"] = dataclasses.replace(out[1], length=jnp.asarray(cfg.text_tokens + 1, jnp.int32))
                return out[2]

            row["step_ms"] = time_fn(step, reps=cfg.reps)["ms"]
            row["verify_over_decode"] = row["verify_ms"] / row["decode_ms"]
            row["vata_round_over_full"] = row["draft_round_vata_ms"] / row["draft_round_full_kv_ms"]
            for tau in cfg.taus:
                row[f"proj_speedup_tau{tau}"] = tau * row["decode_ms"] / row["step_ms"]
            rows.append(row)
            print(row, flush=True)
            if on_row is not None:
                on_row(rows)
            del cache, holder, dstate
            gc.collect()
    return rows


_GREEDY = Sampling()


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="mmjax bench speculative", description=__doc__.split("\n")[0])
    add_result_args(ap, "speculative")
    ap.add_argument("--visual", type=int_list, default=None, help="comma-separated visual token counts")
    ap.add_argument("--trees", type=tree_list, default=None, help="comma-separated trees, e.g. 30-4-8,48-5-10")
    ap.add_argument("--layers", type=positive_int, default=None, help="shrink the target's decoder (device time)")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    cfg = SpecBenchConfig()
    if args.visual:
        cfg = dataclasses.replace(cfg, visual_tokens=args.visual)
    if args.trees:
        cfg = dataclasses.replace(cfg, trees=args.trees)
    if on_gpu:
        mc = preset("7b")
        if args.layers:
            mc = dataclasses.replace(mc, text=dataclasses.replace(mc.text, num_hidden_layers=args.layers))
        model = qwen_vl.Qwen2_5_VL(mc, dtype=jnp.bfloat16, key=jax.random.key(0))
        shape = "qwen2.5-vl-7b"
    else:
        cfg = dataclasses.replace(cfg, visual_tokens=(64, 256), text_tokens=16, trees=("10-3-4",), reps=2,
                                  generated_slots=32)
        model = _tiny_model(jnp.float32)
        shape = "tiny"
    def save(rows, table=None):
        return write_result(args.out, args.name, {"config": dataclasses.asdict(cfg), "model_shape": shape,
                                                  "layers": model.config.text.num_hidden_layers, "rows": rows,
                                                  "table": table, "device": device_name(),
                                                  "note": "speedups are projections: tau * t_decode / t_step"})

    rows = run(cfg, model, on_gpu, save)
    cols = [("tree", "tree", "s"), ("visual_tokens", "visual", "d"), ("draft_round_vata_ms", "round VATA ms", ".3f"),
            ("draft_round_full_kv_ms", "round full-KV ms", ".3f"), ("decode_ms", "decode ms", ".3f"),
            ("verify_ms", "verify ms", ".3f"), ("verify_xla_attention_ms", "verify (XLA attn) ms", ".3f"),
            ("step_ms", "spec step ms", ".3f"),
            ("verify_over_decode", "verify/decode", ".2f")] + \
        [(f"proj_speedup_tau{t}", f"proj x @tau={t}", ".2f") for t in cfg.taus]
    table = print_table(rows, cols)
    path = save(rows, table)
    print("wrote", path)
    return 0
