"""SigLIP vision tower and the 2-layer MLP projector of LLaVA-OneVision, as pure functions over NNX parameters.

A tile is ``[3, S, S]`` pixels (S = ``image_size``); the tower turns it into ``(S / p)**2`` patch features
(conv patch embedding + learned position embedding, then pre-norm encoder layers: LayerNorm -> attention with
biases -> residual -> LayerNorm -> fc1 -> tanh-GELU -> fc2 -> residual). The hidden states named by
``vision_feature_layers`` (transformers' ``hidden_states`` numbering, 0 = embeddings) are concatenated on the
channel axis and projected to the decoder width; the post-layernorm and pooling head are not used (as in
transformers' ``LlavaOnevisionModel``). Layer weights are stacked on a leading axis and run under ``lax.scan``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.common import scaled_normal
from models.llava_onevision.config import LlavaOnevisionConfig
from models.vision_attention import attention_form, tile_attention


def layer_param_shapes(config: LlavaOnevisionConfig) -> dict[str, tuple[int, ...]]:
    """Stacked encoder-layer parameters: name -> shape (L layers, C width, N heads, D head dim, F intermediate)."""
    v = config.vision
    L, C, N, D, F = v.num_hidden_layers, v.hidden_size, v.num_attention_heads, v.head_dim, v.intermediate_size
    return {"ln1_w": (L, C), "ln1_b": (L, C), "wq": (L, C, N, D), "bq": (L, N, D), "wk": (L, C, N, D), "bk": (L, N, D),
            "wv": (L, C, N, D), "bv": (L, N, D), "wo": (L, N, D, C), "bo": (L, C), "ln2_w": (L, C), "ln2_b": (L, C),
            "fc1_w": (L, C, F), "fc1_b": (L, F), "fc2_w": (L, F, C), "fc2_b": (L, C)}


def single_param_shapes(config: LlavaOnevisionConfig) -> dict[str, tuple[int, ...]]:
    """Unstacked parameters: patch embedding, positions, projector (``proj_*``) and ``image_newline``."""
    v, H = config.vision, config.text.hidden_size
    shapes = {"patch_w": (v.patch_dim, v.hidden_size), "patch_b": (v.hidden_size,),
              "pos_embed": (v.grid ** 2, v.hidden_size),
              "proj1_w": (v.hidden_size * len(config.vision_feature_layers), H), "proj2_w": (H, H),
              "image_newline": (H,)}
    if config.projector_bias:
        shapes.update(proj1_b=(H,), proj2_b=(H,))
    return shapes


class VisionTower(nnx.Module):
    """Parameters of the SigLIP tower (`layer_param_shapes`, stacked) and the projector / newline
    (`single_param_shapes`)."""

    def __init__(self, config: LlavaOnevisionConfig, *, dtype=jnp.float32, key: jax.Array, init_std: float = 0.02):
        self.config = config
        shapes = {**layer_param_shapes(config), **single_param_shapes(config)}
        keys = iter(jax.random.split(key, len(shapes)))
        for name, shape in shapes.items():
            k = next(keys)
            if name.startswith("ln") and name.endswith("_w"):
                value = jnp.ones(shape, dtype)
            elif name.endswith("_b") or name.startswith("b"):
                value = jnp.zeros(shape, dtype)
            else:
                value = scaled_normal(k, shape, dtype, init_std)
            setattr(self, name, nnx.Param(value))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in layer_param_shapes(self.config)}


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _gelu(x: jax.Array, act: str) -> jax.Array:
    return jax.nn.gelu(x, approximate=act == "gelu_pytorch_tanh")


def _encoder_layer(config: LlavaOnevisionConfig, p, x, attention: str):
    """x: [B, P, C] -> [B, P, C]; attention: "xla" | "cudnn" (`models.vision_attention`)."""
    v = config.vision
    h = layer_norm(x, p["ln1_w"], p["ln1_b"], v.layer_norm_eps)
    q = jnp.einsum("bpc,cnd->bpnd", h, p["wq"]) + p["bq"]
    k = jnp.einsum("bpc,cnd->bpnd", h, p["wk"]) + p["bk"]
    val = jnp.einsum("bpc,cnd->bpnd", h, p["wv"]) + p["bv"]
    o = tile_attention(q, k, val, scale=v.head_dim ** -0.5, lengths=None, attention=attention).astype(x.dtype)
    x = x + jnp.einsum("bqnd,ndc->bqc", o, p["wo"]) + p["bo"]
    h = layer_norm(x, p["ln2_w"], p["ln2_b"], v.layer_norm_eps)
    h = _gelu(jnp.einsum("bpc,cf->bpf", h, p["fc1_w"]) + p["fc1_b"], v.hidden_act)
    return x + jnp.einsum("bpf,fc->bpc", h, p["fc2_w"]) + p["fc2_b"]


def patch_embed(tower: VisionTower, tiles: jax.Array) -> jax.Array:
    """tiles [B, 3, S, S] -> embeddings [B, (S/p)**2, C] (conv patch embedding + position embedding)."""
    v = tower.config.vision
    b, c, _s, _ = tiles.shape
    g, p = v.grid, v.patch_size
    x = tiles[:, :, :g * p, :g * p].astype(tower.patch_w[...].dtype).reshape(b, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
    x = x.reshape(b, g * g, c * p * p)
    return jnp.einsum("bpk,kc->bpc", x, tower.patch_w[...]) + tower.patch_b[...] + tower.pos_embed[...]


def tower_features(tower: VisionTower, tiles: jax.Array, attention: str = "auto") -> jax.Array:
    """tiles [B, 3, S, S] -> the selected hidden states concatenated: [B, P, C * len(vision_feature_layers)]
    (P = (S/p)**2, minus the first patch for the "default" strategy). Layers after the last selected one are
    skipped. attention: "auto" | "xla" | "cudnn" (`models.vision_attention.attention_form`)."""
    config = tower.config
    v = config.vision
    if tiles.ndim != 4 or tiles.shape[1:] != (v.num_channels, v.image_size, v.image_size):
        raise ValueError(f"pixel tiles: expected [B, {v.num_channels}, {v.image_size}, {v.image_size}], got "
                         f"{tiles.shape}")
    attention = attention_form(attention, tower.patch_w[...].dtype, v.head_dim)
    wanted = config.feature_layers
    depth = max(wanted)
    x = patch_embed(tower, tiles)
    params = {n: a[:depth] for n, a in tower.stacked().items()}
    idx = jnp.asarray(wanted, jnp.int32)
    buf = jnp.where((idx == 0)[:, None, None, None], x[None], jnp.zeros((len(wanted),) + x.shape, x.dtype))

    def step(carry, xs):
        h, buf = carry
        p, i = xs
        h = _encoder_layer(config, p, h, attention)
        buf = jnp.where((idx == i + 1)[:, None, None, None], h[None], buf)
        return (h, buf), None

    if depth:
        (x, buf), _ = jax.lax.scan(step, (x, buf), (params, jnp.arange(depth, dtype=jnp.int32)))
    feats = jnp.concatenate(list(buf), axis=-1)
    return feats[:, 1:] if config.select_strategy == "default" else feats


def project(tower: VisionTower, feats: jax.Array) -> jax.Array:
    """The multimodal projector: [..., C * n_layers] -> [..., H] (linear -> GELU -> linear)."""
    c = tower.config
    h = jnp.einsum("...c,ch->...h", feats, tower.proj1_w[...])
    if c.projector_bias:
        h = h + tower.proj1_b[...]
    h = jnp.einsum("...c,ch->...h", _gelu(h, c.projector_act), tower.proj2_w[...])
    return h + tower.proj2_b[...] if c.projector_bias else h


def encode_tiles(tower: VisionTower, tiles: jax.Array, chunk: int | None = None, attention: str = "auto") -> jax.Array:
    """tiles [B, 3, S, S] -> projected features [B, P, H]; ``chunk`` tiles at a time (None: all at once);
    attention as in `tower_features` (cuDNN on a GPU with bf16 / fp16 weights by default)."""
    if chunk is None or chunk >= tiles.shape[0]:
        return project(tower, tower_features(tower, tiles, attention))
    return jax.lax.map(lambda t: project(tower, tower_features(tower, t[None], attention))[0], tiles,
                       batch_size=chunk)
