"""QuIP#'s lattice codebook: round 8 weights at once to the nearest point of the E8 lattice.

    D8 = {z in Z^8 : sum_i z_i even}          E8 = D8 u (D8 + 1/2)                          (1)

E8 is the densest packing of spheres in 8 dimensions; as a quantizer of Gaussian-like vectors (what
incoherence processing makes of the weights) it has a lower mean squared error per bit than
rounding each coordinate to Z, because its Voronoi cell is rounder than a cube.

**Nearest point** (Conway and Sloane, "Fast quantizing and decoding algorithms", 1982): for D8,
round every coordinate; if the rounded sum is odd, re-round the coordinate with the largest rounding
error the other way. For E8, decode x in D8 and x - 1/2 in D8 (then add 1/2 back), and keep the
closer of the two (:func:`nearest_e8`). :func:`nearest_e8_brute` checks it by enumeration.

**Fitting a codebook in a cache.** 8 weights at 2 bits per weight are 16 bits: a codebook of
2^16 vectors, 2^16 x 8 fp16 = 1 MiB, too big for the shared memory of one SM. QuIP#'s E8P codebook
(Tseng et al., 2024) keeps 256 vectors of absolute values (the 227 points of D8 + 1/2 with norm^2
<= 10, plus 29 of norm^2 12) and builds the rest in registers: 7 stored sign bits (the 8th sign is
fixed by the parity that keeps the point in the lattice coset) and one bit for a shift of +-1/4;
8 + 7 + 1 = 16 bits per 8 weights, from a 256 x 8 table (4 KiB in fp16). :func:`e8p_abs_table` builds
that table (QuIP#'s 29 norm^2-12 vectors are a hand-picked subset of the 56 with five 3/2 and three 1/2,
Cornell-RelaxML/quip-sharp@79b752fc65a350409aef1e88800862663b843020:lib/codebook/latticee8_padded12.py;
here the first 29 in lexicographic order, a stated difference) and :func:`nearest_e8p` rounds to the
2^16 points without listing them: for each shift +-1/4 and each of the 256 absolute vectors a, the
best signs are those of y = x -+ 1/4, and if they give the wrong parity (sum not even, so not in
D8 + 1/2) the cheapest fix flips the coordinate with the smallest |y_i| a_i, which costs 4 |y_i| a_i.
:func:`e8p_codebook` lists the 2^16 points for the brute-force check.

:func:`nearest_e8` decodes to the whole lattice (unbounded, so not a fixed-rate code) and measures
the error of E8 against per-coordinate rounding (Z^8) at the same density: both lattices have one
point per unit volume (D8 has index 2 in Z^8 and E8 has D8 with index 2), and E8's mean squared
error per coordinate on uniform data, 0.0717 (Conway and Sloane, "Voronoi regions of lattices", 1982;
929/12960 exactly), is 0.86 of Z's 1/12.

Shapes: x (..., 8) float64; results (..., 8) float64.
"""
from __future__ import annotations

import functools
import itertools

import torch


def _check(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] != 8:
        raise ValueError(f"E8 vectors have 8 coordinates: the last dimension must be 8, got shape {tuple(x.shape)}")
    return x.double()


def nearest_d8(x: torch.Tensor) -> torch.Tensor:
    """The nearest point of D8 (equation 1) to each row x (..., 8)."""
    x = _check(x)
    f = torch.round(x)
    odd = (f.sum(-1) % 2) != 0                                          # (...,) the rounded point is not in D8
    err = x - f                                                         # in [-1/2, 1/2]
    worst = err.abs().argmax(-1, keepdim=True)                          # the coordinate cheapest to re-round
    step = torch.where(torch.gather(err, -1, worst) >= 0, 1.0, -1.0).double()   # to the other neighbour of x
    fixed = f.scatter_add(-1, worst, step)
    return torch.where(odd[..., None], fixed, f)


def nearest_e8(x: torch.Tensor) -> torch.Tensor:
    """The nearest point of E8 = D8 u (D8 + 1/2) to each row x (..., 8)."""
    x = _check(x)
    a = nearest_d8(x)
    b = nearest_d8(x - 0.5) + 0.5
    closer_a = ((x - a) ** 2).sum(-1) <= ((x - b) ** 2).sum(-1)
    return torch.where(closer_a[..., None], a, b)


def e8_points(radius: float = 1.5) -> torch.Tensor:
    """Every E8 point with all coordinates in [-radius, radius], (P, 8) float64 (enumeration: small radius)."""
    if radius > 2.5:
        raise ValueError(f"radius={radius}: enumeration beyond 2.5 is too large")
    r = int(radius)
    ints = torch.tensor(list(itertools.product(range(-r, r + 1), repeat=8)), dtype=torch.float64)
    ints = ints[ints.sum(-1) % 2 == 0]
    h = [k + 0.5 for k in range(-r - 1, r + 1) if abs(k + 0.5) <= radius]
    halves = torch.tensor(list(itertools.product(h, repeat=8)), dtype=torch.float64)
    halves = halves[(halves - 0.5).sum(-1) % 2 == 0]
    return torch.cat([ints, halves])


def nearest_brute(x: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """The nearest of ``points`` (P, 8) to each row of x (T, 8), by computing every distance."""
    x = _check(x)
    d = torch.cdist(x, points)                                          # (T, P)
    return points[d.argmin(-1)]


def nearest_e8_brute(x: torch.Tensor) -> torch.Tensor:
    """The E8 point nearest to x (T, 8) with every |x_i| <= 1/2, by enumeration. E8's covering radius is 1
    (with the min-norm sqrt(2) scaling of equation 1), so the nearest point lies within 1 of x in every
    coordinate, inside :func:`e8_points` (1.5): the enumeration is exhaustive."""
    if x.abs().max() > 0.5:
        raise ValueError("nearest_e8_brute enumerates points with coordinates in [-1.5, 1.5]: |x_i| must be <= 1/2")
    return nearest_brute(x, e8_points(1.5))



@functools.cache
def _e8p_abs_table() -> torch.Tensor:
    return e8p_abs_table()


def e8p_abs_table() -> torch.Tensor:
    """E8P's 256 absolute vectors (256, 8) float64: the 227 distinct |x| of the points x of D8 + 1/2 with
    ||x||^2 <= 10, then 29 of the 56 arrangements of five 3/2 and three 1/2 (||x||^2 = 12)."""
    # every |x| in {1/2, 3/2, 5/2}^8 (7/2 alone has norm^2 > 10) with norm^2 <= 10 is |x| of a point of
    # D8 + 1/2: one sign flip changes the coordinate sum by an odd number, so some signs make it even
    absval = torch.tensor(list(itertools.product([0.5, 1.5, 2.5], repeat=8)), dtype=torch.float64)   # (3^8, 8)
    small = absval[absval.pow(2).sum(-1) <= 10]                                   # (227, 8)
    twelve = [[1.5 if i not in pos else 0.5 for i in range(8)] for pos in itertools.combinations(range(8), 3)]
    return torch.cat([small, torch.tensor(twelve[:29], dtype=torch.float64)])


def e8p_codebook(table: torch.Tensor | None = None) -> torch.Tensor:
    """The 2^16 points (65536, 8) of E8P: s * a + t for a in the table, signs s with s * a in D8 + 1/2
    (an even coordinate sum: 128 of the 256 sign patterns), t = +-1/4."""
    table = e8p_abs_table() if table is None else table
    signs = torch.tensor(list(itertools.product([1.0, -1.0], repeat=8)), dtype=torch.float64)   # (256, 8)
    pts = (signs[None, :, :] * table[:, None, :]).reshape(-1, 8)                  # (256 * 256, 8)
    pts = pts[pts.sum(-1) % 2 == 0]                                               # (32768, 8) in D8 + 1/2
    return torch.cat([pts + 0.25, pts - 0.25])


def nearest_e8p(x: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """The nearest E8P point to each row of x (..., 8), by the sign/parity rule of the module docstring."""
    x = _check(x)
    table = _e8p_abs_table() if table is None else table                          # (256, 8)
    shape, x = x.shape, x.reshape(-1, 8)
    best, best_d = None, None
    for t in (0.25, -0.25):
        y = x - t                                                                 # (P, 8)
        s = torch.where(y < 0, -1.0, 1.0).double()
        d = y.pow(2).sum(-1, keepdim=True) - 2 * y.abs() @ table.T + table.pow(2).sum(-1)   # (P, 256) ||y| - a|^2
        odd = (s @ table.T) % 2 != 0                                              # (P, 256) sum(s * a) odd
        flip_cost = torch.full_like(d, float("inf"))                              # (P, 256) min_i |y_i| a_i
        flip_at = torch.zeros(d.shape, dtype=torch.int64)
        for i in range(8):
            c = y[:, i].abs()[:, None] * table[None, :, i]
            flip_at = torch.where(c < flip_cost, i, flip_at)
            flip_cost = torch.minimum(c, flip_cost)
        d = d + torch.where(odd, 4 * flip_cost, 0.0)
        dmin, a = d.min(-1)                                                       # (P,)
        signs = s.clone()
        rows = odd[torch.arange(len(a)), a]
        signs[rows, flip_at[torch.arange(len(a)), a][rows]] *= -1
        pt = signs * table[a] + t
        if best is None:
            best, best_d = pt, dmin
        else:
            closer = dmin < best_d
            best = torch.where(closer[:, None], pt, best)
            best_d = torch.where(closer, dmin, best_d)
    return best.reshape(shape)
