"""Decode at the memory roofline: time per step and tokens/s of the decode step against the bytes
it must read (weights + KV cache) over the HBM bandwidth measured in the same run.

On a GPU: Qwen2.5-VL-7B shape, random bf16 weights; per batch size (1, 4, 16) and context length
(1k, 32k, 128k slots in the cache; configurations that do not fit in device memory are skipped) one
greedy decode step (``qwen2_5_vl.decode_step`` + argmax, the cache donated) is timed as

* ``sync``: N host-driven steps, the host reading each step's tokens before dispatching the next
  (what a loop that checks every token on the host does);
* ``async``: N host-driven steps dispatched back to back (each fed the previous step's tokens on
  the device; host overhead hidden behind device work when it is smaller);
* ``in_jit`` (``--steps N``): N steps inside one jit-compiled ``lax.fori_loop`` (no host at all).

The roofline is ``(weight bytes + KV bytes) / bandwidth``, the bandwidth the larger of a large
on-device copy (read + write) and a large read-only reduction timed in this run; ``frac`` =
roofline time / measured time. The LM head (152k vocabulary) and argmax alone are timed beside it
(``lm_head_ms``, in one jit) against their own roofline. Per configuration the compiled step's
kernels (``ops``), ``copy`` instructions, large non-in-place outputs (weight or cache copies) and
temporary memory are recorded, so the causes of a gap are visible (``--dump-hlo DIR`` writes each
compiled step). ``--variants`` times the same grid under several compilations of the step
(`VARIANTS`: the default dense attention (on CUDA the multiply-reduce form of
``models.decode_attention`` at batch > 1), XLA's einsum form at every batch, the multiply-reduce form at
every batch or the split-K Pallas kernel, GEMVs through cuBLAS instead of Triton, dynamic-slice fusion,
no CUDA graphs), each variant its rows; ``--xla-option KEY=VALUE`` adds an XLA option to every variant.

``--devices N [--sequence-parallel S]`` runs the step on a mesh of N devices (`mmjax.parallel`: the
weights in their tensor-parallel layout, the key-value heads split over N / S devices and the cache
slots over S), made in place there; the roofline is then the bytes over N devices' bandwidth.

Prints a table, writes JSON to ``--out`` and a plot beside it (ms per step and fraction of the
roofline against context length, one line per batch size). On a CPU a tiny configuration runs
(timings only show that everything runs).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.drivers.args import (
    ArgumentParser,
    add_result_args,
    int_list,
    name_list,
    nonneg_int,
    out_dir,
    positive_int,
)
from mmjax.drivers.bench.decode_attention import einsum_attention, split_k_attention
from mmjax.drivers.bench.report import print_table, save_figure_beside, write_result
from mmjax.drivers.bench.roofline import (
    kv_bytes,
    measure_bandwidth,
    program_stats,
    weight_bytes,
)
from mmjax.files import atomic_write
from mmjax.parallel import cache_sharding, devices_mesh, shard_model
from mmjax.parallel.attention import decode_attention as mesh_attention
from mmjax.parallel.run import place_cache
from mmjax.timing import device_name
from models.attention import LayerAttention, dense_attention, resolve_attention
from models.decode_attention import reduce_attention
from models.kv_cache import KVCache
from models.qwen2_5_vl import model as qwen_vl
from models.qwen2_5_vl.config import Qwen2_5_VLConfig, VisionConfig, preset
from models.sharding import kv_sharding
from models.text_decoder import TextConfig, lm_logits

matplotlib.use("Agg")


@dataclasses.dataclass(frozen=True)
class DecodeBenchConfig:
    """batches / contexts: the grid; steps: host-driven steps per timed sample (and in-jit steps
    when ``in_jit``); reps: timed samples (median reported); variants: names in `VARIANTS`;
    xla_options: (key, value) pairs added to every variant's compilation; kv_dtype: cache storage dtype name
    (None: the model's);
    memory_fraction: skip configurations whose weights + cache exceed this share of device memory (per device);
    devices / sequence_parallel: run on a mesh of ``devices`` devices (tp = devices / sequence_parallel
    splits the key-value heads, sequence_parallel the cache slots; `mmjax.parallel`)."""

    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (1024, 32768, 131072)
    steps: int = 32
    in_jit: bool = False
    reps: int = 5
    variants: tuple[str, ...] = ("default",)
    xla_options: tuple[tuple[str, bool | int | str], ...] = ()
    kv_dtype: str | None = None
    memory_fraction: float = 0.85
    devices: int = 1
    sequence_parallel: int = 1


def tiny_model(dtype=jnp.float32) -> qwen_vl.Qwen2_5_VL:
    """A 2-layer Qwen2.5-VL (hidden 64, vocab 512) for CPU runs and tests."""
    text = TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 3, 3))
    vision = VisionConfig(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                          fullatt_block_indexes=(0,), window_size=56)
    return qwen_vl.Qwen2_5_VL(Qwen2_5_VLConfig(text=text, vision=vision), dtype=dtype, key=jax.random.key(0))


# variant -> (decode attention: "dense" = the models' default, "einsum" / "reduce" / "split_k" =
# `decode_attention`'s; XLA options)
VARIANTS: dict[str, tuple[str, tuple[tuple[str, bool | int | str], ...]]] = {
    "default": ("dense", ()),
    "einsum_attn": ("einsum", ()),
    "reduce_attn": ("reduce", ()),
    "split_k": ("split_k", ()),
    "split_k_slice_fusion": ("split_k", (("xla_gpu_enable_dynamic_slice_fusion", True),)),
    "layer_slice": ("layer_slice", ()),
    "cublas": ("dense", (("xla_gpu_enable_triton_gemm", False),)),
    "slice_fusion": ("dense", (("xla_gpu_enable_dynamic_slice_fusion", True),)),
    "no_cuda_graphs": ("dense", (("xla_gpu_enable_command_buffer", ""),)),
}


def decode_attention(name: str) -> LayerAttention:
    """The decode attention of a variant: "dense" (the models' default: on CUDA from ``SPLIT_K_MIN_SLOTS``
    slots the split-K kernel reading each layer inside the stacked cache), "layer_slice" (the same function
    handed each layer's slice, as before 2026-11-25: XLA copies the layer's keys and values first), "einsum"
    (XLA's einsum form at every batch), "reduce" (multiply-reduce over the cache as it lies) or "split_k"
    (the split-K Pallas kernel on the layer's slice at any length)."""
    if name == "dense":
        return resolve_attention("dense")
    if name == "layer_slice":
        return LayerAttention(uniform=layer_slice_attention)
    if name == "einsum":
        return LayerAttention(uniform=einsum_attention)
    if name == "reduce":
        return LayerAttention(uniform=reduce_attention)
    if name == "split_k":
        return LayerAttention(uniform=split_k_attention)
    raise ValueError(f"attention: expected 'dense', 'layer_slice', 'einsum', 'reduce' or 'split_k', got {name!r}")


def layer_slice_attention(q, k, v, **kw):
    """`dense_attention` without ``reads_stacked_cache``: the decoder hands it the layer's slice."""
    return dense_attention(q, k, v, **kw)


@functools.partial(jax.jit, static_argnames=("attention",), donate_argnames=("cache",))
def greedy_step(model, cache: KVCache, tokens: jax.Array, attention: LayerAttention):
    """One greedy decode step: tokens int32 [B] -> (cache, next tokens int32 [B]); cache donated."""
    logits, cache = qwen_vl.decode_step(model, cache, tokens, attention)
    return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("attention", "mesh"), donate_argnames=("cache",))
def greedy_step_on_mesh(model, cache: KVCache, tokens: jax.Array, attention: LayerAttention, mesh: Mesh):
    """`greedy_step` on ``mesh`` (model laid out by ``shard_model``; ``attention`` wrapped for the mesh by
    `mmjax.parallel.attention.decode_attention`): the cache stays in its layout, the tokens replicated."""
    logits, cache = qwen_vl.decode_step(model, cache, tokens, attention)
    cache = jax.tree.map(jax.lax.with_sharding_constraint, cache, cache_sharding(cache, mesh))
    return cache, jax.lax.with_sharding_constraint(jnp.argmax(logits, axis=-1).astype(jnp.int32),
                                                   NamedSharding(mesh, P()))


@functools.partial(jax.jit, static_argnames=("attention", "steps", "mesh"), donate_argnames=("cache",))
def greedy_steps(model, cache: KVCache, tokens: jax.Array, attention: LayerAttention, steps: int,
                 mesh: Mesh | None = None):
    """``steps`` greedy decode steps inside one program (``lax.fori_loop``, the cache carried in
    place): tokens int32 [B] -> (cache, last tokens int32 [B]); cache donated. ``mesh``: as
    `greedy_step_on_mesh`."""
    def body(_, carry):
        if mesh is not None:
            return greedy_step_on_mesh(model, carry[0], carry[1], attention, mesh)
        return greedy_step(model, carry[0], carry[1], attention)
    return jax.lax.fori_loop(0, steps, body, (cache, tokens))


@functools.partial(jax.jit, donate_argnames=("cache",))
def rewind(cache: KVCache, length: jax.Array) -> KVCache:
    """The cache with ``length`` slots filled again (valid below it, positions at it), in place."""
    b, s = cache.valid.shape
    return dataclasses.replace(cache, valid=jnp.broadcast_to(jnp.arange(s) < length, (b, s)),
                               length=jnp.asarray(length, jnp.int32),
                               next_position=jnp.full((b,), length, jnp.int32))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _filled(key, shape, dtype, sharding=None):
    """Random-looking contents of a cache array of ``shape`` without a full-size float32 temporary:
    a random block of up to 1024 slots tiled along the slot axis (made in ``sharding`` when given)."""
    tile = min(shape[2], 1024)
    block = jax.random.normal(key, shape[:2] + (tile,) + shape[3:], jnp.float32).astype(dtype)
    reps = -(-shape[2] // tile)
    out = jnp.tile(block, (1, 1, reps, 1, 1))[:, :, :shape[2]]
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


def make_cache(config: TextConfig, batch: int, slots: int, dtype, kv_dtype, key, mesh: Mesh | None = None) -> KVCache:
    """A cache of ``slots`` slots holding random keys / values (length set by `rewind`), allocated
    once (no zero-filled cache beside it; with ``mesh``, made in its layout there, no full copy on one
    device). ``kv_dtype``: ``dtype`` or float8_e4m3fn."""
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype not in (jnp.dtype(dtype), jnp.dtype(jnp.float8_e4m3fn)):
        raise ValueError(f"kv_dtype: expected the model dtype {jnp.dtype(dtype)} or float8_e4m3fn; got {kv_dtype}")
    shape = (config.num_hidden_layers, batch, slots, config.num_key_value_heads, config.head_dim)
    k1, k2 = jax.random.split(key)
    fp8 = kv_dtype == jnp.dtype(jnp.float8_e4m3fn)
    scale = (lambda: jnp.ones(shape[:-1], jnp.float32)) if fp8 else (lambda: None)
    kv = None if mesh is None else kv_sharding(mesh)
    cache = KVCache(_filled(k1, shape, kv_dtype, kv), _filled(k2, shape, kv_dtype, kv), jnp.zeros((batch, slots), bool),
                    jnp.zeros((), jnp.int32), jnp.zeros((batch,), jnp.int32), scale(), scale())
    return cache if mesh is None else place_cache(cache, mesh)


def bench_config(model, cfg: DecodeBenchConfig, variant: str, batch: int, context: int, bandwidth: float,
                 dump_hlo: str | None = None, mesh: Mesh | None = None) -> dict:
    """Time one (variant, batch, context) configuration; returns its row. ``dump_hlo``: a directory
    for the compiled step's HLO text; ``mesh``: the mesh ``model`` is laid out on (None: one device),
    the roofline then the bytes over the bandwidth of all its devices."""
    c = model.config.text
    dtype = model.language_model.embed[...].dtype
    kv_dtype = jnp.dtype(cfg.kv_dtype or dtype)
    attn_name, variant_options = VARIANTS[variant]
    attention = decode_attention(attn_name)
    n_dev = 1 if mesh is None else mesh.devices.size
    if mesh is not None:
        attention = mesh_attention(attention, mesh)
    n = cfg.steps
    start = context - n - 1  # every timed sample decodes slots start .. start + n - 1 of a full-size cache
    if start < 1:
        raise ValueError(f"steps: expected fewer than context - 1 = {context - 1} steps, got {n}")
    def rewound(cache):
        cache = rewind(cache, start)
        return cache if mesh is None else place_cache(cache, mesh)

    cache = rewound(make_cache(c, batch, context, dtype, kv_dtype, jax.random.key(1), mesh))
    tok = jnp.arange(batch, dtype=jnp.int32) % c.vocab_size
    if mesh is not None:
        tok = jax.device_put(tok, NamedSharding(mesh, P()))
    options = dict(variant_options + cfg.xla_options) or None
    t0 = time.perf_counter()
    if mesh is None:
        step = greedy_step.lower(model, cache, tok, attention).compile(compiler_options=options)
    else:
        step = greedy_step_on_mesh.lower(model, cache, tok, attention, mesh).compile(compiler_options=options)
    compile_s = time.perf_counter() - t0
    hlo = step.as_text()
    if dump_hlo:
        atomic_write(os.path.join(dump_hlo, f"decode_{variant}_b{batch}_s{context}.hlo.txt"), hlo, overwrite=True)
    try:
        stats = program_stats(hlo)
    except ValueError as e:  # an HLO text this parser does not know: keep the timings
        stats = {"ops": None, "copies": None, "large": [f"not parsed: {e}"]}
    mem = step.memory_analysis()
    row = {"variant": variant, "batch": batch, "context": context, "devices": n_dev, "compile_s": compile_s,
           "ops": stats["ops"],
           "copies": stats["copies"], "large_outputs": stats["large"],
           "temp_mib": getattr(mem, "temp_size_in_bytes", 0) / 2**20}
    wb, kb = weight_bytes(model.language_model, batch), kv_bytes(c, batch, context, kv_dtype)
    row.update(weight_gb=wb / 1e9, kv_gb=kb / 1e9, roofline_ms=(wb + kb) / (bandwidth * n_dev) * 1e3)
    state = {"cache": cache, "tok": tok}

    def host(sync: bool):
        def run():
            state["cache"] = rewound(state["cache"])
            jax.block_until_ready(state["cache"].length)
            t = time.perf_counter()
            cache_, tok_ = state["cache"], state["tok"]
            for _ in range(n):
                cache_, tok_ = step(model, cache_, tok_)
                if sync:
                    np.asarray(tok_)
            jax.block_until_ready(tok_)
            state["cache"], state["tok"] = cache_, tok_
            return time.perf_counter() - t
        return run

    for mode in ("sync", "async"):
        run = host(mode == "sync")
        run()  # warm-up
        row[f"{mode}_ms"] = statistics.median(run() for _ in range(cfg.reps)) / n * 1e3
    if cfg.in_jit:
        t0 = time.perf_counter()
        loop = greedy_steps.lower(model, state["cache"], state["tok"], attention, n, mesh).compile(
            compiler_options=options)
        row["loop_compile_s"] = time.perf_counter() - t0
        row["loop_temp_mib"] = getattr(loop.memory_analysis(), "temp_size_in_bytes", 0) / 2**20

        def run_loop():
            state["cache"] = rewound(state["cache"])
            jax.block_until_ready(state["cache"].length)
            t = time.perf_counter()
            state["cache"], state["tok"] = loop(model, state["cache"], state["tok"])
            jax.block_until_ready(state["tok"])
            return time.perf_counter() - t

        run_loop()
        row["in_jit_ms"] = statistics.median(run_loop() for _ in range(cfg.reps)) / n * 1e3
    row["lm_head_ms"], head_bytes = lm_head_time(model, batch, cfg.reps, options)
    row["lm_head_roofline_ms"] = head_bytes / (bandwidth * n_dev) * 1e3
    best = min(row[k] for k in ("sync_ms", "async_ms", "in_jit_ms") if k in row)
    row["tokens_per_s"] = batch * 1e3 / row["async_ms"]
    row["roofline_tokens_per_s"] = batch * 1e3 / row["roofline_ms"]
    row["effective_gbps"] = (wb + kb) / row["async_ms"] / 1e6
    row["frac_async"] = row["roofline_ms"] / row["async_ms"]
    row["frac_best"] = row["roofline_ms"] / best
    return row


@functools.partial(jax.jit, static_argnames=("steps",))
def lm_head_steps(model, h: jax.Array, steps: int) -> jax.Array:
    """``steps`` times the LM head and argmax of final states h [B, H] (each iteration's states
    depend on the previous tokens, so nothing is hoisted): int32 [B]."""
    dec = model.language_model

    def body(_, carry):
        h, tok = carry
        logits = lm_logits(dec, h[:, None])[:, 0]
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return h + (tok % 2).astype(h.dtype)[:, None] * 1e-3, tok

    return jax.lax.fori_loop(0, steps, body, (h, jnp.zeros(h.shape[:1], jnp.int32)))[1]


def lm_head_time(model, batch: int, reps: int, options=None, steps: int = 16) -> tuple[float, int]:
    """(ms per LM head + argmax of ``batch`` rows, timed as ``steps`` in one jit; bytes it must read)."""
    dec = model.language_model
    h = jnp.ones((batch, dec.config.hidden_size), dec.embed[...].dtype)
    fn = lm_head_steps.lower(model, h, steps).compile(compiler_options=options)
    jax.block_until_ready(fn(model, h))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(model, h))
        samples.append((time.perf_counter() - t0) / steps * 1e3)
    head = dec.embed if dec.lm_head is None else dec.lm_head
    return statistics.median(samples), int(head[...].nbytes)


def fits(model, cfg: DecodeBenchConfig, batch: int, context: int) -> tuple[bool, str]:
    """Whether one device's weights + cache of a configuration fit in ``memory_fraction`` of its memory
    (the cache split over ``cfg.devices``, the weights as they are laid out)."""
    dev = jax.devices()[0]
    limit = (dev.memory_stats() or {}).get("bytes_limit") if hasattr(dev, "memory_stats") else None
    if not limit:
        return True, ""
    params = sum(a.addressable_shards[0].data.nbytes for a in jax.tree_util.tree_leaves(model))
    kv_dtype = jnp.dtype(cfg.kv_dtype or model.language_model.embed[...].dtype)
    need = params + kv_bytes(model.config.text, batch, context, kv_dtype) / cfg.devices
    if need > cfg.memory_fraction * limit:
        return False, f"needs {need / 1e9:.1f} GB > {cfg.memory_fraction:.2f} x {limit / 1e9:.1f} GB"
    return True, ""


def run(model, cfg: DecodeBenchConfig, bandwidth: float, on_row=None, dump_hlo: str | None = None,
        mesh: Mesh | None = None) -> list[dict]:
    """Every variant and fitting (batch, context) of the grid (on ``mesh``, the model laid out there, when
    given); skipped configurations get a row with ``skipped``, variants that fail to compile or run one
    with ``error``."""
    rows = []
    for variant in cfg.variants:
        for context in cfg.contexts:
            for batch in cfg.batches:
                ok, why = fits(model, cfg, batch, context)
                head = {"variant": variant, "batch": batch, "context": context}
                if not ok:
                    row = {**head, "skipped": why}
                else:
                    try:
                        row = bench_config(model, cfg, variant, batch, context, bandwidth, dump_hlo, mesh)
                    except Exception as e:  # noqa: BLE001 - an XLA option or kernel a device rejects; keep going
                        row = {**head, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                rows.append(row)
                print({k: v for k, v in row.items() if k != "large_outputs"}, flush=True)
                if on_row is not None:
                    on_row(rows)
    return rows


def figure(rows: list[dict], title: str) -> matplotlib.figure.Figure:
    """Two panels against context length, one line per batch size: ms per step (measured solid,
    roofline dashed) and the fraction of the roofline reached."""
    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(11, 4))
    for i, b in enumerate(sorted({r["batch"] for r in rows})):
        pts = sorted((r for r in rows if r["batch"] == b and "async_ms" in r), key=lambda r: r["context"])
        if not pts:
            continue
        x = [r["context"] for r in pts]
        color = f"C{i}"
        ax_t.plot(x, [r["async_ms"] for r in pts], "o-", color=color, label=f"B={b} measured (async)")
        if all("in_jit_ms" in r for r in pts):
            ax_t.plot(x, [r["in_jit_ms"] for r in pts], "s:", color=color, label=f"B={b} in one jit")
        ax_t.plot(x, [r["roofline_ms"] for r in pts], "--", color=color, alpha=0.6, label=f"B={b} roofline")
        ax_f.plot(x, [r["frac_async"] for r in pts], "o-", color=color, label=f"B={b}")
    for ax in (ax_t, ax_f):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (cache slots)")
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("ms per decode step")
    ax_f.set_ylabel("roofline time / measured time")
    ax_f.set_ylim(0, 1.05)
    ax_t.legend(fontsize=7)
    ax_f.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _xla_option(text: str) -> tuple[str, bool | int | str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"expected KEY=VALUE, e.g. xla_gpu_enable_dynamic_slice_fusion=true; received {text!r}")
    value = value.strip()
    if value.lower() in ("true", "false"):
        return key.strip(), value.lower() == "true"
    return key.strip(), int(value) if value.lstrip("-").isdigit() else value


def xla_options(texts) -> tuple[tuple[str, bool | int | str], ...]:
    """``KEY=VALUE`` strings -> (key, value) pairs, "true" / "false" as bools and integers as ints
    (ValueError naming the bad one)."""
    return tuple(_xla_option(t) for t in texts or ())


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="mmjax bench decode", description=__doc__.split("\n\n")[0])
    add_result_args(p, "decode")
    p.add_argument("--batches", type=int_list, default=None, help="comma-separated batch sizes (1,4,16)")
    p.add_argument("--contexts", type=int_list, default=None, help="comma-separated cache slots (1024,32768,131072)")
    p.add_argument("--steps", type=nonneg_int, default=0,
                   help="also time N steps inside one jit (lax.fori_loop) against N host-driven steps (0: host only)")
    p.add_argument("--host-steps", type=positive_int, default=32, help="host-driven steps per sample without --steps")
    p.add_argument("--reps", type=positive_int, default=5, help="timed samples per mode (median)")
    p.add_argument("--variants", type=name_list(VARIANTS), default=("default",),
                   help="comma-separated step variants: " + ", ".join(VARIANTS))
    p.add_argument("--dump-hlo", type=out_dir, default=None, metavar="DIR", help="write each compiled step's HLO")
    p.add_argument("--kv-dtype", choices=("model", "float8_e4m3fn"), default="model", help="cache storage dtype")
    p.add_argument("--layers", type=positive_int, default=None, help="shrink the 7B decoder (device time)")
    p.add_argument("--model", choices=("auto", "7b", "tiny"), default="auto",
                   help="model shape: auto = Qwen2.5-VL-7B (bf16) on a GPU, a tiny float32 one elsewhere")
    p.add_argument("--xla-option", action="append", metavar="KEY=VALUE", default=[],
                   help="XLA option for the step's compilation (repeatable)")
    p.add_argument("--bandwidth-gib", type=positive_int, default=4, help="buffer size of the bandwidth measurement")
    p.add_argument("--devices", type=positive_int, default=1, metavar="N",
                   help="run on N devices: key-value heads split over N / S, cache slots over S (default %(default)s)")
    p.add_argument("--sequence-parallel", type=positive_int, default=1, metavar="S",
                   help="of the N devices, split the cache slots over S (dense attention only; default %(default)s)")
    args = p.parse_args(argv)
    try:
        mesh = devices_mesh(args.devices, args.sequence_parallel)
    except ValueError as e:
        p.error(str(e))
    if args.sequence_parallel > 1 and any(VARIANTS[v][0] != "dense" for v in args.variants):
        p.error("--variants: a sequence-parallel decode (--sequence-parallel > 1) attends densely; expected variants "
                "of the dense attention (" + ", ".join(k for k, v in VARIANTS.items() if v[0] == "dense") + ")")
    try:
        opts = xla_options(args.xla_option)
    except ValueError as e:
        p.error(f"--xla-option: {e}")
    on_gpu = jax.default_backend() == "gpu"
    cfg = DecodeBenchConfig(steps=args.steps or args.host_steps, in_jit=args.steps > 0, reps=args.reps,
                            variants=args.variants, xla_options=opts,
                            kv_dtype=None if args.kv_dtype == "model" else args.kv_dtype,
                            devices=args.devices, sequence_parallel=args.sequence_parallel)
    if args.model == "7b" or (args.model == "auto" and on_gpu):
        mc = preset("7b")
        if args.layers:
            mc = dataclasses.replace(mc, text=dataclasses.replace(mc.text, num_hidden_layers=args.layers))
        model, shape = qwen_vl.Qwen2_5_VL(mc, dtype=jnp.bfloat16, key=jax.random.key(0)), "qwen2.5-vl-7b"
    else:
        model, shape = tiny_model(), "tiny"
    if mesh is not None:
        shard_model(model, mesh)
    if not on_gpu:  # timings on a CPU only show that everything runs: a small grid
        cfg = dataclasses.replace(cfg, batches=(1, 4), contexts=(128, 512), steps=min(cfg.steps, 8), reps=2)
    bw_bytes = args.bandwidth_gib << 30 if on_gpu else 64 << 20
    if args.batches:
        cfg = dataclasses.replace(cfg, batches=args.batches)
    if args.contexts:
        cfg = dataclasses.replace(cfg, contexts=args.contexts)
    if min(cfg.contexts) <= cfg.steps + 1:
        p.error(f"--contexts: expected contexts > steps + 1 = {cfg.steps + 1}; received {min(cfg.contexts)}")
    bw = measure_bandwidth(bw_bytes)
    bandwidth = max(bw["copy_gbps"], bw["read_gbps"]) * 1e9
    print(f"bandwidth: copy {bw['copy_gbps']:.0f} GB/s (read + write), read {bw['read_gbps']:.0f} GB/s; "
          f"roofline uses {bandwidth / 1e9:.0f} GB/s", flush=True)
    meta = {"config": dataclasses.asdict(cfg), "model_shape": shape, "layers": model.config.text.num_hidden_layers,
            "bandwidth": bw, "roofline_gbps": bandwidth / 1e9, "device": device_name()}

    def save(rows, table=None):
        return write_result(args.out, args.name, {**meta, "rows": rows, "table": table}) if args.out else None

    rows = run(model, cfg, bandwidth, save, args.dump_hlo, mesh)
    cols = [("variant", "variant", "s"), ("devices", "GPUs", "d"), ("batch", "B", "d"), ("context", "context", "d"),
            ("roofline_ms", "roofline ms", ".3f"),
            ("sync_ms", "sync ms", ".3f"), ("async_ms", "async ms", ".3f"), ("in_jit_ms", "in-jit ms", ".3f"),
            ("tokens_per_s", "tok/s", ".0f"), ("roofline_tokens_per_s", "roofline tok/s", ".0f"),
            ("effective_gbps", "GB/s", ".0f"), ("frac_async", "frac", ".2f"), ("frac_best", "frac best", ".2f"),
            ("ops", "ops", "d"),
            ("lm_head_ms", "LM head ms", ".3f"), ("lm_head_roofline_ms", "head roofline", ".3f"),
            ("copies", "copies", "d"), ("temp_mib", "temp MiB", ".0f"), ("compile_s", "compile s", ".1f")]
    table = print_table(rows, cols)
    for r in rows:
        where = f"{r['variant']} B={r['batch']} context={r['context']}"
        if r.get("skipped") or r.get("error"):
            print(f"{where}: {r.get('skipped') or r.get('error')}")
        elif r.get("large_outputs"):
            print(f"{where} large outputs: {', '.join(r['large_outputs'])}")
    path = save(rows, table)
    if path:
        png = save_figure_beside(path, figure([r for r in rows if r["variant"] == cfg.variants[0]],
                                              f"decode {shape} on {device_name()} ({cfg.variants[0]})"))
        print("wrote", path, "and", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
