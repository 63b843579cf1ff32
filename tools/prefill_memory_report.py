"""Compile (without running) the language-model program of a full-model prefill, as `mmjax bench prefill` builds
it (random bf16 weights of a preset, one video of N visual tokens, optional mesh), and report XLA's memory plan:
``memory_analysis()`` and the largest buffers of the buffer assignment with the HLO that defines them. Run with
XLA's dump on (mmjax installed, or ``PYTHONPATH=.``), e.g. on a GPU machine:

    XLA_FLAGS="--xla_dump_to=/tmp/d --xla_dump_hlo_module_re=.*prefill.* --xla_dump_hlo_pass_re=^$" \\
        python3 tools/prefill_memory_report.py --tokens 2097152 --devices 2 --sequence-parallel 2 --dump /tmp/d --out DIR

Writes ``DIR/prefill_memory_<tokens>_<tp>x<sp>.json`` (atomic) and prints the table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.drivers.bench import prefill as bench
from mmjax.files import atomic_write
from mmjax.inference import PROCESSOR_KEYS, runner
from mmjax.parallel import devices_mesh
from mmjax.parallel import run as parallel_run
from mmjax.parallel.attention import prefill_attention
from models.attention import resolve_attention
from models.qwen2_5_vl import Qwen2_5_VL, preset
from models.sharding import model_shardings

ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
VALUE = re.compile(r"^\s+value: <\d+ ([^ ]+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def largest_buffers(path: str, n: int = 25) -> list[dict]:
    """The ``n`` largest allocations of an XLA buffer-assignment dump, each with its largest values."""
    allocs, cur = [], None
    with open(path) as f:
        for line in f:
            m = ALLOC.match(line)
            if m:
                cur = {"allocation": int(m.group(1)), "gib": int(m.group(2)) / 2**30, "kind": m.group(3).strip()[:120],
                       "values": []}
                allocs.append(cur)
                continue
            m = VALUE.match(line)
            if m and cur is not None:
                cur["values"].append((int(m.group(2)), m.group(1), m.group(4)))
    allocs.sort(key=lambda a: -a["gib"])
    for a in allocs:
        a["values"] = [f"{s / 2**30:.2f} GiB {name} {shape}" for s, name, shape in sorted(a["values"], reverse=True)[:4]]
    return allocs[:n]


def abstract_model(name: str, mesh):
    """The Qwen2.5-VL preset ``name`` with ShapeDtypeStruct parameters (bf16; laid out on ``mesh`` when given)."""
    model = nnx.eval_shape(lambda: Qwen2_5_VL(preset(name), dtype=jnp.bfloat16, key=jax.random.key(0)))
    state = nnx.state(model)
    if mesh is not None:
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                             model_shardings(model, mesh))
    nnx.update(model, state)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--preset", default="7b")
    p.add_argument("--config", default="ashape", help="attention name of `mmjax bench prefill`")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--sequence-parallel", type=int, default=1)
    p.add_argument("--mlp-chunk", type=int, default=16384)
    p.add_argument("--dump", help="the --xla_dump_to directory (its buffer assignment is read)")
    p.add_argument("--abstract", action="store_true",
                   help="shapes only (no weights allocated; the preset's real shape even on a CPU)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    mesh = devices_mesh(a.devices, a.sequence_parallel)
    if a.abstract:
        model = abstract_model(a.preset, mesh)
    else:
        model = bench.load_model(argparse.Namespace(model=None, preset=a.preset, layers=None), mesh)
    inputs = bench.video_inputs(model.config, a.tokens, pixels=False)
    run = runner(model)
    pi = run.prepare_inputs(model.config, **{k: inputs[k] for k in PROCESSOR_KEYS if k in inputs})
    t = pi.input_ids.shape[1]
    n_feats = int((inputs["input_ids"] == model.config.video_token_id).sum())
    feats = jax.ShapeDtypeStruct((n_feats, model.config.text.hidden_size), jnp.bfloat16)
    attention = resolve_attention(bench.attention_spec(a.config, model.config))
    arrays = (pi.input_ids, None, feats, pi.position_ids, pi.attention_mask, pi.token_types, pi.rope_deltas)
    t0 = time.perf_counter()
    if mesh is None:
        lowered = run.prefill_language_model.lower(model, *arrays, attention=attention, max_length=t + 256,
                                                   mlp_chunk=a.mlp_chunk, kv_dtype=None)
    else:
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        arrays = tuple(None if x is None else (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)) for x in arrays)
        if n_feats % mesh.devices.size == 0:  # the features as `mmjax.parallel.vision` leaves them: split by frames
            split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
            arrays = arrays[:2] + (jax.ShapeDtypeStruct(feats.shape, feats.dtype, sharding=split),) + arrays[3:]
        with jax.set_mesh(mesh):
            lowered = parallel_run.prefill_program.lower(
                run.prefill_language_model, model, *arrays,
                attention=prefill_attention(attention, mesh, model.config.text.num_key_value_heads, t),
                max_length=parallel_run.round_slots(t + 256, mesh), hidden_layers=(), mlp_chunk=a.mlp_chunk,
                kv_dtype=None,
                mesh=mesh)
    compiled = lowered.compile()
    m = compiled.memory_analysis()
    report = {"tokens": t, "devices": a.devices, "sequence_parallel": a.sequence_parallel, "config": a.config,
              "compile_s": time.perf_counter() - t0,
              "memory_gib": {k: getattr(m, k) / 2**30 for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                                "alias_size_in_bytes", "temp_size_in_bytes")}}
    if a.dump:
        files = sorted(glob.glob(os.path.join(a.dump, "*buffer-assignment.txt")), key=os.path.getsize)
        if files:
            report["buffer_assignment"] = os.path.basename(files[-1])
            report["largest"] = largest_buffers(files[-1])
    tp = a.devices // a.sequence_parallel
    path = os.path.join(a.out, f"prefill_memory_{a.tokens}_{tp}x{a.sequence_parallel}.json")
    atomic_write(path, json.dumps(report, indent=1), overwrite=True)
    print(json.dumps(report["memory_gib"]), f"compile {report['compile_s']:.1f} s")
    for b in report.get("largest", [])[:15]:
        print(f"{b['gib']:8.2f} GiB  {b['kind'][:60]}  {'; '.join(b['values'][:2])}")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
