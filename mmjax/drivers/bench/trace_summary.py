"""Where a device's time went: a `jax.profiler` trace (its Perfetto JSON, ``create_perfetto_trace=True``)
summed by GPU kernel and by kind of kernel.

A trace holds one process per device (``/device:GPU:0`` ...) with one line per CUDA stream
(``Stream #N ...``) plus derived lines (``XLA Ops``, ``XLA Modules``) that cover the same time again;
only the stream lines are summed, so each kernel counts once. Kinds are by kernel name: NCCL
collectives, matrix multiplies (cuBLAS / CUTLASS / Triton GEMM fusions), attention (cuDNN, flash,
our Pallas kernels), copies / memsets, and everything else (XLA's elementwise and reduction fusions).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections import defaultdict

KINDS = (
    ("collective", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|all[-_]?to[-_]?all|reduce[-_]?scatter|"
                              r"collective|send|recv", re.I)),
    # our Pallas Mosaic GPU kernels are all attention kernels; Mosaic names them "anonymous_mosaic_gpu_kernel"
    ("attention", re.compile(r"attention|attn|flash|fmha|cudnn|sdpa|sparse|momo|mha|mosaic", re.I)),
    ("matmul", re.compile(r"gemm|xmma|cutlass|cublas|matmul|dot|wgmma|sm90_|sm80_|ampere_|hopper", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|transpose|dynamic[-_]update[-_]slice", re.I)),
)
MODULES = re.compile(r"XLA Modules", re.I)
DERIVED = re.compile(r"XLA|Framework|Step|Source|Launch|TraceMe|Module", re.I)


def kind_of(name: str) -> str:
    """The kind of a kernel from its name (first matching of `KINDS`, else "other")."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def find_trace(log_dir: str) -> str:
    """The newest ``perfetto_trace.json.gz`` under a `jax.profiler.trace` log directory."""
    paths = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"log_dir: no perfetto_trace.json.gz under {log_dir!r} (trace with "
                                "create_perfetto_trace=True)")
    return max(paths, key=os.path.getmtime)


def summarize(trace: dict, top: int = 25) -> dict:
    """Sum a Perfetto trace's complete events (``ph == "X"``) on GPU stream lines.

    Returns {"devices": {process name: {"busy_s", "span_s", "kinds": {kind: s}, "modules": {program: [s, calls]},
    "top": [[kernel, s, calls], ...]}}, "lines": {process: {line: s}}} -- ``busy_s`` the summed kernel time,
    ``span_s`` first kernel start to last kernel end (``span_s - busy_s``: time with no kernel running, if
    one stream ran at a time); ``modules`` the derived "XLA Modules" line by program (device time of each
    jitted program); ``top`` the ``top`` kernels by time; ``lines`` all lines' sums (derived ones too).
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e.get("args", {}).get("name", "")
    lines: dict = defaultdict(lambda: defaultdict(float))
    per_kernel: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    streams = {(procs.get(e["pid"], ""), threads.get((e["pid"], e.get("tid")), "")) for e in complete}
    kernel_lines = {pl for pl in streams if "GPU" in pl[0] and pl[1].startswith("Stream")}
    if not kernel_lines:  # no stream lines: every GPU line but the derived ones
        kernel_lines = {pl for pl in streams if "GPU" in pl[0] and not DERIVED.search(pl[1])}
    modules: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    span: dict = {}
    for e in complete:
        proc = procs.get(e["pid"], str(e["pid"]))
        line = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        seconds = float(e["dur"]) * 1e-6  # trace times are microseconds
        lines[proc][line] += seconds
        if "GPU" in proc and MODULES.search(line):
            m = modules[proc][e.get("name", "?")]
            m[0] += seconds
            m[1] += 1
        if (proc, line) in kernel_lines:
            k = per_kernel[proc][e.get("name", "?")]
            k[0] += seconds
            k[1] += 1
            t0, t1 = float(e["ts"]) * 1e-6, (float(e["ts"]) + float(e["dur"])) * 1e-6
            lo, hi = span.get(proc, (t0, t1))
            span[proc] = (min(lo, t0), max(hi, t1))
    devices = {}
    for proc, kernels in sorted(per_kernel.items()):
        kinds: dict = defaultdict(float)
        for name, (s, _) in kernels.items():
            kinds[kind_of(name)] += s
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
        lo, hi = span[proc]
        devices[proc] = {"busy_s": sum(kinds.values()), "span_s": hi - lo,
                         "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
                         "modules": {name[:160]: [s, n] for name, (s, n) in
                                     sorted(modules[proc].items(), key=lambda kv: -kv[1][0])},
                         "top": [[name[:160], s, n] for name, (s, n) in ranked]}
    return {"devices": devices, "lines": {p: dict(v) for p, v in lines.items()}}


def summarize_dir(log_dir: str, top: int = 25) -> dict:
    """`summarize` the newest trace under ``log_dir``."""
    with gzip.open(find_trace(log_dir), "rt") as f:
        return summarize(json.load(f), top)


def format_summary(summary: dict, top: int = 12) -> str:
    """Text table: per device the busy time by kind, then its ``top`` kernels."""
    out = []
    for proc, d in summary["devices"].items():
        kinds = ", ".join(f"{k} {s:.2f} s" for k, s in d["kinds"].items())
        out.append(f"{proc}: busy {d['busy_s']:.2f} s of a {d['span_s']:.2f} s span ({kinds})")
        out += [f"  program {name[:80]}: {s:.3f} s, {n} x" for name, (s, n) in list(d["modules"].items())[:6]]
        out += [f"  {s:8.3f} s {n:7d} x  {name[:100]}" for name, s, n in d["top"][:top]]
    return "\n".join(out)
