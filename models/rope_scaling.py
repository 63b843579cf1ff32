"""The 1-D rotary frequencies of the text LMs, as transformers computes them (``modeling_rope_utils``):
default, Llama 3.1 ("llama3") and YaRN ("yarn") scaling. Computed on the host in float32, once per config."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

ROPE_TYPES = ("default", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """1-D rotary embedding of a text decoder (transformers' ``rope_parameters``).

    ``rope_type`` "default": frequencies ``theta ** (-2i / D)``. "llama3" (Llama 3.1): wavelengths above
    ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, below ``... /
    high_freq_factor`` kept, a smooth interpolation between. "yarn" (Qwen3 beyond 32k): frequencies
    blended between ``1 / factor`` interpolation and extrapolation over a ramp of dimensions set by
    ``beta_fast`` / ``beta_slow`` (``truncate``: whole dimensions), and the tables scaled by
    ``attention_scaling`` (``attention_factor``, or derived from ``factor`` / ``mscale`` /
    ``mscale_all_dim``).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type: expected one of {ROPE_TYPES}, got {self.rope_type!r}")
        if not self.theta > 0:
            raise ValueError(f"rope theta: expected > 0, got {self.theta}")
        if self.rope_type != "default" and not (self.factor > 0 and self.original_max_position_embeddings > 0):
            raise ValueError(f"{self.rope_type} rope: expected factor > 0 and original_max_position_embeddings > 0; "
                             f"got {self.factor} / {self.original_max_position_embeddings}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"llama3 rope: expected high_freq_factor > low_freq_factor > 0; got "
                             f"{self.high_freq_factor} / {self.low_freq_factor}")

    @property
    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos / sin by (1 except for YaRN)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return get_mscale(self.factor)

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies float32 [head_dim // 2], computed in float32 as transformers does."""
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        pos_freqs = np.power(np.float32(self.theta), exponent).astype(np.float32)
        inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.rope_type == "llama3":
            return self._llama3(inv)
        if self.rope_type == "yarn":
            return self._yarn(pos_freqs, head_dim)
        return inv

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        factor, low, high = np.float32(self.factor), np.float32(self.low_freq_factor), np.float32(self.high_freq_factor)
        old = np.float32(self.original_max_position_embeddings)
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def _yarn(self, pos_freqs: np.ndarray, dim: int) -> np.ndarray:
        def correction_dim(rotations):
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolation = (np.float32(1) - ramp).astype(np.float32)
        inv_extra = np.float32(1.0) / pos_freqs
        inv_inter = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)
        return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)
