"""Stretching RoPE past its training length L: the rules that change the frequencies theta_i.

Each rule maps the plain inverse frequencies theta_i = base^(-2i/D) (i = 0 .. D/2-1, wavelength
lambda_i = 2 pi / theta_i) to new ones, for a model trained at ``original_max_position_embeddings``
= L and run at up to s * L (``factor`` = s):

* ``linear``, position interpolation (Chen et al., 2023): theta_i / s for every i: positions are
  squeezed back into [0, L), and neighbouring tokens become s times closer in angle.
* ``ntk``, "NTK-aware" (bloc97, 2023): a new base, base * s^(D / (D - 2)). The highest frequency
  (i = 0) is untouched, the lowest (i = D/2 - 1) is divided by exactly s; in between, a geometric blend.
* ``dynamic`` NTK (emozilla, 2023; transformers' "dynamic"): the NTK base with s chosen from the current
  length n: base * (s n / L - (s - 1))^(D / (D - 2)), plain RoPE while n <= L.
* ``yarn`` (Peng et al., 2023), "NTK-by-parts" plus a temperature: with r_i = L / lambda_i the
  number of turns dimension i makes over the training length, dimensions with r_i > beta_fast (32)
  keep theta_i, those with r_i < beta_slow (1) get theta_i / s, and a linear ramp in i joins them;
  cos and sin are multiplied by 0.1 ln s + 1 (so the logits by its square).
* ``llama3`` (Meta's Llama 3.1 config: factor 8, low_freq_factor 1, high_freq_factor 4, L 8192):
  the same three bands cut by wavelength: lambda < L / high_freq_factor keeps theta, lambda >
  L / low_freq_factor gets theta / s, and in between a blend linear in L / lambda.

The parameters and defaults follow transformers' ``modeling_rope_utils`` (the tests compare every
rule with it).
"""
from __future__ import annotations

import math

import torch

SCALING_TYPES = ("linear", "ntk", "dynamic", "yarn", "llama3")


def _need(scaling: dict, key: str, rule: str):
    if key not in scaling:
        raise ValueError(f"rope scaling '{rule}' needs '{key}' (got keys {sorted(scaling)})")
    return scaling[key]


def _factor(scaling: dict, rule: str) -> float:
    s = _need(scaling, "factor", rule)
    if not (isinstance(s, (int, float)) and math.isfinite(s) and s >= 1):
        raise ValueError(f"rope scaling '{rule}': factor must be a finite number >= 1, got {s!r}")
    return float(s)


def yarn_correction_range(dim: int, base: float, original: int, beta_fast: float = 32.0,
                          beta_slow: float = 1.0) -> tuple[int, int]:
    """The pair indices (low, high) where YaRN's ramp starts and ends.

    Dimension i turns r_i = L theta_i / (2 pi) times over L tokens; solving r_i = beta for i gives
    i = D ln(L / (2 pi beta)) / (2 ln base). low from beta_fast (floored), high from beta_slow (ceiled).
    """
    def dim_for(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))
    return max(math.floor(dim_for(beta_fast)), 0), min(math.ceil(dim_for(beta_slow)), dim - 1)


def yarn_ramp(dim: int, base: float, original: int, beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """gamma_i in [0, 1] for each pair i: 0 keeps theta_i (fast dimensions), 1 uses theta_i / s."""
    low, high = yarn_correction_range(dim, base, original, beta_fast, beta_slow)
    high = high + 0.001 if high == low else high
    return ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's sqrt(1/t) = 0.1 ln s + 1, applied to cos and sin (1 for s <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def scale_frequencies(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict, *,
                      seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(scaled inv_freq, attention factor) for ``scaling = {"type": ..., "factor": s, ...}``."""
    if not isinstance(scaling, dict) or scaling.get("type") not in SCALING_TYPES:
        raise ValueError(f"rope scaling must be a dict with 'type' in {SCALING_TYPES}, got {scaling!r}")
    rule = scaling["type"]
    s = _factor(scaling, rule)
    ar = torch.arange(0, dim, 2, dtype=torch.float64) / dim                       # 2i / D
    if rule == "linear":
        return inv_freq / s, 1.0                                                  # theta_i / s
    if rule == "ntk":
        return (base * s ** (dim / (dim - 2))) ** (-ar), 1.0                      # base' = base s^(D/(D-2))
    original = int(_need(scaling, "original_max_position_embeddings", rule))
    if rule == "dynamic":
        n = max(seq_len or original, original)
        new_base = base * (s * n / original - (s - 1)) ** (dim / (dim - 2))
        return new_base ** (-ar), 1.0
    if rule == "yarn":
        gamma = yarn_ramp(dim, base, original, scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0))
        scaled = inv_freq * (1 - gamma) + (inv_freq / s) * gamma                  # NTK-by-parts blend
        return scaled, scaling.get("attention_factor") or yarn_attention_factor(s)
    # llama3: three bands by wavelength
    low_ff, high_ff = float(_need(scaling, "low_freq_factor", rule)), float(_need(scaling, "high_freq_factor", rule))
    wavelen = 2 * math.pi / inv_freq                                              # lambda_i
    smooth = ((original / wavelen - low_ff) / (high_ff - low_ff)).clamp(0, 1)    # 0 below, 1 above the band
    return inv_freq * smooth + (inv_freq / s) * (1 - smooth), 1.0
