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
    ("attention", re.compile(r"attention|attn|flash|fmha|cudnn|sdpa|sparse|momo|mha", re.I)),
    ("matmul", re.compile(r"gemm|xmma|cutlass|cublas|matmul|dot|wgmma|sm90_|sm80_|ampere_|hopper", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|transpose|dynamic[-_]update[-_]slice", re.I)),
)
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

    Returns {"devices": {process name: {"busy_s", "kinds": {kind: s}, "top": [[kernel, s, calls], ...]}},
    "lines": {process: {line: s}}} -- ``top`` the ``top`` kernels by time on that device; ``lines`` all
    lines' sums (derived ones too), for checking what was summed.
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
    for e in complete:
        proc = procs.get(e["pid"], str(e["pid"]))
        line = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        seconds = float(e["dur"]) * 1e-6  # trace times are microseconds
        lines[proc][line] += seconds
        if (proc, line) in kernel_lines:
            k = per_kernel[proc][e.get("name", "?")]
            k[0] += seconds
            k[1] += 1
    devices = {}
    for proc, kernels in sorted(per_kernel.items()):
        kinds: dict = defaultdict(float)
        for name, (s, _) in kernels.items():
            kinds[kind_of(name)] += s
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
        devices[proc] = {"busy_s": sum(kinds.values()), "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
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
        out.append(f"{proc}: busy {d['busy_s']:.2f} s ({kinds})")
        out += [f"  {s:8.3f} s {n:7d} x  {name[:100]}" for name, s, n in d["top"][:top]]
    return "\n".join(out)
