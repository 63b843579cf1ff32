"""Training a Sparrow draft: IVSB inputs, multi-token prediction (training-time test), AdamW.

Per cached sequence (``mmjax.speculative.data``) with tokens ``x_t``, target features ``f_t`` (text
positions, ``feature_layer``), intermediate visual states ``h_t`` (visual positions, ``visual_layer``
m*) and the target's final normed states ``g_t`` (text positions):

* Step 1 (IVSB, Eq. 3): the draft input is ``h_t`` at visual positions and ``FC([e(x_{t+1}); f_t])``
  at text positions (HSR, the same entries the draft commits at inference, with the rotary id of
  ``x_{t+1}``; visual entries use their own id). Text queries attend causally to the text entries and,
  with ``ivsb=True``, to the visual entries as well (with ``ivsb=False`` to text entries only, the
  key set VATA keeps at inference).
* Step j > 1 (multi-token prediction, Eq. 4): the text entry at ``t`` is rebuilt from the draft's own
  prediction of the previous step, ``FC([e(x_{t+1}); z^{j-1}_{t-1}])``, exactly what a tree expansion
  feeds the draft (the parent's output z and the child's token). Mask ("training-time test", as in
  EAGLE-3): the query at ``(j, t)`` has anchor ``a = t - j + 1`` and sees the step-1 entries at
  positions ``<= a`` and its own chain of predicted entries, the step-i entry at ``a + i - 1`` for
  ``i = 2..j`` -- what the depth-(j-1) tree node sees at inference.
* Losses at step j and position t, where the chain ``a .. t+1`` is all valid text (and, without
  ``prompt_loss``, ``a`` is at or after the last prompt position): smooth-L1 between ``z^j_t`` and
  ``f_{t+1}`` (mean over H) and the cross-entropy of the draft's next-token distribution
  ``softmax(lm_head(out_norm(z^j_t)))`` against the target's ``softmax(lm_head(g_{t+1}))``; each
  averaged over its positions, weighted ``regression_weight`` / ``ce_weight`` and ``mtp_decay**(j-1)``.

Only the draft's parameters are trained; the target's embedding and LM head are used, never updated.

Notes. With ``ivsb=True`` the draft trains with visual keys that VATA drops at inference; on the tiny
random targets of the tests this mismatch costs tau (``ivsb=False`` trains on exactly the inference
key set). The chain attention scores every query against all ``mtp_steps * T`` keys (a per-query
mask, chunked over queries), ``mtp_steps`` times the work of the causal part alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mmjax.speculative.data import Batch
from mmjax.speculative.draft import SparrowDraft, attend, draft_logits, fuse, project
from models.llava_onevision.model import LlavaOnevision
from models.qwen2_5_vl.model import Qwen2_5_VL
from models.text_decoder import lm_logits


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimiser: AdamW (``learning_rate``, ``b1``, ``b2``, ``eps``, ``weight_decay`` on matrices only)
    after global-norm clipping at ``grad_clip``; linear warmup over ``warmup_steps`` then cosine decay
    to ``min_lr_ratio * learning_rate`` at ``total_steps``. Losses: ``mtp_steps`` prediction steps,
    step j weighted ``mtp_decay**(j-1)``; ``regression_weight`` (smooth L1, ``huber_beta``) and
    ``ce_weight`` (soft-label cross-entropy). ``ivsb``: text queries also see the visual entries.
    ``prompt_loss``: also learn on prompt text (otherwise only from the last prompt position on).
    ``attn_chunk``: queries per attention chunk (bounds the [chunk, mtp_steps * T] score matrix)."""

    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 100
    total_steps: int = 10_000
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    mtp_steps: int = 3
    mtp_decay: float = 0.8
    regression_weight: float = 1.0
    ce_weight: float = 0.1
    huber_beta: float = 1.0
    ivsb: bool = True
    prompt_loss: bool = True
    attn_chunk: int = 1024

    def __post_init__(self):
        pos_float = ("learning_rate", "eps", "huber_beta")
        nonneg_float = ("weight_decay", "min_lr_ratio", "grad_clip", "mtp_decay", "regression_weight", "ce_weight")
        for name in pos_float + nonneg_float:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (name in pos_float and v == 0):
                raise ValueError(f"TrainConfig.{name}: expected a {'positive' if name in pos_float else 'non-negative'}"
                                 f" number, got {v!r}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}: expected a number in [0, 1), got {getattr(self, name)!r}")
        for name, lo in (("warmup_steps", 0), ("total_steps", 1), ("mtp_steps", 1), ("attn_chunk", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"TrainConfig.{name}: expected an int >= {lo}, got {v!r}")
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"TrainConfig.warmup_steps: expected fewer than total_steps={self.total_steps}, got "
                             f"{self.warmup_steps}")
        if self.regression_weight == 0 and self.ce_weight == 0:
            raise ValueError("TrainConfig.regression_weight / ce_weight: expected at least one positive weight")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """params: {name: array} the draft's nnx.Param values (``SparrowDraft.params()`` layout);
    opt_state: the optax state; step: int32 scalar (optimizer steps taken)."""

    params: dict[str, jax.Array]
    opt_state: Any
    step: jax.Array


def schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0, then cosine decay (learning rate as a function of the step)."""
    return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps, config.total_steps,
                                              config.learning_rate * config.min_lr_ratio)


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (weight decay on matrices, not on norms / biases)."""
    decay_mask = lambda params: {k: v.ndim >= 2 for k, v in params.items()}
    return optax.chain(optax.clip_by_global_norm(config.grad_clip),
                       optax.adamw(schedule(config), config.b1, config.b2, config.eps,
                                   weight_decay=config.weight_decay, mask=decay_mask))


def init_train_state(draft: SparrowDraft, config: TrainConfig = TrainConfig()) -> TrainState:
    """Fresh optimizer state for ``draft``'s current parameters."""
    if not isinstance(draft, SparrowDraft):
        raise ValueError(f"draft: expected mmjax.speculative.SparrowDraft, got {type(draft).__name__}")
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config: expected mmjax.speculative.TrainConfig, got {type(config).__name__}")
    params = {k: jnp.array(v, copy=True) for k, v in draft.params().items()}  # train_step donates the state
    return TrainState(params, optimizer(config).init(params), jnp.zeros((), jnp.int32))


def with_params(draft: SparrowDraft, params: dict[str, jax.Array]) -> SparrowDraft:
    """A copy of ``draft`` holding ``params`` (pure; works on traced arrays)."""
    graphdef, state = nnx.split(draft)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def write_params(draft: SparrowDraft, params: dict[str, jax.Array]) -> SparrowDraft:
    """Copy trained ``params`` (e.g. ``TrainState.params``) into ``draft`` in place; returns it."""
    want = draft.params()
    for name, val in params.items():
        if name not in want or tuple(val.shape) != tuple(want[name].shape):
            raise ValueError(f"params: {name!r} does not match the draft (expected {sorted(want)} with its shapes)")
        getattr(draft, name)[...] = jnp.asarray(val, want[name].dtype)
    return draft


# -------------------------------------------------------------------- forward
def _shift_left(a: jax.Array, fill=0) -> jax.Array:
    """a[:, t] <- a[:, t + 1] (last position gets ``fill``)."""
    pad = jnp.full_like(a[:, :1], fill)
    return jnp.concatenate([a[:, 1:], pad], axis=1)


def _shift_right(a: jax.Array, fill=0, by: int = 1) -> jax.Array:
    """a[:, t] <- a[:, t - by] (the first ``by`` positions get ``fill``)."""
    if by == 0:
        return a
    pad = jnp.full_like(a[:, :by], fill)
    return jnp.concatenate([pad, a[:, :-by]], axis=1)


def chain_mask(step: int, query_pos: jax.Array, base_ok: jax.Array, chain_ok: jax.Array) -> jax.Array:
    """Visibility of the keys of steps 1..``step`` (concatenated, each T long) for the step-``step``
    queries at positions query_pos int [C]. base_ok / chain_ok: bool [B, T] step-1 / chain entries
    that exist. Returns bool [B, C, step * T]."""
    t = base_ok.shape[1]
    s = jnp.arange(t)[None, :]
    anchor = query_pos[:, None] - (step - 1)  # [C, 1]
    blocks = [(s <= anchor)[None] & base_ok[:, None, :]]
    for i in range(2, step + 1):
        blocks.append((s == anchor + i - 1)[None] & chain_ok[:, None, :])
    return jnp.concatenate(blocks, axis=2)


def chain_attend(draft: SparrowDraft, x, q, ks, vs, base_ok, chain_ok, chunk: int):
    """Draft layer output for the step-``len(ks)`` entries. x [B, T, H], q [B, T, N, D]; ks/vs: lists
    of [B, T, K, D] (keys of steps 1..j). Queries run in chunks of ``chunk`` (rematerialised in the
    backward pass). Returns z [B, T, H]."""
    step = len(ks)
    b, t = x.shape[:2]
    k = jnp.concatenate(ks, axis=1)
    v = jnp.concatenate(vs, axis=1)
    if t <= chunk:
        return attend(draft, x, q, k, v, chain_mask(step, jnp.arange(t), base_ok, chain_ok))
    n = -(-t // chunk)
    pad = n * chunk - t
    xp = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))

    @jax.checkpoint
    def one(i):
        xc = jax.lax.dynamic_slice_in_dim(xp, i * chunk, chunk, axis=1)
        qc = jax.lax.dynamic_slice_in_dim(qp, i * chunk, chunk, axis=1)
        return attend(draft, xc, qc, k, v, chain_mask(step, i * chunk + jnp.arange(chunk), base_ok, chain_ok))

    z = jax.lax.map(one, jnp.arange(n))  # [n, B, chunk, H]
    return jnp.moveaxis(z, 0, 1).reshape(b, n * chunk, -1)[:, :t]


def rollout(draft: SparrowDraft, target, batch: Batch, config: TrainConfig):
    """The ``mtp_steps`` draft passes over one batch. Returns (zs: list of [B, T, H] per step, masks:
    list of bool [B, T] positions with a loss at each step)."""
    valid = batch.valid
    text = valid & (batch.token_types == 0)
    vis = valid & (batch.token_types > 0)
    nxt_ids = _shift_left(batch.input_ids)
    nxt_pos = _shift_left(batch.positions)
    nxt_text = _shift_left(text, False)
    states = batch.states
    dt = draft.fc_w[...].dtype
    x_text = fuse(draft, target, nxt_ids, states.astype(dt))
    x = jnp.where(vis[..., None], states.astype(x_text.dtype), x_text)
    pos = jnp.where(vis, batch.positions, nxt_pos)
    base_ok = text | vis if config.ivsb else text
    t_idx = jnp.arange(text.shape[1])[None, :]
    chain = text & nxt_text  # step j: the chain a .. t+1 (a = t - j + 1) is all text
    ks, vs, zs, masks = [], [], [], []
    z = None
    for j in range(1, config.mtp_steps + 1):
        if j > 1:
            x = fuse(draft, target, nxt_ids, _shift_right(z).astype(dt))
            pos = nxt_pos
            chain = chain & _shift_right(text, False, by=j - 1)
        mask = chain if config.prompt_loss else chain & (t_idx - (j - 1) >= batch.prompt_length[:, None] - 1)
        q, k, v = project(draft, x, pos)
        ks.append(k)
        vs.append(v)
        z = chain_attend(draft, x, q, ks, vs, base_ok, text, config.attn_chunk)
        zs.append(z)
        masks.append(mask)
    return zs, masks


def _smooth_l1(diff: jax.Array, beta: float) -> jax.Array:
    a = jnp.abs(diff)
    return jnp.where(a < beta, 0.5 * diff * diff / beta, a - 0.5 * beta)


def loss_fn(params: dict[str, jax.Array], draft: SparrowDraft, target, batch: Batch, config: TrainConfig):
    """Total loss and per-step parts. Returns (loss float32 scalar, metrics {"regression", "ce",
    "top1", "count": float32 [mtp_steps]})."""
    d = with_params(draft, params)
    zs, masks = rollout(d, target, batch, config)
    text = batch.valid & (batch.token_types == 0)
    f_next = _shift_left(batch.states).astype(jnp.float32)
    g_next = jnp.where(_shift_left(text, False)[..., None], _shift_left(batch.final), 0)
    t_logits = jax.lax.stop_gradient(lm_logits(target.language_model, g_next.astype(zs[0].dtype)))
    t_logp = jax.nn.log_softmax(t_logits, axis=-1)
    t_p, t_top = jnp.exp(t_logp), jnp.argmax(t_logits, axis=-1)
    total = jnp.zeros((), jnp.float32)
    parts = {"regression": [], "ce": [], "top1": [], "count": []}
    for j, (z, m) in enumerate(zip(zs, masks)):
        mf = m.astype(jnp.float32)
        n = jnp.maximum(mf.sum(), 1.0)
        reg = jnp.sum(mf * jnp.mean(_smooth_l1(z.astype(jnp.float32) - f_next, config.huber_beta), -1)) / n
        d_logits = draft_logits(d, target, z)
        ce = jnp.sum(mf * -jnp.sum(t_p * jax.nn.log_softmax(d_logits, axis=-1), -1)) / n
        top1 = jnp.sum(mf * (jnp.argmax(d_logits, -1) == t_top)) / n
        total = total + config.mtp_decay ** j * (config.regression_weight * reg + config.ce_weight * ce)
        for name, val in (("regression", reg), ("ce", ce), ("top1", top1), ("count", mf.sum())):
            parts[name].append(val)
    return total, {k: jnp.stack(v) for k, v in parts.items()}


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def _train_step(state: TrainState, draft, target, batch: Batch, config: TrainConfig):
    (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, draft, target, batch, config)
    updates, opt_state = optimizer(config).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(parts, loss=loss, grad_norm=optax.global_norm(grads), lr=schedule(config)(state.step))
    return TrainState(params, opt_state, state.step + 1), metrics


def check_batch(draft: SparrowDraft, target, batch: Batch) -> None:
    """ValueErrors for a batch that does not fit the draft / target (host-side, before any compute)."""
    if not isinstance(target, (Qwen2_5_VL, LlavaOnevision)):
        raise ValueError(f"target: expected models.qwen2_5_vl.Qwen2_5_VL or models.llava_onevision.LlavaOnevision, "
                         f"got {type(target).__name__}")
    if not isinstance(draft, SparrowDraft):
        raise ValueError(f"draft: expected mmjax.speculative.SparrowDraft, got {type(draft).__name__}")
    if target.config.text != draft.text:
        raise ValueError("draft: built for a different target text config than `target`")
    if not isinstance(batch, Batch):
        raise ValueError(f"batch: expected mmjax.speculative.data.Batch, got {type(batch).__name__}")
    b, t = batch.input_ids.shape if batch.input_ids.ndim == 2 else (None, None)
    h = draft.text.hidden_size
    want = {"input_ids": (b, t), "token_types": (b, t), "positions": (b, t), "valid": (b, t), "states": (b, t, h),
            "final": (b, t, h), "prompt_length": (b,)}
    for name, shape in want.items():
        got = tuple(getattr(batch, name).shape)
        if None in shape or got != shape:
            raise ValueError(f"batch.{name}: expected shape {shape} (B, T from input_ids [B, T], H={h}), got {got}")
    if t < 2:
        raise ValueError(f"batch.input_ids: expected at least 2 positions, got T={t}")
    if (batch.feature_layer, batch.visual_layer) != (draft.config.feature_layer, draft.config.visual_layer):
        raise ValueError(f"batch: states from layers (feature {batch.feature_layer}, visual {batch.visual_layer}), the "
                         f"draft expects (feature {draft.config.feature_layer}, visual {draft.config.visual_layer})")


def train_step(state: TrainState, draft: SparrowDraft, target, batch: Batch, config: TrainConfig = TrainConfig()):
    """One AdamW step on ``batch`` (jit-compiled once per (T, B, config); ``state`` is donated).

    draft: supplies the layer's structure (its parameter values are ignored; ``state.params`` is
    trained); target: the frozen Qwen2_5_VL or LlavaOnevision (embedding, LM head). Returns (new TrainState, metrics):
    ``loss``, ``grad_norm``, ``lr`` (scalars) and ``regression``, ``ce``, ``top1`` (top-1 agreement
    with the target), ``count`` (positions with a loss), each float32 [mtp_steps].
    """
    if not isinstance(state, TrainState):
        raise ValueError(f"state: expected mmjax.speculative.TrainState (init_train_state), got {type(state).__name__}")
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config: expected mmjax.speculative.TrainConfig, got {type(config).__name__}")
    check_batch(draft, target, batch)
    return _train_step(state, draft, target, batch, config)
