"""AQLM's additive codebooks, learned on a layer, and a Triton matmul that decodes them in the kernel.

W (N, K) is cut into groups of g consecutive inputs; row n's group j is a per-row scale times the
sum of M codewords, one from each codebook C_m (2^B, g) (Egiazarian et al., 2024):

    W[n, j g : (j + 1) g] ~ s_n sum_{m < M} C_m[b_{n j m}]                                  (1)

so the weight costs M B / g bits for the codes plus the codebooks, M 2^B g fp16 numbers shared by
the whole layer, and one fp16 scale per row (:func:`bits_per_weight`). AQLM's headline 2-bit format
is g = 8, M = 1, B = 16: a 2^16 x 8 fp16 codebook per layer, 1 MiB = 8.4 Mbit, which is not negligible
at 7B: 0.50 bit per weight on a 4096 x 4096 projection and 0.29 bit per weight over a Llama-2-7B
decoder layer's seven projections (:func:`codebook_bits_per_weight`, :data:`LLAMA2_7B_LAYER`), so
"1x16" stores about 2.3 bits per weight, where g = 8, M = 2, B = 8 (two 256-entry codebooks, 8 KiB)
stores 2.0.

**Learning** (:func:`learn`) alternates, as AQLM does: *codes* with the codebooks fixed, *codebooks*
with the codes fixed. Codes: greedy residual (codebook m picks the codeword nearest to what
codebooks 0..m-1 left), then rounds of coordinate descent (each codebook re-picks against the others'
sum); AQLM uses a beam search over the same moves, which this module does not do. Codebooks: with the
codes fixed, equation (1) is linear in the codewords, so the best codebooks are a least-squares solve
with the (M 2^B, M 2^B) co-occurrence matrix of the codes (:func:`update_codebooks`). Each step
cannot increase the error. The objective here is the Frobenius error ||W / s - W_hat / s||^2;
AQLM minimises the layer's output error ||(W - W_hat) X^T||^2 and fine-tunes the codebooks with Adam
(a difference stated, not reproduced).

With ``hessian=H`` :func:`learn` minimises the output error instead, sum_n (w_n - w_hat_n) H
(w_n - w_hat_n)^T = ||(W - W_hat) X^T||^2 for H = X^T X, AQLM's objective: the code step becomes
coordinate descent over the groups against H (:func:`assign_codes_hessian`), the codebook step a
least-squares solve weighted by H (:func:`update_codebooks_hessian`); both still cannot increase it.

**The kernel** (:func:`aqlm_matmul`) computes y = x W^T with W rebuilt tile by tile from the codes:
for each (BLOCK_N, BLOCK_K) tile it loads the codes, gathers the codewords from the codebooks (fp16,
M 2^B g of them: 8 KiB at M = 2, B = 8, g = 8, which stays in L1/L2; 1 MiB at M = 1, B = 16, which
does not fit an SM's shared memory and is read through L2), sums them, and feeds an fp16 ``tl.dot``;
the row scales multiply the fp32 accumulator at the end. Codes are uint8 for B <= 8 and int16 for
9 <= B <= 16 (AQLM's 1x16 format): the kernel masks the sign-extended int16 to its low 16 bits, so code
40000 stored as -25536 still reads codeword 40000. Shapes: x (M_tok, K) fp16 or fp32; codes
(N, K / g, M) uint8 or int16; codebooks (M, 2^B, g) fp16/fp32; scales (N,) fp16/fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.quant.w8a8 import Tile   # (BLOCK_M, BLOCK_N, BLOCK_K), warps, stages: the quantized GEMMs' launch


class Quantized(NamedTuple):
    """One layer in the format of equation (1)."""

    codes: torch.Tensor       # (N, K / g, M) int64
    codebooks: torch.Tensor   # (M, 2^B, g) float64
    scales: torch.Tensor      # (N,) float64


def bits_per_weight(N: int, K: int, g: int, M: int, B: int) -> float:
    """Codes (M B / g per weight) plus the fp16 codebooks (M 2^B g x 16 bits) and fp16 row scales
    (16 N bits) amortised over the N K weights of one layer."""
    return M * B / g + (M * 2 ** B * g * 16 + 16 * N) / (N * K)


# Llama-2-7B's decoder layer: (N, K) of q, k, v, o (4096 x 4096) and gate, up (11008 x 4096), down (4096 x 11008)
LLAMA2_7B_LAYER = ((4096, 4096),) * 4 + ((11008, 4096),) * 2 + ((4096, 11008),)


def codebook_bits_per_weight(shapes, g: int, M: int, B: int) -> float:
    """The fp16 codebooks alone, one set of M (2^B, g) per matrix, per weight of the matrices ``shapes``
    [(N, K), ...]: M 2^B g 16 bits per matrix over sum N K weights."""
    return len(shapes) * M * 2 ** B * g * 16 / sum(N * K for N, K in shapes)


def dequantize(q: Quantized) -> torch.Tensor:
    """Equation (1): W_hat (N, K) float64."""
    N, G, M = q.codes.shape
    g = q.codebooks.shape[2]
    groups = sum(q.codebooks[m].double()[q.codes[:, :, m]] for m in range(M))     # (N, G, g)
    return groups.reshape(N, G * g) * q.scales.double()[:, None]


def _groups(w: torch.Tensor, g: int, scales: torch.Tensor) -> torch.Tensor:
    """W / s cut into groups: (N G, g)."""
    N, K = w.shape
    return (w.double() / scales[:, None]).reshape(N * (K // g), g)


def assign_codes(v: torch.Tensor, codebooks: torch.Tensor, codes: torch.Tensor | None = None, *,
                 rounds: int = 1) -> torch.Tensor:
    """Codes (P, M) for the vectors v (P, g): greedy residual when ``codes`` is None, then ``rounds``
    of coordinate descent, each codebook re-picking its codeword against the sum of the others'."""
    M = codebooks.shape[0]
    if codes is None:
        codes = torch.zeros(v.shape[0], M, dtype=torch.int64)
        residual = v.clone()
        for m in range(M):
            codes[:, m] = torch.cdist(residual, codebooks[m]).argmin(1)
            residual -= codebooks[m][codes[:, m]]
    for _ in range(rounds):
        for m in range(M):
            others = sum(codebooks[j][codes[:, j]] for j in range(M) if j != m)
            codes[:, m] = torch.cdist(v - others, codebooks[m]).argmin(1)
    return codes


def update_codebooks(v: torch.Tensor, codes: torch.Tensor, n_codes: int, *, ridge: float = 1e-9) -> torch.Tensor:
    """The least-squares codebooks (M, 2^B, g) for fixed codes (P, M): with A (P, M 2^B) the one-hot
    matrix of the codes, minimise ||v - A C||^2, i.e. (A^T A) C = A^T v (a small ridge keeps unused
    codewords at zero instead of making the system singular)."""
    P, M = codes.shape
    flat = codes + torch.arange(M)[None, :] * n_codes                  # (P, M) column of A per codebook
    ata = torch.zeros(M * n_codes, M * n_codes, dtype=torch.float64)
    for a in range(M):
        for b in range(M):
            ata.index_put_((flat[:, a], flat[:, b]), torch.ones(P, dtype=torch.float64), accumulate=True)
    atv = torch.zeros(M * n_codes, v.shape[1], dtype=torch.float64)
    for a in range(M):
        atv.index_add_(0, flat[:, a], v)
    c = torch.linalg.solve(ata + ridge * torch.eye(M * n_codes, dtype=torch.float64), atv)
    return c.reshape(M, n_codes, v.shape[1])


def learn(w: torch.Tensor, g: int, M: int, B: int, *, iters: int = 4, seed: int = 0,
          progress: bool = False) -> tuple[Quantized, list[float]]:
    """Learn codes and codebooks for w (N, K): codebook m starts as 2^B groups sampled from what
    codebooks 0..m-1 leave, then ``iters`` rounds of (codebooks by least squares, codes by coordinate
    descent). Returns the result and the Frobenius error ||W/s - W_hat/s||^2 after each round
    (non-increasing). ``progress`` shows a tqdm bar over the rounds."""
    if w.dim() != 2 or w.shape[1] % g:
        raise ValueError(f"group size g={g} does not divide K={w.shape[1] if w.dim() == 2 else '?'} of w {tuple(w.shape)}")
    if not (1 <= B <= 8) or M < 1:
        raise ValueError(f"B must be in 1..8 (uint8 codes) and M >= 1, got B={B}, M={M}")
    N, K = w.shape
    scales = w.double().pow(2).mean(1).sqrt().clamp_min(1e-12)          # (N,) row rms
    v = _groups(w, g, scales)                                           # (P, g)
    n_codes = 2 ** B
    gen = torch.Generator().manual_seed(seed)
    books, residual = [], v.clone()
    for _ in range(M):                                                  # residual-sampled initial codewords
        book = residual[torch.randperm(v.shape[0], generator=gen)[:n_codes]].clone()
        books.append(book)
        residual -= book[torch.cdist(residual, book).argmin(1)]
    codebooks = torch.stack(books)
    codes = assign_codes(v, codebooks, rounds=0)
    errors = []
    steps = range(iters)
    if progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc=f"AQLM g={g} M={M} B={B}", leave=False)
    for _ in steps:
        codebooks = update_codebooks(v, codes, n_codes)
        codes = assign_codes(v, codebooks, codes, rounds=1)
        errors.append(float(((v - sum(codebooks[m][codes[:, m]] for m in range(M))) ** 2).sum()))
    return Quantized(codes.reshape(N, K // g, M), codebooks, scales), errors


def hessian_error(w: torch.Tensor, q: Quantized, H: torch.Tensor) -> float:
    """The output error sum_n (w_n - w_hat_n) H (w_n - w_hat_n)^T of equation (1)'s W_hat."""
    d = w.double() - dequantize(q)
    return float(((d @ H.double()) * d).sum())


def assign_codes_hessian(v: torch.Tensor, codebooks: torch.Tensor, codes: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """One sweep of coordinate descent on the codes (N, G, M) of v = W / s (N, K) against H (K, K):
    for group j and codebook m in turn, every row re-picks the codeword c minimising its exact error
    with the others fixed, (r + c_old - c) H (r + c_old - c)^T = c^T H_jj c - 2 c . ((r + c_old) H)_j + const,
    r = v - v_hat the current residual (the row scale s_n^2 multiplies the whole row: no effect on argmin)."""
    N, G, M = codes.shape
    g = codebooks.shape[2]
    codes = codes.clone()
    r = v - sum(codebooks[m][codes[:, :, m]] for m in range(M)).reshape(N, G * g)      # (N, K)
    for j in range(G):
        cols = slice(j * g, (j + 1) * g)
        Hjj = H[cols, cols]                                                              # (g, g)
        for m in range(M):
            r[:, cols] += codebooks[m][codes[:, j, m]]                                   # remove codeword (j, m)
            lin = r @ H[:, cols]                                                         # (N, g) ((r + c_old) H)_j
            quad = ((codebooks[m] @ Hjj) * codebooks[m]).sum(1)                          # (2^B,) c^T H_jj c
            codes[:, j, m] = (quad[None, :] - 2 * lin @ codebooks[m].T).argmin(1)
            r[:, cols] -= codebooks[m][codes[:, j, m]]
    return codes


def update_codebooks_hessian(v: torch.Tensor, codes: torch.Tensor, n_codes: int, H: torch.Tensor,
                             row_weight: torch.Tensor, *, ridge: float = 1e-9) -> torch.Tensor:
    """The codebooks (M, 2^B, g) minimising sum_n s_n^2 (v_n - v_hat_n) H (v_n - v_hat_n)^T for fixed
    codes (N, G, M). v_hat_n = sum over slots t = (j, m) of codebook m's codeword b_njm placed at group
    j, linear in the codewords, so the normal equations are
        sum_n s_n^2 sum_{t, t'} [b_nt = a][b_nt' = a'] H_{j_t j_t'} C[a'] = sum_n s_n^2 sum_t [b_nt = a] (v_n H)_{j_t}
    for every codeword a (index m 2^B + code), with H_{jk} the (g, g) block of H."""
    N, G, M = codes.shape
    K = H.shape[0]
    g = K // G
    A = M * n_codes
    slot = (codes + torch.arange(M)[None, None, :] * n_codes).reshape(N, G * M)        # (N, S) codeword per slot
    grp = torch.arange(G).repeat_interleave(M)                                            # (S,) group of each slot
    Hb = H.reshape(G, g, G, g).permute(0, 2, 1, 3)[grp][:, grp]                          # (S, S, g, g)
    ata = torch.zeros(A * g * A * g, dtype=torch.float64)                                # (A g, A g) flattened
    p = torch.arange(g)
    for n0 in range(0, N, 16):                                                            # rows in chunks: memory
        rows = slice(n0, min(n0 + 16, N))
        row_ag = slot[rows, :, None, None, None] * g + p[:, None]                        # (n, S, 1, g, 1) a g + p
        col_ag = slot[rows, None, :, None, None] * g + p                                 # (n, 1, S, 1, g) b g + q
        vals = row_weight[rows, None, None, None, None] * Hb[None]                       # (n, S, S, g, g)
        ata.index_add_(0, (row_ag * (A * g) + col_ag).reshape(-1), vals.reshape(-1))
    vh = (row_weight[:, None] * (v @ H)).reshape(N, G, 1, g).expand(-1, -1, M, -1)       # (N, G, M, g)
    atv = torch.zeros(A, g, dtype=torch.float64).index_add_(0, slot.reshape(-1), vh.reshape(-1, g))
    ata = ata.reshape(A * g, A * g)
    scale = ata.diagonal().abs().mean().clamp_min(1e-30)
    c = torch.linalg.solve(ata + ridge * scale * torch.eye(A * g, dtype=torch.float64), atv.reshape(-1))
    return c.reshape(M, n_codes, g)


def learn_hessian(w: torch.Tensor, H: torch.Tensor, g: int, M: int, B: int, *, iters: int = 4, seed: int = 0,
                  start: Quantized | None = None) -> tuple[Quantized, list[float]]:
    """AQLM's objective: start from ``start`` (or the Frobenius :func:`learn`), then ``iters`` rounds of
    (codebooks by H-weighted least squares, codes by one coordinate-descent sweep against H). Returns
    the result and the output error :func:`hessian_error` before the first round and after each
    (non-increasing)."""
    if H.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"H must be (K, K) = ({w.shape[1]}, {w.shape[1]}), got {tuple(H.shape)}")
    q = start if start is not None else learn(w, g, M, B, iters=iters, seed=seed)[0]
    H = H.double()
    v = w.double() / q.scales[:, None]                                                    # (N, K)
    codes, books = q.codes.clone(), q.codebooks.clone()
    errors = [hessian_error(w, q, H)]
    for _ in range(iters):
        books = update_codebooks_hessian(v, codes, 2 ** B, H, q.scales ** 2)
        codes = assign_codes_hessian(v, books, codes, H)
        errors.append(hessian_error(w, Quantized(codes, books, q.scales), H))
    return Quantized(codes, books, q.scales), errors


def aqlm_matmul_ref(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """Dequantize-then-matmul in float64: y (M_tok, N)."""
    return x.double() @ dequantize(q).T


# ------------------------------------------------------------------------------------------------
# Triton: codes decoded inside the matmul

DECODE_TILE = Tile(16, 64, 64, 4, 3)       # batch 1..16: one row of tiles (also the interpreter's: fewer programs)


@triton.jit
def _aqlm_kernel(x_ptr, c_ptr, cb_ptr, s_ptr, y_ptr, T, N, K,
                 stride_xm, stride_xk, stride_cn, stride_cg, stride_ym, stride_yn,
                 G: tl.constexpr, NBOOKS: tl.constexpr, NCODES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FIRST_BOOK_ONLY: tl.constexpr, GROUP_SHIFT: tl.constexpr, CODE_MASK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BN,)
    offs_k = tl.arange(0, BLOCK_K)                                     # (BK,)
    m_ok, n_ok = offs_m < T, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm          # (BM, 1)
    c_rows = c_ptr + offs_n.to(tl.int64)[:, None] * stride_cn          # (BN, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):                                    # K % BLOCK_K == 0, BLOCK_K % G == 0
        k = k0 + offs_k
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)       # (BM, BK)
        grp = (k // G + GROUP_SHIFT) % (K // G)                        # the group of column k (broken: shifted)
        w = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for m in tl.static_range(NBOOKS if not FIRST_BOOK_ONLY else 1):
            code = tl.load(c_rows + grp[None, :] * stride_cg + m, mask=n_ok[:, None], other=0).to(tl.int32)
            code = code & CODE_MASK                                    # int16 sign-extends: keep the low 16 bits
            # codeword entry k % G of codeword `code` of codebook m: (BN, BK), equation (1)'s sum
            w += tl.load(cb_ptr + (m * NCODES + code) * G + (k % G)[None, :]).to(tl.float32)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)                  # (BM, BK) x (BK, BN)
    s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    acc = acc * s[None, :]                                             # the row scales s_n
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x, codes, codebooks, scales, tile: Tile):
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"x must be a 2-D fp16 or fp32 tensor, got {x.dtype} with shape {tuple(x.shape)}")
    if codes.dim() != 3 or codes.dtype not in CODE_DTYPES:
        raise ValueError(f"codes must be (N, K / g, M) uint8 (B <= 8) or int16 (B <= 16), got {codes.dtype} "
                         f"with shape {tuple(codes.shape)}")
    n_codes, most = codebooks.shape[1] if codebooks.dim() == 3 else 0, CODE_DTYPES[codes.dtype]
    if codebooks.dim() != 3 or codebooks.shape[0] != codes.shape[2] or n_codes & (n_codes - 1) or n_codes > most:
        raise ValueError(f"codebooks must be (M, 2^B, g) with M={codes.shape[2]} from codes and 2^B <= {most} "
                         f"for {codes.dtype} codes, got {tuple(codebooks.shape)}")
    K, g = x.shape[1], codebooks.shape[2]
    if codes.shape[1] * g != K:
        raise ValueError(f"codes (N, K / g, M) must have K / g = {K}/{g} groups, got {codes.shape[1]}")
    if K % tile.block_k or tile.block_k % g:
        raise ValueError(f"BLOCK_K={tile.block_k} must divide K={K} and be a multiple of g={g}")
    if scales.shape != (codes.shape[0],):
        raise ValueError(f"scales must be (N,) = ({codes.shape[0]},), got {tuple(scales.shape)}")
    if not codes.is_contiguous() or not codebooks.is_contiguous():
        raise ValueError("codes and codebooks must be contiguous")


CODE_DTYPES = {torch.uint8: 2 ** 8, torch.int16: 2 ** 16}    # code dtype: the most codewords it can index


def _launch_args(x, codes, codebooks, scales, y, tile: Tile, *, first_book_only=False, group_shift=0,
                 low_byte=False):
    """(grid, args, kwargs) of one launch: what :func:`aqlm_matmul` runs and :func:`launch_job` compiles."""
    T, K = x.shape
    N, _, M = codes.shape
    grid = (triton.cdiv(T, tile.block_m), triton.cdiv(N, tile.block_n))
    args = (x, codes, codebooks, scales, y, T, N, K, x.stride(0), x.stride(1), codes.stride(0), codes.stride(1),
            y.stride(0), y.stride(1))
    kwargs = dict(G=codebooks.shape[2], NBOOKS=M, NCODES=codebooks.shape[1], BLOCK_M=tile.block_m,
                  BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, FIRST_BOOK_ONLY=first_book_only,
                  GROUP_SHIFT=group_shift, CODE_MASK=0xFF if low_byte else 0xFFFF, num_warps=tile.num_warps,
                  num_stages=tile.num_stages)
    return grid, args, kwargs


def aqlm_matmul(x, codes, codebooks, scales, *, tile: Tile | None = None, _first_book_only=False,
                _group_shift=0, _low_byte=False):
    """y (M_tok, N) = x W^T with W decoded from the codes in the kernel (equation 1).

    ``_first_book_only`` (sum only codebook 0) and ``_group_shift`` (read the codes of group j + 1 for
    group j) and ``_low_byte`` (keep only the low 8 bits of each code, as if 16-bit codes were uint8)
    are the broken variants the checks must catch."""
    tile = tile or DECODE_TILE
    _check(x, codes, codebooks, scales, tile)
    y = torch.empty(x.shape[0], codes.shape[0], dtype=x.dtype, device=x.device)
    grid, args, kwargs = _launch_args(x, codes, codebooks, scales, y, tile, first_book_only=_first_book_only,
                                      group_shift=_group_shift, low_byte=_low_byte)
    _aqlm_kernel[grid](*args, **kwargs)
    return y


def code_dtype(n_codes: int) -> torch.dtype:
    """uint8 for up to 256 codewords, int16 (read back as unsigned by the kernel) for up to 65536."""
    if n_codes > 2 ** 16:
        raise ValueError(f"at most 2^16 codewords per codebook, got {n_codes}")
    return torch.uint8 if n_codes <= 2 ** 8 else torch.int16


def to_kernel_format(q: Quantized, dtype=torch.float16):
    """(codes uint8 or int16 (N, K / g, M), codebooks (M, 2^B, g) and scales (N,) in ``dtype``) for
    :func:`aqlm_matmul`; codes 2^15..2^16 - 1 are stored as their int16 bit pattern (negative)."""
    codes = q.codes.to(torch.int32).to(code_dtype(q.codebooks.shape[1]))   # int32 -> int16 wraps 40000 to -25536
    return codes.contiguous(), q.codebooks.to(dtype).contiguous(), q.scales.to(dtype)


# ------------------------------------------------------------------------------------------------
# Compile jobs at a real model's size

# (label, tokens, N, K): Llama-3-8B's attention output (4096 x 4096) and gate/up (14336 x 4096)
REAL_SHAPES = (
    ("Llama-3-8B o_proj, batch 1", 1, 4096, 4096),
    ("Llama-3-8B gate/up, batch 16", 16, 14336, 4096),
)
REAL_FORMATS = ((8, 1, 8), (8, 2, 8), (8, 1, 16))   # (g, M, B): 1, 2 and 2 bits of codes per weight (2x8, 1x16)


def launch_job(T: int, N: int, K: int, g: int = 8, M: int = 2, B: int = 8, *, tile: Tile = DECODE_TILE):
    """The :class:`kernels.inspect.TritonJob` of one launch at (T, N, K) on meta tensors (no memory)."""
    from kernels import inspect as ki

    meta = dict(device="meta")
    x = torch.empty(T, K, dtype=torch.float16, **meta)
    codes = torch.empty(N, K // g, M, dtype=code_dtype(2 ** B), **meta)
    codebooks = torch.empty(M, 2 ** B, g, dtype=torch.float16, **meta)
    scales = torch.empty(N, dtype=torch.float16, **meta)
    y = torch.empty(T, N, dtype=torch.float16, **meta)
    grid, args, kwargs = _launch_args(x, codes, codebooks, scales, y, tile)
    return ki.launch_job(_aqlm_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """:data:`REAL_SHAPES` x :data:`REAL_FORMATS`, fp16 activations, the decode tile."""
    return {f"{label}, g{g} M{M} B{B}": launch_job(T, N, K, g, M, B)
            for label, T, N, K in REAL_SHAPES for g, M, B in REAL_FORMATS}

