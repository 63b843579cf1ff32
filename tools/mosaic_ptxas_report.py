"""What ptxas made of the Mosaic GPU block-sparse kernel: registers, spills, and whether it serialised wgmma.

On an sm90 GPU: ``python tools/mosaic_ptxas_report.py --out DIR [--variants a,b]`` compiles the kernel (1 batch,
8 heads, 8k tokens, D 128, bf16, a dense causal layout) in each variant of `VARIANTS` with Mosaic GPU's dumps on
(``MOSAIC_GPU_DUMP_PTXAS`` / ``_SASS``, ``MOSAIC_GPU_DUMP_TO``), keeps each variant's PTX (``DIR/<variant>.ptx``),
removes the other dump files, and writes ``ptxas_report.json``: what ptxas said (registers, spills, and its
C7511 / C7513 "wgmma.mma_async instructions are serialized" notes: a serialised kernel waits for every wgmma
right after issuing it, so nothing overlaps the tensor cores), SASS instruction counts when ``nvdisasm`` is there,
and `inflight_writes` of the PTX.

On any machine: ``python tools/mosaic_ptxas_report.py --ptx FILE...`` prints `inflight_writes` of PTX files
(e.g. ones a GPU run brought back): the instructions behind C7513, which write a register an issued wgmma still
reads or writes. ptxas itself (CUDA 12.9's from the ``nvidia-cuda-nvcc-cu12`` wheel reads Mosaic's PTX 9.0 once
its ``.version`` line says 8.8) gives the same notes on a CPU machine: ``ptxas -arch=sm_90a -v FILE``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jsonl_log import write_atomic  # noqa: E402

from pallas_kernels import BlockLayout  # noqa: E402
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu  # noqa: E402

VARIANTS = {  # name: (block_q, block_k, kernel options)
    "bq64-bk64": (64, 64, {}),
    "bq64-bk64-overlap": (64, 64, dict(overlap=True)),
    "bq64-bk64-overlap-free": (64, 64, dict(overlap=True, pingpong=False)),
    "bq128-bk64-pairs": (128, 64, {}),
    "bq128-bk64-pairs-overlap": (128, 64, dict(overlap=True)),
    "bq128-bk64-single-overlap": (128, 64, dict(overlap=True, key_pairs=False)),
}
SASS_OPS = ("HGMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "MUFU.EX2", "SHFL", "BAR.", "SYNCS", "STL", "LDL")
_REG = re.compile(r"%[a-z]+\d+")
_DEST = re.compile(r"^(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(%[a-z]+\d+)")


def _wgmma_registers(line: str) -> list[str]:
    """The registers in the ``{...}`` operand lists of a ``wgmma.mma_async`` line (accumulators, A from registers)."""
    groups = re.findall(r"\{([^{}]*)\}", line.split("wgmma.mma_async", 1)[1])
    return [r for group in groups for r in _REG.findall(group)]


def inflight_writes(ptx: str) -> list[dict]:
    """Instructions of ``ptx`` that write a register of a wgmma pipeline stage, ptxas's C7513.

    A stage runs from a ``wgmma.mma_async`` issued with no wgmma in flight to the ``wgmma.wait_group`` that leaves
    none in flight (``wgmma.commit_group`` closes a group; ``wait_group N`` keeps the N newest). Reported: writes
    inside a stage to a register named in the operand lists of any wgmma of that stage, also one issued after the
    write (ptxas counts those too: e.g. P's registers rewritten after ``S = Q K^T`` was issued and before ``P V``
    is). Straight-line reading of the text: branches are not followed. Returns dicts of ``line`` (1-based),
    ``text``, ``register`` and ``wgmma_line`` (the stage's first wgmma naming the register)."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    stages = []  # (first line, last line) 0-based
    pending, start = 0, None  # committed groups in flight; line of the stage's first wgmma
    open_group = False
    for i, ln in enumerate(lines):
        if "wgmma.mma_async" in ln:
            if start is None:
                start = i
            open_group = True
        elif "wgmma.commit_group" in ln and open_group:
            pending, open_group = pending + 1, False
        elif (wait := re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ln)) and start is not None:
            pending = min(pending, int(wait.group(1)))
            if not pending and not open_group:
                stages.append((start, i))
                start = None
    found = []
    for first, last in stages:
        regs: dict[str, int] = {}
        for i in range(first, last + 1):
            if "wgmma.mma_async" in lines[i]:
                for r in _wgmma_registers(lines[i]):
                    regs.setdefault(r, i + 1)
        for i in range(first, last + 1):
            dest = _DEST.match(lines[i])
            if not dest or "wgmma" in lines[i] or dest.group(1).startswith(("st.", "bar", "mbarrier", "bra", "setp")):
                continue
            if dest.group(2) in regs:
                found.append({"line": i + 1, "text": lines[i], "register": dest.group(2),
                              "wgmma_line": regs[dest.group(2)]})
    return found


def compile_variant(name: str, out: str) -> dict:
    """Compile and run variant ``name`` once with Mosaic GPU's dumps on (an sm90 GPU)."""
    bq, bk, opts = VARIANTS[name]
    dump = os.path.join(out, name)
    os.makedirs(dump, exist_ok=True)
    os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_TO=dump)
    try:
        s = 8192
        q = jnp.zeros((1, s, 8, 128), jnp.bfloat16) + 0.01
        lay = BlockLayout.dense_causal(s, s, block_q=bq, block_k=bk)
        f = jax.jit(lambda q, lay: block_sparse_attention_mosaic_gpu(q, q, q, lay, sm_scale=0.1, **opts)[0])
        jax.block_until_ready(f(q, lay))
    finally:
        for key in ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS", "MOSAIC_GPU_DUMP_TO"):
            os.environ.pop(key)

    def read(pattern):
        text = ""
        for path in sorted(glob.glob(os.path.join(dump, pattern))):
            with open(path, errors="replace") as fh:
                text += fh.read()
        return text

    ptxas = [ln.rstrip() for ln in read("*.ptxas").splitlines() if ln.strip()]
    sass = read("*.sass")
    ptx = read("*.ptx")
    if ptx:
        write_atomic(os.path.join(out, f"{name}.ptx"), lambda fh: fh.write(ptx))
    shutil.rmtree(dump)
    return {"variant": name, "block_q": bq, "block_k": bk, "options": opts, "ptxas": ptxas,
            "serialised": [ln for ln in ptxas if re.search(r"C751\d", ln)],
            "sass_counts": {op: len(re.findall(rf"\b{re.escape(op)}", sass)) for op in SASS_OPS} if sass else None,
            "inflight_writes": inflight_writes(ptx)[:20]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="compile the variants here (an sm90 GPU)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--ptx", nargs="+", help="PTX files to check for writes to registers of wgmma in flight")
    args = ap.parse_args(argv)
    if args.ptx:
        for path in args.ptx:
            with open(path) as fh:
                hits = inflight_writes(fh.read())
            print(f"== {path}: {len(hits)} writes to registers of a wgmma in flight")
            for h in hits[:20]:
                print(f"   line {h['line']}: {h['text'][:100]}  ({h['register']} of the wgmma at line "
                      f"{h['wgmma_line']})")
        return 0
    if not args.out:
        ap.error("give --out (compile on a GPU) or --ptx FILE...")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name in args.variants.split(","):
        try:
            row = compile_variant(name, args.out)
        except Exception as e:  # noqa: BLE001 -- one failing variant must not hide the others
            row = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        rows.append(row)
        print(f"== {name}: {row.get('error') or row['serialised'] or 'not serialised'}", flush=True)
        for ln in row.get("ptxas", []):
            if re.search(r"registers|spill|C75", ln):
                print("   ", ln[:200], flush=True)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    write_atomic(os.path.join(args.out, "ptxas_report.json"), lambda fh: json.dump(report, fh, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
