"""QuIP and QuIP# on one layer: rotate (incoherence), then round with Hessian feedback (Block LDLQ).

QuIP (Chee et al., 2023) rotates W (N, K) and its Hessian H (K, K) to W' = U W V^T, H' = V H V^T
(:mod:`kernels.quant.incoherence`), rounds W' with LDLQ and rotates back. QuIP# (Tseng et al., 2024)
keeps the rotation (randomized Hadamard) and rounds 8 columns at a time to its E8P lattice codebook
(:func:`kernels.quant.e8.nearest_e8p`), with the block version of the same feedback:

    for each block c of columns, left to right:   Q_c = round(W_c)
                                                  W_r -= (W_c - Q_c) U_cc^-1 U_cr              (1)

with H^-1 = U^T U (U upper triangular) and r the columns after c (:func:`block_ldlq`). With blocks of
one column and a scalar grid, (1) is GPTQ's update (LDLQ); with blocks of 8 and E8P, QuIP#'s Block
LDLQ. Both scale W' by one number per matrix, d = rms(W') / TARGET_RMS: the rotated weights are close
to Gaussian, so the target is the rms at which plain rounding of a unit Gaussian has the least squared
error (:func:`gaussian_mse`; in steps of 0.01: 1.00 for the scalar grid, 1.03 for E8P, the value
QuIP#'s E8P12 codebook uses as ``opt_scale``). QuIP#'s fine-tuning is not done.

**Bits per weight** (:func:`bits_per_weight`): 2 bits of codes (E8P: 16 bits per 8 weights; the scalar
grid: 4 levels), one fp16 scale per matrix, and the N + K random signs of the two Hadamard rotations.
Fixed tables are not counted: E8P's 256 x 8 absolute values are the same for every layer of every model,
and the small random orthogonal factor of a non-power-of-two size (the tiny GPT's 352 = 32 x 11) is
regenerated from its seed (QuIP# stores fixed Hadamard matrices of such sizes instead).

Shapes: w (N, K); H (K, K); all float64.
"""
from __future__ import annotations

from typing import Callable

import torch

from kernels.quant import e8
from kernels.quant import incoherence as inc

Rounder = Callable[[torch.Tensor], torch.Tensor]    # (N, b) -> (N, b): the nearest code points


def scalar_2bit(x: torch.Tensor) -> torch.Tensor:
    """The 4-level symmetric grid {-3/2, -1/2, 1/2, 3/2}: nearest level per entry."""
    return (torch.floor(x) + 0.5).clamp(-1.5, 1.5)


def e8p_2bit(x: torch.Tensor) -> torch.Tensor:
    """E8P: each row of 8 entries to the nearest of 2^16 points (16 bits per 8 weights)."""
    return e8.nearest_e8p(x)


ROUNDERS = {"scalar": (scalar_2bit, 1), "e8p": (e8p_2bit, 8)}     # name: (rounder, columns per block)


TARGET_RMS = {"scalar": 1.00, "e8p": 1.03}     # rms of W' / d that minimises gaussian_mse, steps of 0.01


def gaussian_mse(rounder: str, target_rms: float, *, n: int = 20_000, seed: int = 0) -> float:
    """Mean squared error per coordinate of plain rounding of a unit Gaussian (n, 8), scaled to rms
    ``target_rms`` before rounding and back after."""
    fn, block = ROUNDERS[rounder]
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return float((x - fn((x * target_rms).reshape(-1, block)).reshape(n, 8) / target_rms).pow(2).mean())


def block_ldlq(w: torch.Tensor, H: torch.Tensor, rounder: Rounder, block: int, *, damp: float = 0.01,
               feedback: float = 1.0) -> torch.Tensor:
    """Equation (1): W (N, K) rounded ``block`` columns at a time with the error of each block passed
    on to the columns after it through H^-1 = U^T U; H is damped by ``damp`` x its mean diagonal.
    ``feedback=-1`` (error pushed the wrong way) is the broken variant the checks must catch."""
    N, K = w.shape
    if K % block or H.shape != (K, K):
        raise ValueError(f"block={block} must divide K={K} and H must be (K, K), got {tuple(H.shape)}")
    W, H = w.double().clone(), H.double().clone()
    H += damp * torch.diag(H).mean() * torch.eye(K, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)   # H^-1 = U^T U
    Q = torch.zeros_like(W)
    for c0 in range(0, K, block):
        c, r = slice(c0, c0 + block), slice(c0 + block, K)
        Q[:, c] = rounder(W[:, c])
        err = torch.linalg.solve_triangular(U[c, c], W[:, c] - Q[:, c], upper=True, left=False)   # (W_c - Q_c) U_cc^-1
        W[:, r] -= feedback * err @ U[c, r]
    return Q


def quantize(w: torch.Tensor, H: torch.Tensor, rounder: str = "e8p", *, ldlq: bool = True, seed: int = 0,
             feedback: float = 1.0) -> torch.Tensor:
    """Rotate, scale, round (Block LDLQ or plain nearest), unscale, rotate back: W_hat (N, K) float64."""
    if rounder not in ROUNDERS:
        raise ValueError(f"rounder must be one of {sorted(ROUNDERS)}, got {rounder!r}")
    fn, block = ROUNDERS[rounder]
    u, v = inc.rotations(w, seed)
    w_rot, h_rot = inc.rotate_weight(w, u, v), inc.rotate_hessian(H, v)
    d = float(w_rot.pow(2).mean().sqrt()) / TARGET_RMS[rounder]                        # one step per matrix
    if ldlq:
        q = block_ldlq(w_rot / d, h_rot, fn, block, feedback=feedback)
    else:
        q = fn((w_rot / d).reshape(-1, block)).reshape(w.shape)
    return inc.unrotate_weight(q * d, u, v)


def bits_per_weight(N: int, K: int) -> float:
    """2 bits of codes + one fp16 scale + N + K sign bits, per weight of an (N, K) matrix."""
    return 2 + (16 + N + K) / (N * K)
