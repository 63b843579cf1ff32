"""Training data for a Sparrow draft: target prefills cached per example (self-distillation).

For each (image or video, text) prompt, given as an HF-processor-style input dict with one row, the
pipeline optionally appends the target's own greedy continuation (``mmjax.generate``; the draft then
learns the target's distribution, as EAGLE and Sparrow do), runs one dense prefill of the whole
sequence without gradients and keeps, per position ``t`` of the padded sequence (length ``T``, the
smallest bucket that fits):

* ``input_ids`` int32 [T], ``token_types`` int32 [T] (0 text, 1 image, 2 video), ``positions`` int32
  [T] (temporal M-RoPE id), ``valid`` bool [T] (False on padding), ``prompt_length`` (an int);
* ``states`` [T, H]: the target's hidden state at ``feature_layer`` (the HSR features ``f_t``) at text
  positions and at ``visual_layer`` m* (the IVSB states ``h_vis^{m*}``) at visual positions; one
  array holds both since each position needs exactly one of them;
* ``final`` [T, H]: the final normed hidden state at text positions (zero elsewhere); the frozen LM
  head turns it into the target's token distribution, so no [T, V] logits are stored.

Examples save to / load from ``.npz`` shards. ``batches`` groups equal-length examples, so
``train_step`` compiles once per bucket.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mmjax.files import atomic_directory, atomic_write, atomic_write_with, read_json
from mmjax.inference import check_model, prefill
from mmjax.speculative.draft import DraftConfig
from mmjax.speculative.generate import generate

STORE_DTYPES = ("float32", "bfloat16")
INDEX = "index.json"  # the shard list, written last by save_examples
ARRAY_FIELDS = ("input_ids", "token_types", "positions", "valid", "states", "final")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """max_new_tokens: length of the target's greedy continuation appended to each prompt (0 = use
    the text as given, e.g. prompt + reference answer); eos_token_id: ends a continuation early;
    buckets: allowed padded lengths (ascending); dtype: storage dtype of the states ("float32" or
    "bfloat16", the latter stored as uint16 bits)."""

    max_new_tokens: int = 0
    eos_token_id: int | None = None
    buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    dtype: str = "float32"

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"DataConfig.max_new_tokens: expected an int >= 0, got {self.max_new_tokens!r}")
        b = tuple(self.buckets)
        if not b or any(not isinstance(x, int) or x < 2 for x in b) or list(b) != sorted(set(b)):
            raise ValueError(f"DataConfig.buckets: expected strictly increasing ints >= 2, got {self.buckets!r}")
        if self.dtype not in STORE_DTYPES:
            raise ValueError(f"DataConfig.dtype: expected one of {STORE_DTYPES}, got {self.dtype!r}")


@dataclasses.dataclass(frozen=True)
class Example:
    """One cached sequence (numpy arrays, shapes in the module docstring; T a bucket length).
    feature_layer / visual_layer: the HF hidden-state indices the states come from."""

    input_ids: np.ndarray
    token_types: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    states: np.ndarray
    final: np.ndarray
    prompt_length: int
    feature_layer: int
    visual_layer: int

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """Stacked examples of one length: input_ids / token_types / positions int32 [B, T], valid bool
    [B, T], states / final [B, T, H], prompt_length int32 [B]. feature_layer / visual_layer are static."""

    input_ids: jax.Array
    token_types: jax.Array
    positions: jax.Array
    valid: jax.Array
    states: jax.Array
    final: jax.Array
    prompt_length: jax.Array
    feature_layer: int = dataclasses.field(metadata=dict(static=True))
    visual_layer: int = dataclasses.field(metadata=dict(static=True))


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"inputs: sequence of {n} tokens (prompt + continuation) is longer than the largest bucket "
                     f"{buckets[-1]} (DataConfig.buckets)")


def _continuation(model, inputs, config: DataConfig) -> np.ndarray:
    """The target's greedy continuation, cut before the first image / video pad token (a generated pad
    token would not match the visual grids when the sequence is prefilled again)."""
    out = generate(model, inputs, config.max_new_tokens, eos_token_id=config.eos_token_id)
    toks = out.tokens[0, :int(out.num_tokens[0])]
    pads = np.isin(toks, [model.config.image_token_id, model.config.video_token_id])
    return toks[:int(np.argmax(pads))] if pads.any() else toks


def build_example(model, inputs: Mapping[str, Any], config: DataConfig = DataConfig(),
                  draft_config: DraftConfig = DraftConfig()) -> Example:
    """Run the target on one prompt and cache what the draft's training needs.

    inputs: HF processor outputs of ONE row (``input_ids`` [1, T0], optional ``attention_mask`` (left
    padding is dropped), ``pixel_values`` + ``image_grid_thw`` and/or ``pixel_values_videos`` +
    ``video_grid_thw`` + ``second_per_grid_ts``). draft_config: which layers to keep (resolved
    against the target: ``feature_layer`` default L-1, ``visual_layer`` default L//2).
    """
    check_model(model)
    if not isinstance(config, DataConfig):
        raise ValueError(f"config: expected mmjax.speculative.DataConfig, got {type(config).__name__}")
    if not isinstance(draft_config, DraftConfig):
        raise ValueError(f"draft_config: expected mmjax.speculative.DraftConfig, got {type(draft_config).__name__}")
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise ValueError("inputs: expected a mapping with an 'input_ids' entry (HF processor outputs)")
    ids = np.asarray(inputs["input_ids"])
    if ids.ndim != 2 or ids.shape[0] != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"inputs: expected integer 'input_ids' of shape [1, T] (one example per dict), got "
                         f"{ids.dtype} {ids.shape}")
    mask = inputs.get("attention_mask")
    mask = np.ones(ids.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    if mask.shape != ids.shape:
        raise ValueError(f"inputs: expected 'attention_mask' of shape {ids.shape}, got {mask.shape}")
    L = model.config.text.num_hidden_layers
    dc = draft_config.resolved(L)
    prompt = ids[0][mask[0]]
    base = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    cont = np.zeros((0,), np.int64)
    if config.max_new_tokens > 0:
        cont = _continuation(model, {**base, "input_ids": prompt[None], "attention_mask": np.ones((1, len(prompt)), bool)},
                             config)
    seq = np.concatenate([prompt, cont]).astype(np.int64)
    n = len(seq)
    t = _bucket(n, config.buckets)
    full = np.zeros((1, t), np.int64)
    full[0, :n] = seq
    valid = np.arange(t)[None] < n
    layers = tuple(sorted({dc.feature_layer, dc.visual_layer, L}))
    pre = prefill(model, {**base, "input_ids": full, "attention_mask": valid}, hidden_layers=layers, max_length=t)
    types = np.asarray(pre.token_types)[0]
    text, vis = (types == 0) & valid[0], (types > 0) & valid[0]
    f = np.asarray(pre.hidden_states[dc.feature_layer][0], np.float32)
    hv = np.asarray(pre.hidden_states[dc.visual_layer][0], np.float32)
    hl = np.asarray(pre.hidden_states[L][0], np.float32)
    states = np.where(text[:, None], f, np.where(vis[:, None], hv, 0.0))
    final = np.where(text[:, None], hl, 0.0)
    cast = (lambda a: a.astype(ml_dtypes.bfloat16)) if config.dtype == "bfloat16" else (lambda a: a.astype(np.float32))
    return Example(input_ids=full[0].astype(np.int32), token_types=types.astype(np.int32),
                   positions=np.asarray(pre.position_ids)[0, 0].astype(np.int32), valid=valid[0], states=cast(states),
                   final=cast(final), prompt_length=int(len(prompt)), feature_layer=dc.feature_layer,
                   visual_layer=dc.visual_layer)


def build_examples(model, inputs: Iterable[Mapping[str, Any]], config: DataConfig = DataConfig(),
                   draft_config: DraftConfig = DraftConfig()) -> list[Example]:
    """``build_example`` for every input dict."""
    return [build_example(model, x, config, draft_config) for x in inputs]


# -------------------------------------------------------------------- shards
def save_examples(examples: Sequence[Example], directory: str, shard_size: int = 64, *,
                  overwrite: bool = False) -> list[str]:
    """Write ``directory/shard-00000.npz``, ... (``shard_size`` examples each) and
    ``directory/index.json`` (the shard names and the example count, written last). The
    directory is built beside its target and swapped in whole, so no stale shard of an earlier
    save survives; an existing ``directory`` is replaced only with ``overwrite=True``. Returns
    the shard paths."""
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise ValueError(f"shard_size: expected an int >= 1, got {shard_size!r}")
    if any(not isinstance(e, Example) for e in examples):
        raise ValueError("examples: expected a sequence of mmjax.speculative.data.Example")
    names = []
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        for s in range(0, len(examples), shard_size):
            arrays = {}
            for i, e in enumerate(examples[s:s + shard_size]):
                for name in ARRAY_FIELDS:
                    a = getattr(e, name)
                    arrays[f"{i}.{name}"] = a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a
                    if a.dtype == ml_dtypes.bfloat16:
                        arrays[f"{i}.{name}.bf16"] = np.asarray(True)
                arrays[f"{i}.meta"] = np.asarray([e.prompt_length, e.feature_layer, e.visual_layer], np.int64)
            names.append(f"shard-{s // shard_size:05d}.npz")
            atomic_write_with(os.path.join(tmp, names[-1]), lambda f, a=arrays: np.savez(f, **a), binary=True)
        atomic_write(os.path.join(tmp, INDEX), json.dumps({"shards": names, "examples": len(examples)}, indent=1))
    return [os.path.join(os.path.abspath(directory), n) for n in names]


def load_examples(directory: str) -> list[Example]:
    """Inverse of ``save_examples``: the shards ``index.json`` lists, in order (directories
    from before the index: every ``shard-*.npz`` in name order). Errors name the file."""
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        meta = read_json(index)
        names, count = meta.get("shards"), meta.get("examples")
        if not isinstance(names, list) or not all(isinstance(n, str) and os.path.basename(n) == n for n in names) \
                or not isinstance(count, int):
            raise ValueError(f"{index}: expected {{\"shards\": [file names], \"examples\": int}}")
        paths = [os.path.join(directory, n) for n in names]
    else:
        paths, count = sorted(glob.glob(os.path.join(glob.escape(directory), "shard-*.npz"))), None
        if not paths:
            raise ValueError(f"directory: expected {INDEX} and shard-*.npz files (written by save_examples) in "
                             f"{directory!r}")
    out = []
    for path in paths:
        try:
            with np.load(path, allow_pickle=False) as z:
                n = len([k for k in z.files if k.endswith(".meta")])
                for i in range(n):
                    fields = {}
                    for name in ARRAY_FIELDS:
                        a = z[f"{i}.{name}"]
                        fields[name] = a.view(ml_dtypes.bfloat16) if f"{i}.{name}.bf16" in z.files else a
                    p, fl, vl = (int(v) for v in z[f"{i}.meta"])
                    out.append(Example(**fields, prompt_length=p, feature_layer=fl, visual_layer=vl))
        except (OSError, ValueError, KeyError, EOFError) as e:
            raise ValueError(f"{path}: cannot read an example shard ({type(e).__name__}: {e})") from e
    if count is not None and len(out) != count:
        raise ValueError(f"{index}: lists {count} examples; its shards hold {len(out)}")
    return out


# -------------------------------------------------------------------- batches
def stack(examples: Sequence[Example]) -> Batch:
    """Examples of one length and one layer pair -> Batch (device arrays; states keep their dtype)."""
    if not examples:
        raise ValueError("examples: expected at least one Example")
    lengths = {e.length for e in examples}
    layers = {(e.feature_layer, e.visual_layer) for e in examples}
    if len(lengths) != 1:
        raise ValueError(f"examples: expected one padded length per batch, got {sorted(lengths)}")
    if len(layers) != 1:
        raise ValueError(f"examples: expected one (feature_layer, visual_layer) pair per batch, got {sorted(layers)}")
    (fl, vl), = layers
    get = lambda name: jnp.asarray(np.stack([getattr(e, name) for e in examples]))
    return Batch(get("input_ids"), get("token_types"), get("positions"), get("valid"), get("states"), get("final"),
                 jnp.asarray([e.prompt_length for e in examples], jnp.int32), fl, vl)


def batches(examples: Sequence[Example], batch_size: int, *, seed: int = 0, drop_remainder: bool = False
            ) -> Iterator[Batch]:
    """One epoch of batches: examples grouped by padded length, shuffled within and across groups."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    rng = np.random.default_rng(seed)
    groups: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(e.length, []).append(i)
    chunks = []
    for idx in groups.values():
        idx = list(rng.permutation(idx))
        for s in range(0, len(idx), batch_size):
            part = idx[s:s + batch_size]
            if len(part) == batch_size or not drop_remainder:
                chunks.append(part)
    for c in rng.permutation(len(chunks)):
        yield stack([examples[i] for i in chunks[c]])
