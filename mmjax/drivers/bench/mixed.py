"""Mixed-modality benchmark: per-head plans from `mmjax.search` vs cuDNN on MM-NIAH-like
inputs (video frames with 25% text segments between them, `mixed_inputs`).

1. Calibration: a short slice of the same kind of input (``calib_len`` tokens); the search
   picks one boundary pattern per head (cost = measured kernel time on a GPU, FLOPs else).
2. Apply: at each length, the heads are grouped by the boundary type the search chose;
   per type, the plan's end-to-end time (estimation + layout + kernel, one jit) is compared
   with cuDNN on the same heads, and the recall (softmax mass kept) is measured at
   ``recall_len``. "all" runs every head with its own plan in one call.

Heads are planted per GQA group (`mixed_inputs.planted_qkv`): group g has plant
``plants[g]``, so each boundary type should come out for one group.
"""

from __future__ import annotations

import dataclasses
import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.drivers.args import ArgumentParser, add_result_args, positive_int
from mmjax.drivers.bench.report import print_table, write_result
from mmjax.sparse.attention import attend_heads, attention_recall, gather_heads
from mmjax.sparse.modality import Modality
from mmjax.sparse.pattern_search import Calibration, SearchSpace, search
from mmjax.sparse.patterns import KernelOptions
from mmjax.sparse.synthetic import PLANTS, interleaved_kinds, planted_qkv
from mmjax.timing import device_name, time_fn
from pallas_kernels.block_sparse.layout import causal_pairs


@dataclasses.dataclass(frozen=True)
class MixedBenchConfig:
    seq_lens: tuple[int, ...] = (131072, 524288, 1048576)
    calib_len: int = 16384
    recall_len: int = 131072
    heads: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    frame_tokens: int = 192
    text_tokens: int = 64
    text_keys: int = 1024
    interpret: bool = False
    anchor: str = "cudnn"
    dtype: str = "bfloat16"
    space: SearchSpace = SearchSpace(ashape=((64, 1024), (1024, 1024)), vertical_slash=(), grid_local=(1024,),
                                     grid_flags=((False, True, False),), grid_strides=("search",))


GPU_CONFIG = MixedBenchConfig()
CPU_CONFIG = MixedBenchConfig(
    seq_lens=(512, 1024), calib_len=512, recall_len=512, heads=4, kv_heads=4, head_dim=32, frame_tokens=48,
    text_tokens=16, text_keys=None, interpret=True, anchor="xla", dtype="float32",
    space=SearchSpace(ashape=((16, 32), (128, 32)), vertical_slash=(), grid_local=(32,),
                      grid_flags=((False, True, False),), grid_strides=("search",), grid_stride_space=(32, 48, 64, 96, 128), last_q=16,
                      block_q=32, block_k=16))


def _inputs(cfg: MixedBenchConfig, s: int, seed: int):
    kinds = interleaved_kinds(s, cfg.frame_tokens, cfg.text_tokens)
    plants = tuple(PLANTS[h * len(PLANTS) // cfg.heads] for h in range(cfg.heads))  # one plant per GQA group
    q, k, v = planted_qkv(jax.random.PRNGKey(seed), kinds, plants, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                          frame_tokens=cfg.frame_tokens, text_tokens=cfg.text_tokens, text_keys=cfg.text_keys,
                          dtype=jnp.dtype(cfg.dtype))
    return q, k, v, Modality.from_token_types(kinds[None]), plants


def _reps(s: int) -> int:
    return 3 if s <= 131072 else (2 if s <= 524288 else 1)


def run_benchmark(cfg: MixedBenchConfig, out_dir: str | None, log=print, result_name: str = "mixed") -> dict:
    log(f"device: {device_name()} ({jax.default_backend()}), jax {jax.__version__}")
    search_opts = KernelOptions(implementation="reference") if cfg.interpret else KernelOptions()
    opts = KernelOptions(interpret=cfg.interpret, implementation="triton" if cfg.interpret else None)
    q, k, v, m, plants = _inputs(cfg, cfg.calib_len, seed=1)
    config, report = search(Calibration(((q, k, v),), m), space=cfg.space, options=search_opts,
                            return_report=True)
    plan = config.layers[0]
    types = [type(p).__name__ for p in plan]
    log("search: " + ", ".join(f"head {h} ({plants[h]}): {t}" for h, t in enumerate(types)))
    result = {"config": {**dataclasses.asdict(cfg), "space": repr(cfg.space)}, "plants": plants,
              "plan": [repr(p) for p in plan], "types": types, "search_report": report, "rows": []}
    rows = result["rows"]
    del q, k, v
    groups = {}
    for h, t in enumerate(types):
        groups.setdefault(t, []).append(h)
    groups["all"] = list(range(cfg.heads))
    for s in cfg.seq_lens:
        q, k, v, m, _ = _inputs(cfg, s, seed=2)
        jax.block_until_ready((q, k, v))
        anchor_ms = {}  # cuDNN time depends on the head count only: measured once per count
        for t, heads in groups.items():
            try:
                rows.append(_one(cfg, s, t, heads, plan, plants, q, k, v, m, opts, anchor_ms))
            except Exception as e:  # reported, not fatal
                rows.append({"S": s, "type": t, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            log(f"  {rows[-1]}")
            gc.collect()
        del q, k, v
        gc.collect()
        if out_dir:  # after every length, so a cut-off run keeps what it measured
            log(f"wrote {write_result(out_dir, result_name, result)}")
    log("")
    print_table(rows, [("S", "S", "d"), ("type", "type", "s"), ("heads", "heads", "s"), ("plants", "plants", "s"),
                       ("density", "density", ".4f"), ("recall", "recall", ".3f"), ("sparse_ms", "sparse ms", ".2f"),
                       ("anchor_ms", f"{cfg.anchor} ms", ".2f"), ("speedup", f"x {cfg.anchor}", ".2f")])
    return result


def _one(cfg, s, t, heads, plan, plants, q, k, v, m, opts, anchor_ms: dict) -> dict:
    hs = tuple(heads)
    qg, kg, vg = gather_heads(q, k, v, hs)
    pats = tuple(plan[h] for h in hs)
    sparse = jax.jit(lambda q, k, v, m: attend_heads(q, k, v, pats, m, options=opts)[0])
    anchor = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                  implementation=cfg.anchor))
    t_sparse = time_fn(lambda: sparse(qg, kg, vg, m), reps=_reps(s))["ms"]
    if len(hs) not in anchor_ms:
        anchor_ms[len(hs)] = time_fn(lambda: anchor(qg, kg, vg), reps=_reps(s))["ms"]
    t_anchor = anchor_ms[len(hs)]
    row = {"S": s, "type": t, "heads": ",".join(map(str, hs)), "plants": ",".join(sorted({plants[h] for h in hs})),
           "sparse_ms": t_sparse, "anchor_ms": t_anchor, "speedup": t_anchor / t_sparse,
           "tflops_dense_equiv": 4.0 * cfg.head_dim * len(hs) * causal_pairs(s, s) / t_sparse / 1e9}
    dens = []
    for p, group in _by_pattern(pats):
        qh, kh, _ = gather_heads(qg, kg, vg, group)
        lay = jax.jit(lambda q, k, m, p=p: p.build_layout(q, k, modality=m))(qh, kh, m)
        dens.append(float(np.mean(np.asarray(lay.density()))) * len(group))
        del lay
    row["density"] = sum(dens) / len(hs)
    if s == cfg.recall_len:
        rec = jax.jit(lambda q, k, v, m: attention_recall(q, k, v, list(pats), m, options=opts))(qg, kg, vg, m)
        row["recall"] = float(np.mean(np.asarray(rec)))
        row["recall_min_head"] = float(np.min(np.asarray(rec)))
    return row


def _by_pattern(pats):
    groups = {}
    for i, p in enumerate(pats):
        groups.setdefault(p, []).append(i)
    return [(p, tuple(g)) for p, g in groups.items()]


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="mmjax bench mixed", description=__doc__.split("\n\n")[0])
    add_result_args(p, "mixed")
    p.add_argument("--cpu", action="store_true", help="small interpret-mode run even on a GPU")
    p.add_argument("--seq-lens", type=positive_int, nargs="+", help="sequence lengths")
    p.add_argument("--calib-len", type=positive_int, help="calibration length of the search")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu" and not args.cpu
    cfg = GPU_CONFIG if on_gpu else CPU_CONFIG
    if args.seq_lens:
        cfg = dataclasses.replace(cfg, seq_lens=tuple(args.seq_lens))
    if args.calib_len:
        cfg = dataclasses.replace(cfg, calib_len=args.calib_len)
    if not on_gpu:
        print("no GPU: small interpret-mode run (timings are not kernel speed)")
    run_benchmark(cfg, args.out, result_name=args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
