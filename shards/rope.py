"""Rotary position embeddings: the inverse frequencies of a layer, and cos/sin at positions.

The arithmetic follows transformers' ``modeling_rope_utils`` step for step (same dtypes,
same order), so that a model's logits match theirs to float rounding.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from shards.config import ModelConfig


def default_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    """theta ** (-2i / hd) for i < hd/2, float32 [hd/2]."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def inv_freq(c: ModelConfig, sliding: bool = False, seq_len: int = 0,
             device: torch.device | str | None = None) -> Tensor:
    """The inverse frequencies [hd/2] of a layer of kind ``sliding`` for a forward whose
    last position is ``seq_len - 1`` (only dynamic scaling looks at it)."""
    hd = c.head_dim
    if sliding and c.rope_local_theta is not None:  # Gemma 3: local layers have their own, unscaled base
        return default_inv_freq(hd, c.rope_local_theta, device)
    s = c.rope_scaling
    if s is None:
        return default_inv_freq(hd, c.rope_theta, device)
    if s.kind == "linear":
        return default_inv_freq(hd, c.rope_theta, device) / s.factor
    if s.kind == "factors":
        factors = torch.tensor(s.freq_factors, dtype=torch.float32, device=device)
        return default_inv_freq(hd, c.rope_theta, device) / factors
    if s.kind == "dynamic":
        orig = cast(int, s.original_max_position)  # (dynamic scaling has it: RopeScaling checks)
        if seq_len <= orig:
            return default_inv_freq(hd, c.rope_theta, device)
        # As transformers does on growth: the sequence length is a tensor there, so float32.
        n = torch.tensor(seq_len, dtype=torch.int64, device=device)
        base = c.rope_theta * ((s.factor * n / orig) - (s.factor - 1)) ** (hd / (hd - 2))
        return 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    # llama3: low frequencies divided by factor, high ones kept, a smooth blend between.
    # (RopeScaling checks that llama3 scaling has all three.)
    orig = cast(int, s.original_max_position)
    low, high = cast(float, s.low_freq_factor), cast(float, s.high_freq_factor)
    freq = default_inv_freq(hd, c.rope_theta, device)
    low_wavelen = orig / low
    high_wavelen = orig / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(positions: Tensor, freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, hd] for the rotate-half rope at ``positions`` [T]."""
    freqs = positions.float()[:, None] * freq[None, :]  # [T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, hd] of the plain rope (no scaling) at ``positions`` [T]."""
    return cos_sin(positions, default_inv_freq(head_dim, theta, positions.device), dtype)


def layer_cos_sin(c: ModelConfig, sliding: bool, segments: list[tuple[int, int]], device: torch.device,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [N, hd] for the rows of ``segments`` (start, rows) one after another, for
    layers of kind ``sliding``. Dynamic scaling depends on each segment's own length."""
    positions = torch.cat([torch.arange(start, start + rows, device=device) for start, rows in segments])
    dynamic = c.rope_scaling is not None and c.rope_scaling.kind == "dynamic" and not (
        sliding and c.rope_local_theta is not None)
    if not dynamic:
        return cos_sin(positions, inv_freq(c, sliding, device=device), dtype)
    parts = [cos_sin(torch.arange(start, start + rows, device=device),
                     inv_freq(c, sliding, start + rows, device), dtype) for start, rows in segments]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
