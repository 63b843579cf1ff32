"""``mmjax.generate``: prefill with any attention configuration, then plain or speculative decoding.

Every decoding step is one call of a jit-compiled function with static shapes (one compilation per
generate configuration, none per token). The host loop only checks for the end of each row, one step
behind: it dispatches step n + 1 (fed with step n's outputs, still on the device) before it reads step
n's tokens, so the device does not wait for the host between steps (one extra step is computed and
discarded at the end).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from mmjax.inference import check_model, decode_step, prefill, runner
from mmjax.speculative.draft import kept_positions
from mmjax.speculative.sampling import Sampling, sample
from mmjax.speculative.step import speculative_step
from mmjax.speculative.tree import TreeConfig


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """tokens: int32 [B, max_new_tokens] generated tokens (-1 after a row's end); num_tokens: int32 [B];
    tau: int32 [steps, B] tokens emitted by each step (accepted draft tokens + 1; 1 for plain decoding;
    0 once a row has finished); the first token, sampled from the prefill logits, is not a step."""

    tokens: np.ndarray
    num_tokens: np.ndarray
    tau: np.ndarray

    @property
    def mean_tau(self) -> float:
        """Mean accepted length over the steps of unfinished rows."""
        t = self.tau[self.tau > 0]
        return float(t.mean()) if t.size else float("nan")


@functools.partial(jax.jit, static_argnames=("sampling",))
def _sample(key, logits, sampling: Sampling):
    key, sub = jax.random.split(key)
    return key, sample(sub, logits, sampling)


@functools.partial(jax.jit, static_argnames=("sampling",), donate_argnames=("cache",))
def _decode_and_sample(model, cache, tokens, key, sampling: Sampling):
    """One plain decoding step and its sampling as one dispatch: tokens int32 [B] -> (cache, key,
    next tokens int32 [B]); the cache is donated."""
    logits, cache = decode_step(model, cache, tokens)
    key, sub = jax.random.split(key)
    return cache, key, sample(sub, logits, sampling)


def _eos_ids(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, (int, np.integer)) else eos_token_id
    if isinstance(ids, (str, bytes)) or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                                  for i in ids):
        raise ValueError(f"eos_token_id: expected None, an int or a sequence of ints, got {eos_token_id!r}")
    return frozenset(int(i) for i in ids)


def _check(model, max_new_tokens, sampling, draft, tree):
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling: expected mmjax.speculative.Sampling, got {type(sampling).__name__}")
    if not isinstance(tree, TreeConfig):
        raise ValueError(f"tree: expected mmjax.speculative.TreeConfig, got {type(tree).__name__}")
    if draft is not None and not all(hasattr(draft, m) for m in ("begin", "extend", "expand", "feature_layer")):
        raise ValueError("draft: expected None, a SparrowDraft or a TargetDraft (begin / extend / expand)")
    if draft is not None and not hasattr(runner(model), "cached_forward"):
        raise ValueError(f"draft: speculative decoding runs on a Qwen2.5-VL or LLaVA-OneVision target; got a "
                         f"{type(model).__name__} (use draft=None)")


def generate(model, inputs: Mapping[str, Any], max_new_tokens: int, sampling: Sampling = Sampling(), draft=None,
             tree: TreeConfig = TreeConfig(), *, attention: Any = "dense",
             eos_token_id: int | Sequence[int] | None = None,
             on_tokens: Callable[[list[np.ndarray]], Any] | None = None, mesh=None,
             **prefill_kwargs) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens per row after the prompt in ``inputs`` (HF processor
    outputs, as for ``mmjax.prefill``).

    sampling: greedy (temperature 0) or temperature / top-k / top-p sampling. draft: None = plain
    decoding; a ``SparrowDraft`` or ``TargetDraft`` = speculative decoding with a dynamic draft ``tree``
    (lossless: greedy output equals plain greedy decoding; sampled tokens follow the target's
    distribution). attention: prefill attention ("dense", "cudnn", callable, SparseConfig, ...);
    decoding attends densely. eos_token_id: a row stops after emitting it (or any of a sequence of ids).
    on_tokens: called on the host after the first token and after each decoding step with a list of B int32
    arrays, row r's newly emitted tokens (empty once the row has finished), e.g. to stream text.
    mesh: prefill and decode tensor- / sequence-parallel on this ``jax.sharding.Mesh`` (see
    ``mmjax.prefill``; plain decoding only).
    """
    check_model(model)
    _check(model, max_new_tokens, sampling, draft, tree)
    if on_tokens is not None and not callable(on_tokens):
        raise ValueError(f"on_tokens: expected None or a callable, got {type(on_tokens).__name__}")
    if mesh is not None and draft is not None:
        raise ValueError("mesh: speculative decoding runs on one device; expected draft=None with a mesh")
    eos = _eos_ids(eos_token_id)
    ids = np.asarray(inputs["input_ids"]) if "input_ids" in inputs else None
    if ids is None or ids.ndim != 2:
        raise ValueError("inputs: expected 'input_ids' of shape [B, T]")
    b, t = ids.shape
    depth = tree.depth if draft is not None else 0
    bound = max_new_tokens + depth + 1 if b == 1 else (depth + 1) * max_new_tokens
    scratch = max(tree.n_tree, tree.expanded_slots) if draft is not None else 0
    hidden = () if draft is None or draft.feature_layer is None else (draft.feature_layer,)
    pre = prefill(model, inputs, attention, hidden_layers=hidden, max_length=t + bound + scratch, mesh=mesh,
                  **prefill_kwargs)
    key = jax.random.key(sampling.seed)
    key, first = _sample(key, pre.logits, sampling)
    out = np.full((b, max_new_tokens), -1, np.int32)
    n_out = np.zeros((b,), np.int32)
    done = np.zeros((b,), bool)
    taus = []

    def emit(tokens, counts):
        tokens, counts = np.asarray(tokens).reshape(b, -1), np.asarray(counts).reshape(b)
        step_tau = np.zeros((b,), np.int32)
        start = n_out.copy()
        for r in range(b):
            if done[r]:
                continue
            for x in tokens[r, :counts[r]]:
                out[r, n_out[r]] = x
                n_out[r] += 1
                step_tau[r] += 1
                if n_out[r] >= max_new_tokens or int(x) in eos:
                    done[r] = True
                    break
        if on_tokens is not None:
            on_tokens([out[r, start[r]:n_out[r]].copy() for r in range(b)])
        return step_tau

    emit(first, np.ones((b,), np.int32))
    cache = pre.cache
    if draft is None:
        tok, pending = first, None
        while not done.all():
            if mesh is None:
                cache, key, tok = _decode_and_sample(model, cache, tok, key, sampling)  # queued, not awaited
            else:
                logits, cache = decode_step(model, cache, tok, mesh=mesh)
                key, tok = _sample(key, logits, sampling)
            if pending is not None:
                taus.append(emit(pending, np.ones((b,), np.int32)))  # waits for the previous step only
            pending = tok
    else:
        n_keep = int(np.asarray(kept_positions(pre, draft.config.vata if hasattr(draft, "config") else True)
                                ).sum(1).max())
        dstate, z_last, logits_last = _begin(model, draft, pre, first, n_keep, bound + 1, tree)
        root, pending = first, None
        for _ in range(bound):
            if done.all():
                break
            cache, dstate, root, z_last, logits_last, key, emitted, count = speculative_step(
                model, draft, cache, dstate, root, z_last, logits_last, key, tree=tree, sampling=sampling)
            if pending is not None:
                taus.append(emit(*pending))  # the previous step's tokens, while this one runs
            pending = (emitted, count)
        if pending is not None and not done.all():
            taus.append(emit(*pending))
    tau = np.stack(taus) if taus else np.zeros((0, b), np.int32)
    return GenerateOutput(out, n_out, tau)


@functools.partial(jax.jit, static_argnames=("n_keep", "extra_slots", "tree"))
def _begin(model, draft, pre, first, n_keep, extra_slots, tree):
    return draft.begin(model, pre, first, n_keep, extra_slots, tree)
