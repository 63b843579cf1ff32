"""Sampling settings shared by plain and speculative decoding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (argmax). Otherwise tokens are drawn from softmax(logits / temperature)
    restricted to the ``top_k`` most likely tokens and / or the smallest set holding ``top_p`` of the
    mass (None = no restriction). ``seed`` seeds the PRNG of a generate call."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"Sampling.temperature: expected a float >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"Sampling.top_k: expected None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p: expected None or a float in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_log_probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """logits float [..., V] -> log-probabilities of the distribution tokens are drawn from (float32;
    -inf outside the top-k / top-p set). Not used for greedy decoding."""
    x = logits.astype(jnp.float32) / max(float(sampling.temperature), 1e-6)
    if sampling.top_k is not None and sampling.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, -jnp.inf)
    if sampling.top_p is not None and sampling.top_p < 1:
        srt = jnp.sort(x, axis=-1)[..., ::-1]
        p = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass strictly above each sorted token
        cut = jnp.min(jnp.where(before < sampling.top_p, srt, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= cut, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def sample(key: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row: logits [..., V] -> int32 [...]."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, target_log_probs(logits, sampling), axis=-1).astype(jnp.int32)
