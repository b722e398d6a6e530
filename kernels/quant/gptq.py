"""GPTQ: round a weight matrix one column at a time, pushing each column's rounding error onto the
columns not yet rounded, weighted by the inverse Hessian of the layer's output error.

For one row w (K,) of W and calibration inputs X (T, K), the output error of a change dw is
dw H dw^T / 2 with H = (2 / T) X^T X. Optimal Brain Surgeon (Hassibi and Stork, 1993) fixes one
coordinate i to its rounded value q_i and moves the others to the least-squares optimum:

    dw = -((w_i - q_i) / [H^-1]_ii) [H^-1]_{i,:}                          (1)

then removes i from the problem (H^-1 of the remaining coordinates). GPTQ (Frantar et al., 2023)
rounds the columns in a fixed order, the same for every row, so the sequence of shrinking inverses
is shared by all rows and is read off one Cholesky factor: with U upper triangular and
H^-1 = U^T U, row i of U divided by U_ii is [H_{i:, i:}^-1]_{i, i:} / sqrt([H_{i:,i:}^-1]_ii), so

    err_i = (w_i - q_i) / U_ii,    w_{i:} <- w_{i:} - err_i U_{i, i:}      (2)

is equation (1) for the remaining columns i..K-1. *Lazy batch updates*: columns are processed in
blocks of B; inside a block only the block's columns are updated, and the rest of W receives the
block's accumulated errors in one matrix product (W_{:, i2:} -= Err_{:, i1:i2} U_{i1:i2, i2:}), the
same result with far less memory traffic. *Act-order*: columns with larger H_ii (more input energy)
go first, while many columns remain to absorb their error. H is damped by 1% of its mean diagonal.

With groups, each group's scale and zero point are computed from the (already updated) weights when
the loop reaches the group's first column; with act-order they are computed up front from the
original W (the reference implementation's ``static_groups``), so the groups stay contiguous in k
and the result runs in the W4A16 kernel unchanged.

Reference: IST-DASLab/gptq, gptq.py at commit 9f2abd3 (``fasterquant``).
"""
from __future__ import annotations

import itertools

import torch

from kernels.model.gpt import GPT
from kernels.quant.calibration import hessian, linear_inputs, with_weights
from kernels.quant.intq import dequantize_ref, qrange, quant_params, quantize_ref

BLOCKS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")


def _prepare(w: torch.Tensor, H: torch.Tensor, damp: float, act_order: bool):
    """float64 copies with dead inputs (H_kk = 0) zeroed, optionally permuted by descending H_kk, damped."""
    if w.dim() != 2 or H.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"H must be (K, K) = ({w.shape[1]}, {w.shape[1]}) for W of shape {tuple(w.shape)}, "
                         f"got {tuple(H.shape)}")
    W, H = w.double().clone(), H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else torch.arange(W.shape[1])
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    return W, H, perm


def _col_params(w_cols: torch.Tensor, bits: int):
    """Asymmetric (s, z) per row of a group of columns (N, g) -> (N, 1) each."""
    return quant_params(w_cols, bits, symmetric=False, granularity="channel")


def _round(col: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> torch.Tensor:
    """A column (N,) rounded to its group's grid and dequantized."""
    return dequantize_ref(quantize_ref(col[:, None], s, z, bits, False), s, z)[:, 0]


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int | None = None, *,
                  block_size: int = 128, act_order: bool = False, damp: float = 0.01,
                  error_feedback: bool = True, return_codes: bool = False):
    """W (N, K) quantized by GPTQ against the Hessian H (K, K): the dequantized weights, (N, K) float64.

    ``return_codes=True`` also returns the codes (N, K) uint8 and the per-group scales and zero points
    (N, K / g) in k order, the W4A16 kernel's format. ``error_feedback=False`` is the broken variant
    that rounds each column without passing its error on (RTN).
    """
    N, K = w.shape
    if group_size is not None and K % group_size:
        raise ValueError(f"group_size={group_size} does not divide K={K}")
    qrange(bits, False)
    W, H, perm = _prepare(w, H, damp, act_order)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)   # H^-1 = U^T U
    g = group_size or K
    static = None
    if act_order:                                              # groups fixed from the original W, in k order
        w0 = w.double().clone()
        w0[:, torch.diag(H) == 0] = 0.0
        static = [_col_params(w0[:, j: j + g], bits) for j in range(0, K, g)]
    Q = torch.zeros_like(W)
    codes = torch.zeros(N, K, dtype=torch.uint8)
    params = static or [None] * (K // g)
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1, Err1 = W[:, i1:i2].clone(), torch.zeros(N, i2 - i1, dtype=W.dtype)
        for i in range(i2 - i1):
            j = i1 + i                                         # position in the (permuted) column order
            if static is not None:
                s, z = static[int(perm[j]) // g]
            elif j % g == 0:                                   # the group's current values, pending updates included
                rest = W[:, i2:] - Err1[:, :i] @ U[i1:j, i2:] if error_feedback else W[:, i2:]
                s, z = _col_params(torch.cat([W1[:, i:], rest], 1)[:, :g], bits)
                params[j // g] = (s, z)
            codes[:, j] = quantize_ref(W1[:, i:i + 1], s, z, bits, False)[:, 0]
            q = dequantize_ref(codes[:, j:j + 1], s, z)[:, 0]
            Q[:, j] = q
            err = (W1[:, i] - q) / U[j, j]                     # equation (2)
            if error_feedback:
                W1[:, i:] -= err[:, None] * U[j, i1 + i: i2][None, :]
            Err1[:, i] = err
        if error_feedback:
            W[:, i2:] -= Err1 @ U[i1:i2, i2:]                  # lazy batch update of the columns after the block
    inv = torch.argsort(perm)
    if not return_codes:
        return Q[:, inv]
    return Q[:, inv], codes[:, inv], torch.cat([p[0] for p in params], 1), torch.cat([p[1] for p in params], 1)


def obs_ref(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int | None = None, *,
            act_order: bool = False, damp: float = 0.01) -> torch.Tensor:
    """Equation (1) applied column by column with the inverse of the remaining Hessian computed afresh at
    every step (no Cholesky, no blocks): the brute-force OBS that :func:`gptq_quantize` must reproduce."""
    N, K = w.shape
    W, H, perm = _prepare(w, H, damp, act_order)
    g = group_size or K
    static = None
    if act_order:
        w0 = w.double().clone()
        w0[:, torch.diag(H) == 0] = 0.0
        static = [_col_params(w0[:, j: j + g], bits) for j in range(0, K, g)]
    Q = torch.zeros_like(W)
    for j in range(K):
        if static is not None:
            s, z = static[int(perm[j]) // g]
        elif j % g == 0:
            s, z = _col_params(W[:, j: j + g], bits)
        q = _round(W[:, j], s, z, bits)
        Q[:, j] = q
        Hinv = torch.linalg.inv(H[j:, j:])                     # inverse Hessian of the columns not yet fixed
        W[:, j:] -= ((W[:, j] - q) / Hinv[0, 0])[:, None] * Hinv[0][None, :]   # equation (1)
    return Q[:, torch.argsort(perm)]


def layer_error(w: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Per row: (w - w_hat) H (w - w_hat)^T / 2, the output error the methods minimise, (N,)."""
    d = (w - w_hat).double()
    return 0.5 * ((d @ H.double()) * d).sum(1)


def best_on_grid(w: torch.Tensor, H: torch.Tensor, bits: int) -> torch.Tensor:
    """The exact minimiser of :func:`layer_error` per row over every code vector of the per-row RTN grid
    (2^(bits K) candidates: tiny K only), dequantized (N, K)."""
    N, K = w.shape
    if 2 ** (bits * K) > 70_000:
        raise ValueError(f"enumeration of 2^{bits * K} code vectors is too large; use K * bits <= 16")
    s, z = _col_params(w.double(), bits)
    codes = torch.tensor(list(itertools.product(range(2 ** bits), repeat=K)), dtype=torch.float64)  # (C, K)
    out = torch.empty(N, K, dtype=torch.float64)
    for n in range(N):
        cand = s[n] * (codes - z[n])                                                  # (C, K)
        d = w[n].double()[None, :] - cand
        out[n] = cand[((d @ H.double()) * d).sum(1).argmin()]
    return out


@torch.no_grad()
def gptq_model(model: GPT, tokens: torch.Tensor, bits: int, group_size: int | None, *,
               act_order: bool = False) -> GPT:
    """A copy of ``model`` quantized block by block: each block's Hessians come from the inputs it sees
    when the blocks before it are already quantized (as the reference implementation runs)."""
    out = model
    for i in range(len(model.blocks)):
        names = [f"blocks.{i}.{n}" for n in BLOCKS]
        inputs = linear_inputs(out, tokens, names)
        new = {name: gptq_quantize(model.get_submodule(name).weight, hessian(inputs[name]), bits, group_size,
                                   act_order=act_order) for name in names}
        out = with_weights(out, new)
    return out
