"""The memory roofline of a decode step: bytes it must read, the HBM bandwidth measured on this
device, and what a compiled program does beyond reading them (kernels launched, copies made).

A decode step of a dense decoder reads every layer weight, the final norm and the LM head once,
plus the KV cache slots it attends; at small batch that traffic bounds the step from below:
``floor_s = (weight_bytes + kv_bytes) / bandwidth``.
"""

from __future__ import annotations

import math
import re
import statistics
import time

import jax
import jax.numpy as jnp

from models.text_decoder import TextDecoder

# instructions of a compiled module that launch no kernel
_FREE_OPS = frozenset({"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all",
                       "partition-id", "replica-id", "opt-barrier", "add-dependency"})
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64)\[([0-9,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "s16": 16, "u16": 16,
         "bf16": 16, "f16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64}


def weight_bytes(decoder: TextDecoder, batch: int) -> int:
    """Bytes one decode step of ``batch`` rows must read from the decoder's weights: every stacked
    layer weight, the final norm, the LM head (the embedding table when tied) and ``batch`` embedding
    rows."""
    c = decoder.config
    head = decoder.embed if decoder.lm_head is None else decoder.lm_head
    total = sum(a.nbytes for a in decoder.stacked().values()) + decoder.final_norm[...].nbytes + head[...].nbytes
    return int(total + batch * c.hidden_size * decoder.embed[...].dtype.itemsize)


def kv_bytes(config, batch: int, slots: int, kv_dtype) -> int:
    """Bytes of keys and values (and fp8 scales) of ``slots`` cache slots of every layer for ``batch``
    rows; ``config`` a `models.text_decoder.TextConfig`."""
    per = config.num_hidden_layers * batch * slots * config.num_key_value_heads
    scale = 4 if jnp.dtype(kv_dtype) == jnp.dtype(jnp.float8_e4m3fn) else 0
    return int(2 * per * (config.head_dim * jnp.dtype(kv_dtype).itemsize + scale))


def measure_bandwidth(nbytes: int, reps: int = 10) -> dict:
    """Device memory bandwidth from a ``nbytes`` bf16 buffer: ``copy_gbps`` (x + 1, read + write
    counted) and ``read_gbps`` (a float32 sum, reads only); median of ``reps`` timed calls each."""
    if nbytes < 8192:
        raise ValueError(f"nbytes: expected at least 8192 bytes, got {nbytes}")
    x = jnp.ones((max(1, nbytes // 8192), 4096), jnp.bfloat16)  # 2-D: no index past 2**31 in one axis
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    out = {}
    for name, fn, moved in (("copy_gbps", copy, 2 * x.nbytes), ("read_gbps", read, x.nbytes)):
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        out[name] = moved / statistics.median(times) / 1e9
    del x
    return out


def _array_bytes(type_text: str) -> int:
    total = 0
    for dt, dims in _ARRAY.findall(type_text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += -(-n * _BITS[dt] // 8)
    return total


def program_stats(hlo_text: str, *, large_bytes: int = 8 << 20) -> dict:
    """What a compiled module (``compiled.as_text()``) launches per call, counted over its entry
    computation, the bodies of its while loops and the computations it calls: ``ops``
    (instructions that run a kernel or a library call: fusions, custom calls, copies, ...),
    ``copies`` (``copy`` instructions) and ``large``: up to 20 instructions writing at least
    ``large_bytes`` that are not in-place dynamic-update-slices, as "name opcode MiB" (a copy of weights or of a KV cache shows up here)."""
    comps, current, name = {}, None, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = "ENTRY" if head.group(1) else head.group(2)
            current = comps.setdefault(name, [])
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line) if current is not None else None
        if m:
            current.append((m.group(1), m.group(3), m.group(2), m.group(4)))
    if "ENTRY" not in comps:
        raise ValueError("hlo_text: expected the text of a compiled HLO module (no ENTRY computation found)")
    bodies, todo = set(), ["ENTRY"]
    while todo:  # the entry, while-loop bodies and called computations (GPU command buffers), transitively
        comp = todo.pop()
        if comp in bodies:
            continue
        bodies.add(comp)
        for instr in comps.get(comp, []):
            if instr[1] == "while":
                todo.extend(re.findall(r"body=%?([\w.\-]+)", instr[3]))
            elif instr[1] == "call":
                todo.extend(re.findall(r"to_apply=%?([\w.\-]+)", instr[3]))
    ops = copies = 0
    large = []
    for comp in sorted(bodies):
        for name, op, typ, rest in comps.get(comp, []):
            if op in _FREE_OPS or op in ("while", "call"):
                continue
            ops += 1
            copies += op == "copy"
            size = _array_bytes(typ)
            in_place = op == "dynamic-update-slice" or "dynamic-update-slice" in name or "dynamic_update_slice" in name
            if size >= large_bytes and not in_place and len(large) < 20:
                large.append(f"{name} {op} {size / 2**20:.1f}MiB")
    return {"ops": ops, "copies": copies, "large": large}
