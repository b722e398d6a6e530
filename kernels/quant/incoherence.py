"""QuIP's incoherence processing: rotate W (N, K) by random orthogonal matrices before quantizing it.

A weight matrix is mu-incoherent when no entry is large next to the matrix's root mean square
(Chee et al., 2023, Definition 1):

    max_ij |W_ij| <= mu ||W||_F / sqrt(N K),   i.e.   mu(W) = max |W_ij| / rms(W)          (1)

and a Hessian H = Q diag(lambda) Q^T is mu-incoherent when max_ij |Q_ij| <= mu / sqrt(K). A grid
quantizer's step is set by the largest entry, so a small mu means a fine grid for the bulk.
Multiplying by random orthogonal U (N, N) and V (K, K),

    W' = U W V^T,   x' = V x   =>   W' x' = U W x,   so   y = x W^T = (x' W'^T) U            (2)

spreads every outlier over a whole row and column: each entry of W' is a random-signed sum of many
entries of W, close to Gaussian, with mu(W') of order sqrt(2 log(N K)) whatever W was.

QuIP used Kronecker products of small random orthogonal matrices; QuIP# (Tseng et al., 2024) uses
the randomized Hadamard transform H diag(s) / sqrt(n), s a vector of random signs, which costs
O(n log n) instead of O(n^2) per vector. For n not a power of two, :func:`random_orthogonal` uses
the Kronecker product (randomized Hadamard of the largest power-of-two factor) x (random orthogonal
of the odd factor): the tiny GPT's 352 = 32 x 11. Orthogonal means ||W'||_F = ||W||_F: rotation
moves the energy, it never adds any.

Shapes: w (N, K); x (T, K); u (N, N); v (K, K); all float64.
"""
from __future__ import annotations

import math

import torch

from kernels.attention.flash3 import hadamard_matrix


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """H_n diag(s) / sqrt(n) with random signs s: orthogonal (n, n) float64, n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"random_hadamard: n must be a power of two, got {n}")
    s = torch.randint(0, 2, (n,), generator=_generator(seed)).double() * 2 - 1
    return hadamard_matrix(n) * s[None, :] / math.sqrt(n)


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal (n, n) float64: the randomized Hadamard for n = 2^a, else (randomized Hadamard of
    n's power-of-two part) kron (a Haar-random orthogonal of the odd part, from the QR of a Gaussian)."""
    if n < 1:
        raise ValueError(f"random_orthogonal: n must be positive, got {n}")
    p = n & -n                                                       # largest power of two dividing n
    h = random_hadamard(p, seed)
    if p == n:
        return h
    q, r = torch.linalg.qr(torch.randn(n // p, n // p, generator=_generator(seed + 1), dtype=torch.float64))
    return torch.kron(h, (q * torch.sign(torch.diagonal(r))[None, :]).contiguous())  # sign fix: Haar, not QR's convention


def rotations(w: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(U (N, N), V (K, K)) for a weight (N, K)."""
    if w.dim() != 2:
        raise ValueError(f"w must be a 2-D (N, K) weight, got shape {tuple(w.shape)}")
    return random_orthogonal(w.shape[0], seed), random_orthogonal(w.shape[1], seed + 2)


def rotate_weight(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """W' = U W V^T, equation (2), (N, K)."""
    if u.shape != (w.shape[0],) * 2 or v.shape != (w.shape[1],) * 2:
        raise ValueError(f"u must be (N, N) and v (K, K) for w {tuple(w.shape)}, got {tuple(u.shape)}, {tuple(v.shape)}")
    return u @ w.double() @ v.T


def unrotate_weight(w_rot: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """W = U^T W' V: the inverse of :func:`rotate_weight` (U, V orthogonal)."""
    return u.T @ w_rot.double() @ v


def rotated_matmul(x: torch.Tensor, w_rot: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """y = (x V^T) W'^T U, (T, N): equation (2), the layer computed from rotated weights and inputs."""
    return (x.double() @ v.T) @ w_rot.double().T @ u


def mu_weight(w: torch.Tensor) -> float:
    """mu of equation (1): max |W_ij| / rms(W)."""
    w = w.double()
    return float(w.abs().max() / w.pow(2).mean().sqrt())


def mu_hessian(H: torch.Tensor) -> float:
    """max_ij |Q_ij| sqrt(K) for the eigenvectors Q of the symmetric H (K, K): 1 is perfectly incoherent,
    sqrt(K) means an eigenvector sits on one input channel."""
    _, q = torch.linalg.eigh(H.double())
    return float(q.abs().max() * math.sqrt(H.shape[0]))


def rotate_hessian(H: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The Hessian of the rotated inputs x' = V x: V H V^T, (K, K)."""
    return v @ H.double() @ v.T


def planted_outliers(N: int, K: int, *, n_outliers: int = 8, scale: float = 30.0, seed: int = 0) -> torch.Tensor:
    """A Gaussian (N, K) float64 weight with ``n_outliers`` entries multiplied by ``scale``."""
    if n_outliers > N * K:
        raise ValueError(f"n_outliers={n_outliers} exceeds the {N * K} entries")
    g = _generator(seed)
    w = torch.randn(N, K, generator=g, dtype=torch.float64)
    idx = torch.randperm(N * K, generator=g)[:n_outliers]
    w.view(-1)[idx] *= scale
    return w
