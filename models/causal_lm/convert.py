"""Hugging Face Llama / Qwen3 / Qwen3-MoE snapshot -> ``CausalLM`` (NNX).

The tensor names are those of transformers' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` /
``Qwen3MoeForCausalLM`` (``model.layers.{i}.self_attn.q_proj.weight``, ...; q_norm / k_norm for
Qwen3). Mixture-of-experts weights are read in either layout: one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``, as the published Qwen3-MoE checkpoints ship) or fused
(``mlp.experts.gate_up_proj`` [E, 2F, H] / ``mlp.experts.down_proj`` [E, H, F], as transformers 5
holds them). Each stacked parameter is filled on the device one layer at a time (host memory: one
layer's tensor beyond the memory-mapped files).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import safetensors_io
from models.causal_lm.config import CausalLMConfig
from models.causal_lm.model import CausalLM
from models.files import read_json
from models.sharding import check_mesh, param_sharding
from models.snapshot import resolve_snapshot


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one layer's (or a single) parameter comes from: HF ``keys`` with their ``shapes``, and
    ``combine(list of arrays) -> the parameter`` in the model's layout."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    combine: Callable[[list[np.ndarray]], np.ndarray]


def _one(key: str, shape: tuple[int, ...], fn: Callable[[np.ndarray], np.ndarray]) -> Source:
    return Source((key,), (shape,), lambda arrays: fn(arrays[0]))


def fused_experts(tensors: dict[str, Any]) -> bool:
    """True when the checkpoint holds transformers 5's fused expert tensors (``mlp.experts.gate_up_proj``)."""
    return any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)


def layer_sources(cfg: CausalLMConfig, i: int, fused: bool) -> dict[str, Source]:
    """The sources of layer ``i``'s parameters (names of ``models.text_decoder.layer_param_shapes``)."""
    c = cfg.text
    H, N, K, D, F = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    p = f"model.layers.{i}."
    lin = lambda *shape: (lambda w: w.T.reshape(shape))
    ident = lambda w: w
    out = {
        "input_norm": _one(p + "input_layernorm.weight", (H,), ident),
        "wq": _one(p + "self_attn.q_proj.weight", (N * D, H), lin(H, N, D)),
        "wk": _one(p + "self_attn.k_proj.weight", (K * D, H), lin(H, K, D)),
        "wv": _one(p + "self_attn.v_proj.weight", (K * D, H), lin(H, K, D)),
        "wo": _one(p + "self_attn.o_proj.weight", (H, N * D), lin(N, D, H)),
        "post_norm": _one(p + "post_attention_layernorm.weight", (H,), ident),
    }
    if c.qkv_bias:
        out["bq"] = _one(p + "self_attn.q_proj.bias", (N * D,), lambda b: b.reshape(N, D))
        out["bk"] = _one(p + "self_attn.k_proj.bias", (K * D,), lambda b: b.reshape(K, D))
        out["bv"] = _one(p + "self_attn.v_proj.bias", (K * D,), lambda b: b.reshape(K, D))
    if c.o_bias:
        out["bo"] = _one(p + "self_attn.o_proj.bias", (H,), ident)
    if c.qk_norm:
        out["q_norm"] = _one(p + "self_attn.q_norm.weight", (D,), ident)
        out["k_norm"] = _one(p + "self_attn.k_norm.weight", (D,), ident)
    if not c.is_moe:
        out["w_gate"] = _one(p + "mlp.gate_proj.weight", (F, H), lambda w: w.T)
        out["w_up"] = _one(p + "mlp.up_proj.weight", (F, H), lambda w: w.T)
        out["w_down"] = _one(p + "mlp.down_proj.weight", (H, F), lambda w: w.T)
        return out
    E, M = c.num_experts, c.moe_intermediate_size
    out["router"] = _one(p + "mlp.gate.weight", (E, H), lambda w: w.T)
    if fused:  # [E, 2M, H] -> [E, H, 2M]; [E, H, M] -> [E, M, H]
        out["e_gate_up"] = _one(p + "mlp.experts.gate_up_proj", (E, 2 * M, H), lambda w: np.swapaxes(w, 1, 2))
        out["e_down"] = _one(p + "mlp.experts.down_proj", (E, H, M), lambda w: np.swapaxes(w, 1, 2))
        return out
    e = p + "mlp.experts.{}."
    gate_up = [e.format(j) + n for j in range(E) for n in ("gate_proj.weight", "up_proj.weight")]
    out["e_gate_up"] = Source(tuple(gate_up), ((M, H),) * (2 * E), lambda ws: np.stack(
        [np.concatenate([g.T, u.T], axis=1) for g, u in zip(ws[::2], ws[1::2])]))
    out["e_down"] = Source(tuple(e.format(j) + "down_proj.weight" for j in range(E)), ((H, M),) * E,
                           lambda ws: np.stack([w.T for w in ws]))
    return out


def single_sources(cfg: CausalLMConfig) -> dict[str, Source]:
    """Embedding, final norm and (untied) LM head."""
    c = cfg.text
    out = {"embed": _one("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), lambda w: w),
           "final_norm": _one("model.norm.weight", (c.hidden_size,), lambda w: w)}
    if not c.tie_word_embeddings:
        out["lm_head"] = _one("lm_head.weight", (c.vocab_size, c.hidden_size), lambda w: w)
    return out


def check_keys(cfg: CausalLMConfig, tensors: dict[str, safetensors_io.TensorInfo], fused: bool) -> None:
    """Raise a ValueError listing missing keys, unexpected keys and shape mismatches by name. With tied
    embeddings an ``lm_head.weight`` is tolerated (some exports keep it)."""
    expected = {}
    sources = [*single_sources(cfg).values()]
    for i in range(cfg.text.num_hidden_layers):
        sources += layer_sources(cfg, i, fused).values()
    for src in sources:
        expected.update(zip(src.keys, src.shapes))
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - ({"lm_head.weight"} if cfg.text.tie_word_embeddings else set()))
    mismatched = [f"{k}: expected {expected[k]}, got {tuple(tensors[k].shape)}"
                  for k in sorted(set(expected) & set(tensors)) if tuple(tensors[k].shape) != tuple(expected[k])]
    problems = [f"{what} {items}" for what, items in (("missing keys", missing), ("unexpected keys", unexpected),
                                                      ("shape mismatches", mismatched)) if items]
    if problems:
        raise ValueError("checkpoint does not match its config: " + "; ".join(problems))


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buf: jax.Array, value: jax.Array, i: jax.Array) -> jax.Array:
    """buf [L, ...] with ``value`` written at layer ``i`` (in place: buf is donated)."""
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def _read(tensors, src: Source, dtype) -> np.ndarray:
    value = src.combine([safetensors_io.load(tensors[k]) for k in src.keys])
    return np.asarray(value, value.dtype if dtype is None else dtype)


def from_hf(path: str | os.PathLike, config_from_hf: Callable[[dict], CausalLMConfig], dtype=jnp.bfloat16,
            mesh=None) -> CausalLM:
    """Load a local HF snapshot (config.json + safetensors, one file or shards with an index; a snapshot
    directory or a hub-cache model tree) into a ``CausalLM`` whose config ``config_from_hf(parsed
    config.json)`` gives. ``dtype``: parameter dtype (None keeps each tensor's stored dtype). ``mesh``: a
    ``jax.sharding.Mesh`` (axes "tp" / "sp"): each parameter is filled in its layout (`models.sharding`),
    every device receiving only its own slice of each layer."""
    path = resolve_snapshot(path)
    cfg_path = os.path.join(path, "config.json")
    try:
        cfg = config_from_hf(read_json(cfg_path))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{cfg_path}: {e}") from e
    tensors = safetensors_io.index_checkpoint(path)
    fused = fused_experts(tensors)
    try:
        check_keys(cfg, tensors, fused)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype or jnp.float32, key=jax.random.key(0)))
    lm = model.language_model
    place = None if mesh is None else param_sharding(cfg.text, check_mesh(mesh, cfg.text))
    where = lambda name: None if place is None else place("language_model", name)
    for name, src in single_sources(cfg).items():
        setattr(lm, name, nnx.Param(jax.device_put(_read(tensors, src, dtype), where(name))))
    for name in layer_sources(cfg, 0, fused):
        buf, stacked = None, where(name)
        one = None if stacked is None else NamedSharding(stacked.mesh, P(*stacked.spec[1:]))  # one layer's slice
        for i in range(cfg.text.num_hidden_layers):
            value = _read(tensors, layer_sources(cfg, i, fused)[name], dtype)
            if buf is None:
                buf = jnp.zeros((cfg.text.num_hidden_layers,) + value.shape, value.dtype, device=stacked)
            buf = _set_layer(buf, jax.device_put(value, one), jnp.asarray(i, jnp.int32))
            del value
        setattr(lm, name, nnx.Param(buf if stacked is None else jax.device_put(buf, stacked)))
    return model
