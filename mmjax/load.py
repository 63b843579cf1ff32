"""``mmjax.load``: a model and its processor from a Hugging Face snapshot, the architecture read from config.json.

Supported architectures are the rows of ``ARCHITECTURES`` (one row per model family: its ``model_type``, the
``architectures`` names its config.json may list, the weight loader and the processor class). A new port is one
more row.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from models import llama, llava_onevision, qwen2_5_vl, qwen3
from models.snapshot import resolve_snapshot
from models.tokenizer import read_json


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One model family: ``model_type`` (config.json), the ``architectures`` names that select it,
    ``from_hf(dir, dtype=...) -> model`` and ``processor(dir) -> processor``."""

    model_type: str
    names: tuple[str, ...]
    from_hf: Callable[..., Any]
    processor: Callable[[str], Any]


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), qwen2_5_vl.from_hf,
                 qwen2_5_vl.Processor.from_pretrained),
    Architecture("llama", ("LlamaForCausalLM",), llama.from_hf, llama.Processor.from_pretrained),
    Architecture("qwen3", ("Qwen3ForCausalLM",), qwen3.from_hf, qwen3.Processor.from_pretrained),
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), qwen3.from_hf, qwen3.Processor.from_pretrained),
    Architecture("llava_onevision", ("LlavaOnevisionForConditionalGeneration", "LlavaQwenForCausalLM"),
                 llava_onevision.from_hf, llava_onevision.Processor.from_pretrained),
)


def supported() -> list[str]:
    """The ``architectures`` names ``load`` accepts, each with its ``model_type``."""
    return [f"{n} ({a.model_type})" for a in ARCHITECTURES for n in a.names]


def architecture(config: dict[str, Any], where: str = "config.json") -> Architecture:
    """The row of ``ARCHITECTURES`` for a parsed config.json: by its ``architectures`` list, else its
    ``model_type``. Raises ValueError naming what the config says and the supported list."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    names = config.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    model_type = config.get("model_type")
    for name in names:
        for arch in ARCHITECTURES:
            if name in arch.names:
                return arch
    for arch in ARCHITECTURES:
        if model_type == arch.model_type:
            return arch
    said = f"architectures {list(names)}" if names else "no architectures"
    raise ValueError(f"{where}: unsupported architecture ({said}, model_type {model_type!r}); supported: "
                     f"{', '.join(supported())}")


def snapshot_config(snapshot_dir: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """(resolved snapshot directory, parsed config.json) of a plain or hub-cache snapshot."""
    d = resolve_snapshot(snapshot_dir)
    return d, read_json(os.path.join(d, "config.json"))


def load(snapshot_dir: str | os.PathLike, dtype=jnp.bfloat16, mesh=None) -> tuple[Any, Any]:
    """``(model, processor)`` from a local Hugging Face snapshot.

    snapshot_dir: a directory with config.json, safetensors weights (``model.safetensors`` or shards with
    ``model.safetensors.index.json``) and the processor files, or a hub-cache tree ``models--org--name/``
    (``refs/main`` -> ``snapshots/<hash>/``, files symlinked into ``blobs/``). dtype: parameter dtype (None keeps
    each tensor's stored dtype). The architecture comes from config.json (see ``ARCHITECTURES``); an unsupported
    one raises ValueError before any weight is read. mesh: a ``jax.sharding.Mesh`` (axes "tp" / "sp",
    ``mmjax.parallel.make_mesh``): the weights are read straight into their tensor-parallel layout (no
    device holds a full copy of a split parameter), ready for ``mmjax.prefill(..., mesh=mesh)``.
    """
    d, config = snapshot_config(snapshot_dir)
    arch = architecture(config, os.path.join(d, "config.json"))
    processor = arch.processor(d)
    return arch.from_hf(d, dtype=dtype, **({} if mesh is None else {"mesh": mesh})), processor


def eos_token_ids(snapshot_dir: str | os.PathLike, processor=None) -> tuple[int, ...]:
    """The ids that end an answer: ``eos_token_id`` of the snapshot's generation_config.json (an int or a list),
    else of config.json (top level or ``text_config``), else the tokenizer's ``eos_token`` (``processor``)."""
    d, config = snapshot_config(snapshot_dir)
    gen_path = os.path.join(d, "generation_config.json")
    sources = [("generation_config.json", read_json(gen_path))] if os.path.isfile(gen_path) else []
    sources += [("config.json", config), ("config.json text_config", config.get("text_config"))]
    for where, src in sources:
        value = src.get("eos_token_id") if isinstance(src, dict) else None
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else value
        if isinstance(ids, bool) or not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{where}: eos_token_id: expected a non-negative int or a list of them, got {value!r}")
        if ids:
            return tuple(ids)
    eos = getattr(processor, "eos_token_id", None)
    return () if eos is None else (int(eos),)
