"""Full-model prefill benchmark: time to first token and peak memory of a long video through the
public `mmjax.prefill`, dense (cuDNN) against sparse configs.

    mmjax bench prefill [--preset 7b | --preset llava-ov-7b | --model DIR] [--tokens 131072 262144 524288 1048576]
                        [--configs cudnn grid ashape ...] [--devices N [--sequence-parallel S]]
                        [--out bench/results] [--plot]
    mmjax bench prefill --preset llama3.1-8b | qwen3-8b | qwen3-30b-a3b --tokens 131072 --configs cudnn momo vs

Each (video length, attention) row runs in its own process, so its peak GPU memory
(``memory_stats()["peak_bytes_in_use"]``) is its own: the model (random bf16 weights of the
preset, or a checkpoint directory), one 448 x 448 video (LLaVA-OneVision presets: 384 x 384 frames, 196
pooled tokens each) of the given number of visual tokens between two short text segments (for a text LM preset or
checkpoint: that many random text tokens), then ``mmjax.prefill`` twice: the first call (compile + run) and
a warm call (the time to first token of a compiled program: host preparation, vision tower,
decoder, last-token logits). When the first call takes longer than ``--warm-budget-s`` the warm
call is not repeated: the two programs are compiled once more ahead of time and the warm time is
the first call minus that compile time (``warm_estimated`` in the JSON). Columns: first call,
warm TTFT, speedup over the dense row of the same length, peak memory (the largest of the mesh's
devices with ``--devices N``: the model loaded into its tensor-parallel layout over N devices, S of
them splitting the tokens with ``--sequence-parallel S``; the warm call is then always run), tokens
per second; ``--breakdown`` adds the host preparation and the vision tower timed alone and the decoder's
share (warm - both). Rows are written to the JSON (``--name``, by default ``prefill`` for the 7b preset and
``prefill-<preset or checkpoint directory>`` otherwise) as they finish; ``--plot`` draws TTFT and memory against tokens.

Attention names: ``cudnn`` (dense cuDNN flash attention), ``dense`` (exact XLA attention, slow),
``grid`` (``Grid(local=1024)`` on every head), ``ashape`` (``AShape(sink=1024, local=4096, block_k=128)``,
the MMInference budget in 128-key blocks, the Mosaic GPU kernel's faster tile: 1.06 s of attention at 262k on an
H200 against 1.18 s with 64-key blocks, which keep up to 64 fewer keys per row), ``vs``
(``VerticalSlash(1000, 4096)``), ``momo`` (``Momo()``, its default budget), or the path of a SparseConfig JSON.
On a CPU the same table runs on a tiny model (timings only show that everything runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import mmjax
from mmjax import video_upload
from mmjax.drivers.args import ArgumentParser, add_result_args, positive_float, positive_int
from mmjax.drivers.bench import trace_summary
from mmjax.drivers.bench.report import print_table, write_result
from mmjax.files import slug
from mmjax.inference import PROCESSOR_KEYS, runner, with_frame_tokens
from mmjax.parallel import devices_mesh, shard_model
from mmjax.parallel import vision as parallel_vision
from mmjax.patterns import AShape, Grid, Momo, VerticalSlash
from mmjax.timing import device_name
from models import llama, llava_onevision, qwen3
from models.attention import resolve_attention
from models.causal_lm import CausalLM, CausalLMConfig
from models.causal_lm import model as causal_lm_runner
from models.llava_onevision import model as llava_ov
from models.qwen2_5_vl import Qwen2_5_VL, Qwen2_5_VLConfig, VisionConfig, preset
from models.qwen2_5_vl import model as qwen_vl
from models.text_decoder import TextConfig

FRAME_PX = 448  # video frames of 448 x 448 pixels: 32 x 32 patches, 256 tokens per temporal patch
PATTERNS = {
    "grid": Grid(local=1024),
    "ashape": AShape(sink=1024, local=4096, block_k=128),
    "vs": VerticalSlash(vertical_size=1000, slash_size=4096),
    "momo": Momo(),
}
VLM_PRESETS = ("3b", "7b", "llava-ov-0.5b", "llava-ov-7b")  # Qwen2.5-VL, LLaVA-OneVision
TEXT_PRESETS = {"llama3.1-8b": lambda: llama.preset("8b"), "qwen3-8b": lambda: qwen3.preset("8b"),
                "qwen3-30b-a3b": lambda: qwen3.preset("30b-a3b")}


def tiny_config() -> Qwen2_5_VLConfig:
    """A small Qwen2.5-VL for CPU runs of this benchmark."""
    text = TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, mrope_section=(4, 6, 6))
    vision = VisionConfig(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=128,
                          fullatt_block_indexes=(1,), window_size=112)
    return Qwen2_5_VLConfig(text=text, vision=vision, image_token_id=500, video_token_id=501, vision_start_token_id=502,
                            vision_end_token_id=503)


def tiny_text_config(moe: bool) -> CausalLMConfig:
    """A small text LM (a Qwen3-MoE one for ``moe``) for CPU runs of this benchmark."""
    text = TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, qk_norm=True,
                      **(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64) if moe else {}))
    return CausalLMConfig("qwen3_moe" if moe else "qwen3", text)


def text_inputs(config: CausalLMConfig, n_tokens: int, seed: int = 0) -> dict:
    """Tokenizer-style NumPy inputs: ``n_tokens`` random token ids, no padding."""
    ids = np.random.default_rng(seed).integers(0, config.text.vocab_size, (1, n_tokens), dtype=np.int32)
    return dict(input_ids=ids, attention_mask=np.ones_like(ids))


def tiny_llava_config() -> llava_onevision.LlavaOnevisionConfig:
    """A small LLaVA-OneVision for CPU runs of this benchmark (70 x 70 tiles: 5 x 5 patches, 9 pooled tokens)."""
    text = TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, mrope_section=(16, 0, 0))
    vision = llava_onevision.VisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=70)
    return llava_onevision.LlavaOnevisionConfig(text=text, vision=vision, image_token_id=500, video_token_id=501,
                                                image_grid_pinpoints=((70, 70), (70, 140), (140, 70), (140, 140)))


def llava_video_inputs(config: llava_onevision.LlavaOnevisionConfig, n_tokens: int, seed: int = 0) -> dict:
    """Processor-style NumPy inputs of a LLaVA-OneVision: 8 text tokens, one video of whole frames (ceil(g/2)**2
    pooled tokens each, plus the newline) with about ``n_tokens`` visual tokens, 8 text tokens. The pixels (float16)
    repeat a random block of 16 frames."""
    v = config.vision
    per_frame = (v.grid + 1) // 2 * ((v.grid + 1) // 2)
    frames = max(1, (n_tokens - 1) // per_frame)
    text = [100 + i % 8 for i in range(8)]
    ids = text + [config.video_token_id] * (frames * per_frame + 1) + text
    block = np.random.default_rng(seed).standard_normal((min(frames, 16), 3, v.image_size, v.image_size),
                                                        np.float32).astype(np.float16)
    pixels = np.tile(block, (-(-frames // len(block)), 1, 1, 1))[:frames]
    return dict(input_ids=np.asarray([ids], np.int32), pixel_values_videos=pixels[None])


def video_inputs(config: Qwen2_5_VLConfig, n_tokens: int, seed: int = 0, *, pixels: bool = True) -> dict:
    """Processor-style NumPy inputs: 8 text tokens, one video of about ``n_tokens`` visual tokens
    (whole temporal patches of FRAME_PX x FRAME_PX frames), 8 text tokens. The pixels repeat a
    random block of 64 temporal patches (generating 1M tokens' worth of noise is slow); ``pixels=False``:
    a zero-stride view of one row instead (shapes only, no memory)."""
    if isinstance(config, llava_onevision.LlavaOnevisionConfig):
        return llava_video_inputs(config, n_tokens, seed)
    vc = config.vision
    side = FRAME_PX // vc.patch_size
    per_t = (side // vc.spatial_merge_size) ** 2
    t = max(1, n_tokens // per_t)
    text = [100 + i % 8 for i in range(8)]
    ids = text + [config.vision_start_token_id] + [config.video_token_id] * (t * per_t) + \
        [config.vision_end_token_id] + text
    if pixels:
        block = np.random.default_rng(seed).standard_normal((min(t, 64) * side * side, vc.patch_dim), np.float32)
        reps = -(-t * side * side // block.shape[0])
        values = np.tile(block, (reps, 1))[:t * side * side]
    else:
        values = np.broadcast_to(np.ones((1, vc.patch_dim), np.float32), (t * side * side, vc.patch_dim))
    return dict(input_ids=np.asarray([ids], np.int32), pixel_values_videos=values,
                video_grid_thw=np.asarray([(t, side, side)]), second_per_grid_ts=np.asarray([1.0], np.float32))


def attention_spec(name: str, config: Qwen2_5_VLConfig):
    """"cudnn" / "dense", a SparseConfig of one pattern on every head, or a SparseConfig JSON path."""
    if name in ("cudnn", "dense"):
        return name
    c = config.text
    if name in PATTERNS:
        return mmjax.SparseConfig.uniform(PATTERNS[name], num_layers=c.num_hidden_layers,
                                          num_heads=c.num_attention_heads)
    return mmjax.SparseConfig.load(name)


def result_name(name: str, preset: str, model: str | None) -> str:
    """The JSON file prefix: ``name`` as given, except that the default ``prefill`` becomes
    ``prefill-<preset>`` (or ``prefill-<checkpoint directory name>``) for any model but the 7b preset, so two
    models timed on one device and day do not overwrite each other's file."""
    if name != "prefill" or (not model and preset == "7b"):
        return name
    tag = os.path.basename(os.path.normpath(model)) if model else preset
    return "prefill-" + slug(tag, "model")


def config_name(text: str) -> str:
    """An attention name of this benchmark (see the module docstring) or an existing JSON file."""
    if text in ("cudnn", "dense", *PATTERNS) or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(f"expected one of cudnn, dense, {', '.join(PATTERNS)} or a SparseConfig JSON "
                                     f"file; received {text!r}")


def load_model(args, mesh=None):
    """Random bf16 weights of ``--preset`` (Qwen2.5-VL 3b / 7b, LLaVA-OneVision llava-ov-7b / llava-ov-0.5b, or a
    text LM), or ``--model DIR`` (any architecture ``mmjax.load`` reads), in their layout on ``mesh`` (None: one
    device)."""
    if args.model:
        return mmjax.load(args.model, dtype=jnp.bfloat16, mesh=mesh)[0]
    gpu = jax.default_backend() == "gpu"
    if args.preset in TEXT_PRESETS:
        cfg = TEXT_PRESETS[args.preset]() if gpu else tiny_text_config("a3b" in args.preset)
        cls = CausalLM
    elif args.preset.startswith("llava-ov-"):
        cfg = llava_onevision.preset(args.preset[len("llava-ov-"):]) if gpu else tiny_llava_config()
        cls = llava_onevision.LlavaOnevision
    else:
        cfg = preset(args.preset) if gpu else tiny_config()
        cls = Qwen2_5_VL
    if args.layers:
        cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, num_hidden_layers=args.layers))
    model = cls(cfg, dtype=jnp.bfloat16, key=jax.random.key(0))
    return model if mesh is None else shard_model(model, mesh)


def with_matmul(model, matmul: str):
    """``model``, or its `mmjax.quantize_fp8` copy for ``matmul == "fp8"``."""
    return mmjax.quantize_fp8(model) if matmul == "fp8" else model


def compile_seconds(model, inputs, attention, kwargs) -> float:
    """Compile time of the programs a prefill runs (vision tower for a VLM, decoder, with the attention `mmjax.prefill`
    gives it: a sparse config told the video's frame size), ahead of time."""
    run = runner(model)
    p = run.prepare_inputs(model.config, **inputs)
    t0 = time.perf_counter()
    feats = None
    if run is llava_ov:
        llava_ov.video_features.lower(model, p.pixel_values_videos, kwargs.get("frames_per_chunk")).compile()
        n_feats = int((np.asarray(p.token_types) == 2).sum())
    elif run is qwen_vl:
        qwen_vl.vision_features.lower(model, p.pixel_values_videos, p.video_grids,
                                      kwargs.get("frames_per_chunk")).compile()
        n_feats = int(np.prod(p.video_grids[0])) // model.config.vision.merge_unit
    if run is not causal_lm_runner:
        feats = jax.ShapeDtypeStruct((n_feats, model.config.text.hidden_size), jnp.bfloat16)
    run.prefill_language_model.lower(
        model, p.input_ids, None, feats, p.position_ids, p.attention_mask, p.token_types, p.rope_deltas,
        attention=resolve_attention(with_frame_tokens(attention, run.frame_tokens(model.config, p))),
        max_length=p.input_ids.shape[1] + 256,
        mlp_chunk=kwargs.get("mlp_chunk"), kv_dtype=kwargs.get("kv_dtype")).compile()
    return time.perf_counter() - t0


def phase_seconds(model, inputs: dict, frames_per_chunk, mesh) -> dict:
    """Seconds of the first two phases of a warm `mmjax.prefill` timed alone: ``host_s`` (the port's
    ``prepare_inputs`` on the host) and ``vision_s`` (the vision tower, features on the device; 0 for a
    text LM). The decoder's share is the warm time minus both."""
    run = runner(model)
    t0 = time.perf_counter()
    p = run.prepare_inputs(model.config, **{k: inputs[k] for k in PROCESSOR_KEYS if k in inputs})
    host = time.perf_counter() - t0
    if run is causal_lm_runner:
        return {"host_s": host, "vision_s": 0.0}
    t0 = time.perf_counter()
    if video_upload.streams(model, p, mesh):  # as mmjax.prefill encodes it
        feats = video_upload.visual_inputs(model, p, frames_per_chunk, mesh)
    elif mesh is not None and run in (qwen_vl, llava_ov):
        feats = parallel_vision.visual_inputs(model, p, frames_per_chunk, mesh)
    else:
        feats = run.visual_inputs(model, p, frames_per_chunk)
    jax.block_until_ready(feats)
    return {"host_s": host, "vision_s": time.perf_counter() - t0}


def run_row(args, tokens: int, name: str) -> dict:
    """One (length, attention) row in this process."""
    mesh = devices_mesh(args.devices, args.sequence_parallel)
    t0 = time.perf_counter()
    model = with_matmul(load_model(args, mesh), args.matmul)
    jax.block_until_ready(jax.tree.leaves(model))
    init_s = time.perf_counter() - t0
    text_lm = isinstance(model, CausalLM)
    inputs = text_inputs(model.config, tokens) if text_lm else video_inputs(model.config, tokens)
    attention = attention_spec(name, model.config)
    kwargs = dict(mlp_chunk=args.mlp_chunk, frames_per_chunk=args.frames_per_chunk, chunk_tokens=args.chunk_tokens,
                  kv_dtype=jnp.float8_e4m3fn if args.kv_dtype == "fp8" else None)
    visual = 0 if text_lm else int(np.isin(inputs["input_ids"], [model.config.video_token_id]).sum())
    row = {"tokens": int(inputs["input_ids"].shape[1]), "visual_tokens": visual,
           "attention": name, "init_s": init_s, **{k: (args.kv_dtype if k == "kv_dtype" else v) for k, v in kwargs.items()},
           "devices": args.devices, "sequence_parallel": args.sequence_parallel, "matmul": args.matmul}
    if mesh is not None:
        kwargs["mesh"] = mesh

    def call():
        t = time.perf_counter()
        out = mmjax.prefill(model, inputs, attention=attention, **kwargs)
        jax.block_until_ready(out.logits)
        jax.block_until_ready(out.cache.k)
        assert np.isfinite(np.asarray(out.logits, np.float32)).all(), "non-finite logits"
        return time.perf_counter() - t

    row["first_s"] = call()
    print(f"[prefill] {row['tokens']} {name}: first call {row['first_s']:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps(row), flush=True)  # a partial row, kept if a later step times out
    if row["first_s"] <= args.warm_budget_s or mesh is not None:
        row["warm_s"] = min(call() for _ in range(args.repeats))
        row["warm_estimated"] = False
    else:
        row["compile_s"] = compile_seconds(model, inputs, attention, kwargs)
        row["warm_s"] = row["first_s"] - row["compile_s"]
        row["warm_estimated"] = True
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in
             (jax.devices()[:1] if mesh is None else mesh.devices.flat)]
    if all(p is not None for p in peaks):
        row["peak_gib"] = max(peaks) / 2 ** 30
    row["tokens_per_s"] = row["tokens"] / row["warm_s"]
    row["first_minus_warm_s"] = row["first_s"] - row["warm_s"]
    print(json.dumps(row), flush=True)
    if args.breakdown:
        row.update(phase_seconds(model, inputs, args.frames_per_chunk, mesh))
        row["decoder_s"] = row["warm_s"] - row["host_s"] - row["vision_s"]
    if args.profile:
        log_dir = os.path.join(args.profile, f"{row['tokens']}_{name}_{args.devices}x{args.sequence_parallel}")
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            row["profiled_s"] = call()
        summary = trace_summary.summarize_dir(log_dir)
        row["profile"] = summary["devices"]
        print(trace_summary.format_summary(summary), file=sys.stderr, flush=True)
    return row


def child_env() -> dict:
    """The environment of a row's process: JAX may take 95% of the GPU's memory (its default, 75%,
    would cap a 1M-token prefill on a 141 GB H200 at about 105 GiB) unless the caller set a fraction."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    return env


def cpu_devices_env(env: dict, devices: int) -> dict:
    """On a CPU, ``devices`` virtual host devices for a row's process (``--devices N`` without GPUs)."""
    if jax.default_backend() == "cpu" and devices > 1:
        flag = f"--xla_force_host_platform_device_count={devices}"
        env = dict(env, XLA_FLAGS=(env.get("XLA_FLAGS", "") + " " + flag).strip())
    return env


def _child(args, tokens: int, name: str, timeout_s: float) -> dict:
    """Run one row in a fresh process; its last stdout line is the row's JSON."""
    cmd = [sys.executable, "-m", "mmjax.drivers.bench.prefill", "--row", str(tokens), name] + args.passthrough
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout_s, check=False,
                           env=cpu_devices_env(child_env(), args.devices))
    except subprocess.TimeoutExpired as e:  # keep what the row had measured (it prints its row as it goes)
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return dict(_last_row(out) or {"tokens": tokens, "attention": name},
                    error=f"timed out after {timeout_s:.0f} s")
    row = _last_row(r.stdout)
    if r.returncode != 0 or row is None:
        return dict(row or {"tokens": tokens, "attention": name},
                    error=(row or {}).get("error") or f"exit status {r.returncode}")
    return row


def _last_row(stdout: str) -> dict | None:
    """The last JSON line a row's process printed (None if none)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def _speedups(rows: list[dict]) -> None:
    dense = {r["tokens"]: r["warm_s"] for r in rows if r.get("attention") in ("cudnn", "dense") and "warm_s" in r}
    for r in rows:
        if "warm_s" in r and r["tokens"] in dense:
            r["speedup"] = dense[r["tokens"]] / r["warm_s"]


def plot(rows: list[dict], path: str, device: str | None = None) -> None:
    """TTFT and peak memory against tokens, one line per attention (``device`` names the plot)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["attention"] for r in rows):
        pts = sorted((r["tokens"], r["warm_s"], r.get("peak_gib")) for r in rows
                     if r["attention"] == name and "warm_s" in r)
        if not pts:
            continue
        x = [p[0] for p in pts]
        a.plot(x, [p[1] for p in pts], marker="o", label=name)
        if all(p[2] is not None for p in pts):
            b.plot(x, [p[2] for p in pts], marker="o", label=name)
    for ax, label in ((a, "warm time to first token (s)"), (b, "peak GPU memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend()
    a.set_yscale("log")
    fig.suptitle(f"mmjax.prefill, {device or device_name()}")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="mmjax bench prefill", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    add_result_args(p, "prefill")
    p.add_argument("--preset", default="7b", choices=VLM_PRESETS + tuple(TEXT_PRESETS),
                   help="random weights of this shape (GPU): Qwen2.5-VL 3b / 7b, LLaVA-OneVision or a text LM")
    p.add_argument("--model", help="a checkpoint directory instead of random weights")
    p.add_argument("--layers", type=positive_int, help="decoder layers (default: the model's)")
    p.add_argument("--tokens", type=positive_int, nargs="+",
                   help="visual tokens (text tokens for a text LM) per row (default 128k-1M on a GPU)")
    p.add_argument("--configs", type=config_name, nargs="+", default=["cudnn", "grid", "ashape"],
                   help="attention per row")
    p.add_argument("--mlp-chunk", type=positive_int, default=16384, help="tokens per chunk of norms / projections / MLP")
    p.add_argument("--frames-per-chunk", type=positive_int, default=None, help="temporal patches per vision-tower chunk")
    p.add_argument("--chunk-tokens", type=positive_int, default=None, help="chunked prefill (tokens per chunk)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="KV cache storage")
    p.add_argument("--matmul", choices=("bf16", "fp8"), default="bf16",
                   help="decoder projections and MLP: the model's weights, or fp8 GEMMs (mmjax.quantize_fp8)")
    p.add_argument("--devices", type=positive_int, default=1, metavar="N",
                   help="tensor-parallel over N devices (heads split; default %(default)s)")
    p.add_argument("--sequence-parallel", type=positive_int, default=1, metavar="S",
                   help="of the N devices, split the tokens over S (tp = N / S; default %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=1, help="warm calls (the fastest is reported)")
    p.add_argument("--warm-budget-s", type=positive_float, default=240.0,
                   help="no second call when the first took longer (warm = first - compile)")
    p.add_argument("--row-timeout-s", type=positive_float, default=1200.0, help="wall time of one row's process")
    p.add_argument("--compile-cache", help="directory of JAX's persistent compilation cache")
    p.add_argument("--plot", action="store_true", help="write a PNG of TTFT and memory vs tokens")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the host preparation and the vision tower alone (decoder = warm - both)")
    p.add_argument("--profile", metavar="DIR",
                   help="one more warm call under jax.profiler (trace in DIR); the row gets its GPU time by kernel")
    p.add_argument("--row", nargs=2, metavar=("TOKENS", "ATTENTION"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_cache:
        mmjax.inference.enable_compilation_cache(args.compile_cache)
    if args.row:
        try:
            print(json.dumps(run_row(args, int(args.row[0]), args.row[1])), flush=True)
        except Exception as e:  # the row's JSON names the failure (e.g. XLA's out-of-memory message)
            msg = (str(e).strip().splitlines() or [""])[0][:300]
            print(json.dumps({"tokens": int(args.row[0]), "attention": args.row[1],
                              "error": f"{type(e).__name__}: {msg}"}), flush=True)
            raise
        return 0
    on_gpu = jax.default_backend() == "gpu"
    tokens = args.tokens or ([131072, 262144, 524288, 1048576] if on_gpu else [1024, 2048])
    if not on_gpu:
        print("no GPU: a tiny model on the CPU (timings only show that everything runs)", file=sys.stderr)
        args.configs = [c if c != "cudnn" else "dense" for c in args.configs]
    if args.devices % args.sequence_parallel:
        p.error(f"--sequence-parallel: expected a divisor of --devices {args.devices}, got {args.sequence_parallel}")
    if args.matmul == "fp8" and args.devices > 1:
        p.error("--matmul fp8: the fp8 weights run on one device; expected --devices 1")
    keep = ("model", "layers", "mlp_chunk", "frames_per_chunk", "chunk_tokens", "repeats", "warm_budget_s",
            "compile_cache", "devices", "sequence_parallel", "profile")
    args.passthrough = [x for k in keep if getattr(args, k) is not None
                        for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    args.passthrough += ["--breakdown"] if args.breakdown else []
    args.passthrough += ["--preset", args.preset, "--kv-dtype", args.kv_dtype, "--matmul", args.matmul]
    rows: list[dict] = []
    args.name = result_name(args.name, args.preset, args.model)
    llava = args.preset.startswith("llava-ov-")
    shape = (args.preset if args.preset in TEXT_PRESETS else
             f"LLaVA-OneVision-{args.preset[len('llava-ov-'):]}" if llava else f"Qwen2.5-VL-{args.preset}")
    result = {"benchmark": "prefill", "model": args.model or f"{shape} shape, random bf16",
              "frame": "384x384" if llava else f"{FRAME_PX}x{FRAME_PX}",
              "args": {k: v for k, v in vars(args).items() if k != "row"},
              "rows": rows}
    path = None
    for n in tokens:
        for name in args.configs:
            rows.append(_child(args, n, name, args.row_timeout_s))
            _speedups(rows)
            if args.out:
                path = write_result(args.out, args.name, result)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    table = print_table(rows, [("tokens", "tokens", "d"), ("attention", "attention", "s"),
                               ("first_s", "first call s", ".1f"), ("warm_s", "warm TTFT s", ".2f"),
                               ("speedup", "speedup", ".2f"), ("peak_gib", "peak GiB", ".1f"),
                               ("tokens_per_s", "tokens/s", ".0f"), ("host_s", "host s", ".2f"),
                               ("vision_s", "vision s", ".2f"), ("decoder_s", "decoder s", ".2f"),
                               ("error", "error", "s")])
    result["table"] = table
    if args.out:
        path = write_result(args.out, args.name, result)
        print(f"wrote {path}")
    if args.plot and path:
        png = path[:-len(".json")] + ".png"
        plot(rows, png)
        print(f"wrote {png}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
