"""Sparrow draft model: one Qwen2-shaped decoder layer fed with the target's hidden states.

Hidden state reuse (HSR, Eq. 1): the draft input at position t is ``FC([e(x_{t+1}) ; f_t])``, the
target's token embedding of the next token concatenated with the target's hidden state ``f_t`` at
``feature_layer`` (HF numbering; default L-1, the output of the second-to-last decoder layer). The
draft layer output ``z_t`` predicts ``f_{t+1}``; ``lm_head(out_norm(z_t))`` predicts ``x_{t+2}``. The
target's embedding and LM head are shared and never trained.

Text-anchored attention (VATA): the draft KV cache holds text positions only (plus the last prompt
position), so a draft step costs the same whatever the number of visual tokens; ``vata=False`` keeps
every prompt position (MSD-style full visual KV, for comparison). Rotary positions are the target's
M-RoPE ids of the input token (text tokens have equal ids on the three axes, so 1-D RoPE).

Draft protocol (also implemented by ``TargetDraft``), used by ``mmjax.generate``:
``begin(target, prefill, first_tokens, n_keep, extra_slots, tree)``, ``extend(...)``, ``expand(...)``;
each returns ``(state, z [B, m, H], logits float32 [B, m, V])`` for the newest entries.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from mmjax.files import atomic_directory, atomic_write, read_json, require_artifact
from models.attention import dense_attention
from models.common import rms_norm
from models.rotary import apply_rotary, mrope_cos_sin
from models.text_decoder import TextConfig, embed_tokens, lm_logits

LAYER_PARAMS = ("input_norm", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "post_norm", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """feature_layer: HF hidden-state index of the target text states fused into the draft input
    (None = L - 1); visual_layer: index m* of the intermediate visual states used in IVSB training
    (None = L // 2); vata: text-only draft KV cache."""

    feature_layer: int | None = None
    visual_layer: int | None = None
    vata: bool = True

    def resolved(self, num_layers: int) -> "DraftConfig":
        f = num_layers - 1 if self.feature_layer is None else int(self.feature_layer)
        v = num_layers // 2 if self.visual_layer is None else int(self.visual_layer)
        for name, val in (("feature_layer", f), ("visual_layer", v)):
            if not 0 <= val <= num_layers:
                raise ValueError(f"DraftConfig.{name}: expected an HF hidden-state index in [0, {num_layers}], got {val}")
        return DraftConfig(f, v, bool(self.vata))


def _shapes(c: TextConfig) -> dict[str, tuple[int, ...]]:
    H, N, K, D, F = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    return {"fc_w": (2 * H, H), "fc_b": (H,), "input_norm": (H,), "wq": (H, N, D), "bq": (N, D), "wk": (H, K, D),
            "bk": (K, D), "wv": (H, K, D), "bv": (K, D), "wo": (N, D, H), "post_norm": (H,), "w_gate": (H, F),
            "w_up": (H, F), "w_down": (F, H), "out_norm": (H,)}


class SparrowDraft(nnx.Module):
    """Trainable draft parameters (the shared embedding / LM head live in the target).

    text: the target's TextConfig (the layer has its shape); config: DraftConfig resolved against it.
    """

    def __init__(self, text: TextConfig, config: DraftConfig = DraftConfig(), *, dtype=jnp.float32,
                 key: jax.Array | None = None, init_std: float = 0.02):
        key = jax.random.key(0) if key is None else key
        self.text = text
        self.config = config.resolved(text.num_hidden_layers)
        keys = iter(jax.random.split(key, 32))
        for name, shape in _shapes(text).items():
            if name.endswith("norm"):
                val = jnp.ones(shape, dtype)
            elif name.startswith("b") or name == "fc_b":
                val = jnp.zeros(shape, dtype)
            else:
                val = init_std * jax.random.normal(next(keys), shape, dtype)
            setattr(self, name, nnx.Param(val))

    @classmethod
    def init(cls, model, key: jax.Array, config: DraftConfig = DraftConfig(), *, dtype=None) -> "SparrowDraft":
        """A fresh draft for ``model`` (a Qwen2_5_VL), in the target's parameter dtype by default."""
        text = model.config.text
        dtype = model.language_model.embed[...].dtype if dtype is None else dtype
        return cls(text, config, dtype=dtype, key=key)

    def params(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in _shapes(self.text)}

    # ---------------------------------------------------------------- checkpoint
    def save(self, ckpt_dir: str, *, overwrite: bool = False) -> None:
        """Write ``ckpt_dir/params`` (orbax) and ``ckpt_dir/draft.json`` (shapes + DraftConfig,
        last), atomically: the directory is built beside ``ckpt_dir`` and swapped in whole. An
        existing ``ckpt_dir`` is replaced only with ``overwrite=True``."""
        meta = {"text": dataclasses.asdict(self.text), "config": dataclasses.asdict(self.config)}
        with atomic_directory(ckpt_dir, overwrite=overwrite) as tmp:
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(os.path.join(tmp, "params"), {k: np.asarray(v) for k, v in self.params().items()})
                ckptr.wait_until_finished()
            atomic_write(os.path.join(tmp, "draft.json"), json.dumps(meta, indent=1))

    @classmethod
    def load(cls, ckpt_dir: str, model=None) -> "SparrowDraft":
        """Inverse of ``save``. With ``model`` given, its text config must match the saved one."""
        ckpt_dir = require_artifact(ckpt_dir, "draft.json", "SparrowDraft.save")
        path = os.path.join(ckpt_dir, "draft.json")
        meta = read_json(path)
        try:
            text = TextConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta["text"].items()})
            config = DraftConfig(**meta["config"])
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not written by SparrowDraft.save ({type(e).__name__}: {e})") from e
        if model is not None and model.config.text != text:
            raise ValueError(f"ckpt_dir: draft was saved for text config {text}, the target has {model.config.text}")
        try:
            with ocp.StandardCheckpointer() as ckptr:
                restored = ckptr.restore(os.path.join(ckpt_dir, "params"))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{os.path.join(ckpt_dir, 'params')}: cannot restore the orbax parameters ({e})") from e
        dtype = jnp.asarray(restored["wq"]).dtype
        draft = cls(text, config, dtype=dtype)
        for name, val in restored.items():
            getattr(draft, name)[...] = jnp.asarray(val)
        return draft

    # ---------------------------------------------------------------- protocol
    @property
    def feature_layer(self) -> int:
        return self.config.feature_layer

    def begin(self, target, prefill, first_tokens, n_keep: int, extra_slots: int, tree):
        return draft_begin(self, target, prefill, first_tokens, n_keep, extra_slots, tree)

    def extend(self, target, state, tokens, features, positions, count):
        return draft_extend(self, target, state, tokens, features, positions, count)

    def expand(self, target, state, level: int, tokens, parent_z, positions, ancestors):
        return draft_expand(self, target, state, level, tokens, parent_z, positions, ancestors)


# -------------------------------------------------------------------- layer math
def fuse(draft: SparrowDraft, target, tokens: jax.Array, features: jax.Array) -> jax.Array:
    """HSR input: tokens int [B, T] (the next tokens), features [B, T, H] target states -> [B, T, H]."""
    p = draft.params()
    e = embed_tokens(target.language_model, tokens.astype(jnp.int32)).astype(p["fc_w"].dtype)
    x = jnp.concatenate([e, features.astype(e.dtype)], axis=-1)
    return jnp.einsum("bti,ih->bth", x, p["fc_w"]) + p["fc_b"]


def rope_tables(draft: SparrowDraft, positions: jax.Array):
    """positions int [B, T] -> cos, sin float32 [B, T, D] (1-D RoPE through the M-RoPE layout)."""
    c = draft.text
    pos = jnp.broadcast_to(positions.astype(jnp.int32)[None], (3,) + positions.shape)
    return mrope_cos_sin(pos, c.head_dim, c.rope_theta, c.mrope_section)


def project(draft: SparrowDraft, x: jax.Array, positions: jax.Array):
    """x [B, T, H], positions int [B, T] -> q [B, T, N, D], k/v [B, T, K, D] (rotary applied)."""
    p = draft.params()
    h = rms_norm(x, p["input_norm"], draft.text.rms_norm_eps)
    q = jnp.einsum("bth,hnd->btnd", h, p["wq"]) + p["bq"]
    k = jnp.einsum("bth,hkd->btkd", h, p["wk"]) + p["bk"]
    v = jnp.einsum("bth,hkd->btkd", h, p["wv"]) + p["bv"]
    cos, sin = rope_tables(draft, positions)
    return apply_rotary(q, cos.astype(x.dtype), sin.astype(x.dtype)), apply_rotary(k, cos.astype(x.dtype), sin.astype(x.dtype)), v


def attend(draft: SparrowDraft, x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
           q_positions: jax.Array | None = None) -> jax.Array:
    """Attention over keys k/v [B, S, K, D] with visibility mask bool [B, T, S] or [B, S] (then causal
    on ``q_positions`` int [B, T], the key slot of each query), then the residual and the MLP:
    -> z [B, T, H]. Rows that see no key get a zero attention output."""
    p = draft.params()
    b, t = q.shape[:2]
    causal = q_positions is not None
    qp = q_positions if causal else jnp.zeros((b, t), jnp.int32)
    o = dense_attention(q, k, v, q_positions=qp, kv_valid=mask, causal=causal)
    z = x + jnp.einsum("btnd,ndh->bth", o.astype(x.dtype), p["wo"])
    h = rms_norm(z, p["post_norm"], draft.text.rms_norm_eps)
    m = jnp.einsum("btf,fh->bth", jax.nn.silu(jnp.einsum("bth,hf->btf", h, p["w_gate"])) * jnp.einsum("bth,hf->btf", h, p["w_up"]),
                   p["w_down"])
    return z + m


def draft_logits(draft: SparrowDraft, target, z: jax.Array) -> jax.Array:
    """z [B, T, H] -> float32 [B, T, V] through the draft's norm and the target's LM head."""
    return lm_logits(target.language_model, rms_norm(z, draft.out_norm[...], draft.text.rms_norm_eps))


# -------------------------------------------------------------------- inference state
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """k/v: [B, S, K, D] committed entries; valid: bool [B, S]; length: int32 slots used;
    pool_k/pool_v: [B, P, K, D] entries of the tree being drafted (frontier nodes, P = (depth-1)*top_k)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    length: jax.Array
    pool_k: jax.Array
    pool_v: jax.Array


def _last(x, count):
    """x [B, m, ...] -> x[b, count[b] - 1] with a kept axis: [B, 1, ...]."""
    idx = jnp.clip(count - 1, 0, x.shape[1] - 1).reshape((-1, 1) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, 1)


def draft_extend(draft, target, state: DraftCache, tokens, features, positions, count):
    """Commit ``c`` entries per row (only the first ``count[b]`` are kept). tokens int [B, c] (the next
    tokens), features [B, c, H] (target states), positions int [B, c] (rotary ids of the tokens),
    count int [B] in [1, c]. Returns (state, z [B, 1, H], logits [B, 1, V]) of each row's last entry."""
    b, c = tokens.shape
    s = state.k.shape[1]
    x = fuse(draft, target, tokens, features)
    q, k, v = project(draft, x, positions)
    ck = jax.lax.dynamic_update_slice_in_dim(state.k, k.astype(state.k.dtype), state.length, axis=1)
    cv = jax.lax.dynamic_update_slice_in_dim(state.v, v.astype(state.v.dtype), state.length, axis=1)
    rel = jnp.arange(s)[None, :] - state.length  # slot relative to the chunk start
    mask = (state.valid & (rel < 0)) | ((rel >= 0) & (rel < count[:, None]))  # causal on slots below
    slots = jnp.broadcast_to(state.length + jnp.arange(c, dtype=jnp.int32), (b, c))
    z = attend(draft, x, q, ck, cv, mask, slots)
    keep = jnp.arange(c)[None, :] < count[:, None]
    valid = jax.lax.dynamic_update_slice_in_dim(state.valid, keep, state.length, axis=1)
    new = dataclasses.replace(state, k=ck, v=cv, valid=valid, length=state.length + jnp.max(count).astype(jnp.int32))
    zl = _last(z, count)
    return new, zl, draft_logits(draft, target, zl)


def draft_expand(draft, target, state: DraftCache, level: int, tokens, parent_z, positions, ancestors):
    """Draft the children of one frontier (level ``level`` >= 1, static). tokens int [B, k] frontier
    tokens; parent_z [B, k, H] the z that proposed each of them; positions int [B, k]; ancestors
    bool [B, k, P] pool entries each frontier node sees (its expanded ancestors and itself).
    Returns (state with the frontier's entries in the pool, z [B, k, H], logits [B, k, V])."""
    kk = tokens.shape[1]
    x = fuse(draft, target, tokens, parent_z)
    q, k, v = project(draft, x, positions)
    off = (level - 1) * kk
    pk = jax.lax.dynamic_update_slice_in_dim(state.pool_k, k.astype(state.pool_k.dtype), off, axis=1)
    pv = jax.lax.dynamic_update_slice_in_dim(state.pool_v, v.astype(state.pool_v.dtype), off, axis=1)
    keys_k = jnp.concatenate([state.k, pk], axis=1)
    keys_v = jnp.concatenate([state.v, pv], axis=1)
    mask = jnp.concatenate([jnp.broadcast_to(state.valid[:, None, :], (tokens.shape[0], kk, state.valid.shape[1])),
                            ancestors], axis=2)
    z = attend(draft, x, q, keys_k, keys_v, mask)
    return dataclasses.replace(state, pool_k=pk, pool_v=pv), z, draft_logits(draft, target, z)


def kept_positions(prefill, vata: bool):
    """bool [B, T]: prompt positions the draft keeps (valid text tokens and the last valid position
    with VATA, every valid position without)."""
    mask = prefill.attention_mask
    t = mask.shape[1]
    last = t - 1 - jnp.argmax(mask[:, ::-1], axis=-1)
    is_last = jnp.arange(t)[None, :] == last[:, None]
    return mask & ((prefill.token_types == 0) | is_last) if vata else mask


def draft_begin(draft, target, prefill, first_tokens, n_keep: int, extra_slots: int, tree):
    """Fill the draft cache from a target prefill (``prefill.hidden_states`` must hold
    ``feature_layer``). first_tokens int [B]: the token sampled after the prompt. n_keep (static):
    at least the most kept positions of any row (``kept_positions``); extra_slots: cache slots for
    generated tokens. Returns (DraftCache, z [B, 1, H], logits [B, 1, V]) of the last prompt entry."""
    feats = prefill.hidden_states.get(draft.feature_layer)
    if feats is None:
        raise ValueError(f"prefill: expected hidden_states[{draft.feature_layer}] (prefill with "
                         f"hidden_layers=({draft.feature_layer},))")
    ids, mask = prefill.input_ids, prefill.attention_mask
    b, t = ids.shape
    last = t - 1 - jnp.argmax(mask[:, ::-1], axis=-1)
    is_last = jnp.arange(t)[None, :] == last[:, None]
    nxt = jnp.concatenate([ids[:, 1:], ids[:, -1:]], axis=1)
    nxt = jnp.where(is_last, first_tokens[:, None], nxt)
    pos0 = prefill.position_ids[0]
    npos = jnp.concatenate([pos0[:, 1:], pos0[:, -1:]], axis=1)
    npos = jnp.where(is_last, prefill.cache.next_position[:, None], npos)
    kept = kept_positions(prefill, draft.config.vata)
    order = jnp.argsort(~kept, axis=1, stable=True)[:, :n_keep]
    count = jnp.sum(kept, axis=1).astype(jnp.int32)
    take = lambda a: jnp.take_along_axis(a, order.reshape(order.shape + (1,) * (a.ndim - 2)), 1)
    c = draft.text
    s = n_keep + extra_slots
    dt = draft.wk[...].dtype
    zeros = lambda m: jnp.zeros((b, m, c.num_key_value_heads, c.head_dim), dt)
    state = DraftCache(zeros(s), zeros(s), jnp.zeros((b, s), bool), jnp.zeros((), jnp.int32),
                       zeros(tree.expanded_slots), zeros(tree.expanded_slots))
    return draft_extend(draft, target, state, take(nxt), take(feats), take(npos), count)
