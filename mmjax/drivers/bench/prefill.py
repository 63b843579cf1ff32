"""Prefill benchmark (GPU): time to first token of Qwen2.5-VL (7B shape, random bf16 weights) on video.

    mmjax bench prefill [--tokens 16384,65536,131072] [--attention dense,cudnn] [--layers 28]
                        [--vision-layers 32] [--out bench/results/prefill_<device>_<date>.json]

For each video length and attention implementation it reports, separately, the vision tower
(patch embed + 32 blocks + merger over all frames) and the language model (embedding merge + 28
decoder layers + last-token logits, KV cache filled), each as the median of ``--repeats`` timed
runs after one compile/warm-up run. Video frames are 448 x 448 (32 x 32 patches, 256 tokens per
temporal patch). ``--layers`` / ``--vision-layers`` shrink the model when device time is short; the
JSON records the shape actually run. Results are written after every measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.drivers.args import ArgumentParser, int_list, out_file, positive_int
from mmjax.files import atomic_write, check_output_dir
from models.attention import resolve_attention
from models.qwen2_5_vl import model as qwen_vl
from models.qwen2_5_vl.config import preset

FRAME_PATCHES = 32  # 448 px / 14


def video_inputs(config, n_tokens: int, rng: np.random.Generator):
    """A prompt of 8 text tokens, one video of ``n_tokens`` pad tokens (rounded to whole temporal
    patches), 8 text tokens. Returns processor-style arrays."""
    per_t = (FRAME_PATCHES // config.vision.spatial_merge_size) ** 2
    t = max(1, n_tokens // per_t)
    grid = (t, FRAME_PATCHES, FRAME_PATCHES)
    text = list(range(100, 108))
    ids = text + [config.vision_start_token_id] + [config.video_token_id] * (t * per_t) + \
        [config.vision_end_token_id] + text
    pixels = rng.standard_normal((t * FRAME_PATCHES * FRAME_PATCHES, config.vision.patch_dim), np.float32)
    return dict(input_ids=np.asarray([ids], np.int32), pixel_values_videos=pixels.astype(jnp.bfloat16),
                video_grid_thw=np.asarray([grid]), second_per_grid_ts=np.asarray([1.0], np.float32))


def timed(fn, repeats: int):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - t0)
    return first, statistics.median(runs), runs


ATTENTIONS = ("dense", "cudnn")


def attention_list(text: str) -> tuple[str, ...]:
    """Comma-separated names from `ATTENTIONS`."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in names if x not in ATTENTIONS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated names from {ATTENTIONS}; received {text!r}")
    return names


def main(argv=None):
    ap = ArgumentParser(prog="mmjax bench prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int_list, default="16384,65536,131072", help="comma-separated token counts")
    ap.add_argument("--attention", type=attention_list, default="dense,cudnn",
                    help=f"comma-separated attention kinds from {ATTENTIONS}")
    ap.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default: the preset's 28)")
    ap.add_argument("--vision-layers", type=positive_int, default=None,
                    help="vision blocks (default: the preset's 32)")
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--mlp-chunk", type=positive_int, default=8192)
    ap.add_argument("--vision-only", action="store_true", help="time the vision tower only (no decoder)")
    ap.add_argument("--out", type=out_file, default=None,
                    help="result JSON file (default bench/results/prefill_<device>_<date>.json; replaced)")
    args = ap.parse_args(argv)

    cfg = preset("7b")
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, num_hidden_layers=args.layers))
    if args.vision_layers is not None:
        full = tuple(i for i in cfg.vision.fullatt_block_indexes if i < args.vision_layers)
        cfg = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, depth=args.vision_layers,
                                                                  fullatt_block_indexes=full))
    device = jax.devices()[0]
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join("bench", "results",
                                   f"prefill_{device.device_kind.replace(' ', '_')}_{date}.json")
    report = {"benchmark": "prefill", "date": date, "device": device.device_kind, "platform": device.platform,
              "jax": jax.__version__, "python": platform.python_version(), "model": "Qwen2.5-VL-7B shape, random bf16",
              "decoder_layers": cfg.text.num_hidden_layers, "vision_blocks": cfg.vision.depth,
              "frame": f"{FRAME_PATCHES * 14}x{FRAME_PATCHES * 14}", "mlp_chunk": args.mlp_chunk,
              "repeats": args.repeats, "results": []}

    if args.out is None:
        check_output_dir(os.path.dirname(out), "--out")

    def dump():  # rewritten after every measurement, atomically
        atomic_write(out, json.dumps(report, indent=1), overwrite=True)

    t0 = time.perf_counter()
    model = qwen_vl.Qwen2_5_VL(cfg, dtype=jnp.bfloat16, key=jax.random.key(0))
    jax.block_until_ready(jax.tree.leaves(model))
    report["init_s"] = time.perf_counter() - t0
    print(f"{device.device_kind}: model initialised in {report['init_s']:.1f}s "
          f"({cfg.text.num_hidden_layers} decoder layers, {cfg.vision.depth} vision blocks)", flush=True)
    rng = np.random.default_rng(0)
    print(f"{'tokens':>8} {'attention':>9} {'vision_s':>9} {'lm_s':>8} {'ttft_s':>8} {'compile_lm_s':>12}", flush=True)
    for n in args.tokens:
        inputs = video_inputs(cfg, n, rng)
        p = qwen_vl.prepare_inputs(cfg, **inputs)
        pixels = jax.device_put(p.pixel_values_videos)
        v_first, v_med, _ = timed(lambda: qwen_vl.vision_features(model, pixels, p.video_grids), args.repeats)
        feats = qwen_vl.vision_features(model, pixels, p.video_grids)
        t = p.input_ids.shape[1]
        if args.vision_only:
            stats = device.memory_stats() or {}
            report["results"].append({"tokens": t, "video_grid_thw": list(p.video_grids[0]), "vision_s": v_med,
                                      "vision_first_s": v_first,
                                      "peak_gib_so_far": stats.get("peak_bytes_in_use", 0) / 2**30})
            print(f"{t:>8} {'-':>9} {v_med:>9.3f}", flush=True)
            dump()
            continue
        for name in args.attention:
            attention = resolve_attention(name)

            def lm():
                return qwen_vl.prefill_language_model(
                    model, p.input_ids, None, feats, p.position_ids, p.attention_mask, p.token_types, p.rope_deltas,
                    attention=attention, max_length=t + 256, mlp_chunk=args.mlp_chunk)[0]
            row = {"tokens": t, "video_grid_thw": list(p.video_grids[0]), "attention": name,
                   "vision_s": v_med, "vision_first_s": v_first}
            try:
                l_first, l_med, l_runs = timed(lm, args.repeats)
                row.update(lm_s=l_med, lm_first_s=l_first, lm_runs_s=l_runs, ttft_s=v_med + l_med)
                print(f"{t:>8} {name:>9} {v_med:>9.3f} {l_med:>8.3f} {v_med + l_med:>8.3f} {l_first - l_med:>12.1f}",
                      flush=True)
            except Exception as e:  # report (e.g. out of memory) and go on with the next configuration
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{t:>8} {name:>9} failed: {row['error']}", flush=True)
            stats = device.memory_stats() or {}
            if "peak_bytes_in_use" in stats:  # cumulative over the process: includes earlier rows
                row["peak_gib_so_far"] = stats["peak_bytes_in_use"] / 2**30
            report["results"].append(row)
            dump()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
