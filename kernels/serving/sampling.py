"""Sampling: per-request temperature, top-k, top-p, min-p and seed over a batch of logits rows.

Every row r of a step's logits (the sampled positions of a mixed batch) carries its own request's
parameters. With z = logits / T and e_i = exp(z_i - max z) in (0, 1]:

    top-k:  keep e_i >= tau_k, tau_k the k-th largest e                        (ties at tau_k kept)
    top-p:  on the top-k distribution, keep the smallest set of largest tokens whose mass reaches
            top_p: keep e_i >= tau_p, tau_p the largest value v with
            sum_{e_j >= max(v, tau_k)} e_j >= top_p * sum_{e_j >= tau_k} e_j
    min-p:  keep e_i >= min_p * max e = min_p                                    (Nguyen et al. 2024)
    q_i  =  e_i [e_i >= tau] / sum_j e_j [e_j >= tau],   tau = max(tau_k, tau_p, min_p)

the order of Hugging Face's logits warpers (temperature, top-k, top-p, min-p; transformers@v4.46.0,
generation/logits_process.py), with the same tie rule for top-k (values equal to the k-th are kept).
T = 0 is greedy: argmax of the logits, the first index among equal maxima, as torch.argmax.

Every T below :data:`GREEDY_BELOW` = 1e-5 is greedy too. In fp32, 1/T overflows to inf below about
2.9e-39 and z = logit / T overflows wherever |logit| / T > 3.4e38: z - max z is then inf - inf = NaN
and the draw returns garbage (the server answered NUL bytes at T = 1e-39, random bytes at 1e-38)
with nothing to show for it. At 1e-5 a logit of up to 3.4e33 still scales finitely, and drawing
greedily instead of at T = 1e-5 changes the answer only where another token's logit lies within
about 1e-5 * ln(V) of the largest (only then is its probability at T = 1e-5 above 1/V). vLLM uses
the same threshold (``_SAMPLING_EPS = 1e-5``: below it, greedy; vllm-project/vllm@00388f65,
vllm/sampling_params.py) and also raises any 0 < T < 1e-2 to 1e-2. top_k is an int32 in the
kernels: at most :data:`TOP_K_MAX` = 2**31 - 1 (any k >= V keeps everything).

A token is drawn from q by the Gumbel-max trick: i* = argmax_{kept i} z_i + g_i, g_i = -log(-log u_i),
u_i uniform in (0, 1); P(i* = i) = q_i exactly. The uniforms are counter-based (Philox4x32-10,
Salmon et al. 2011, the generator of tl.randint): u_i depends only on the row's key and on i, so
a request's tokens depend on its seed, its choice index and the token's position in the answer
(:func:`row_key`), never on which other requests share the batch, on preemption, or on whether the
kernel or the reference drew them. u = ((r >> 8) + 1/2) / 2**24 lies strictly inside (0, 1): the
24-bit mantissa form avoids the u = 1.0 that rounding a 32-bit integer to fp32 would produce about
once in 2**25 draws (g = +inf: a token picked whatever its probability).

Two implementations draw the same tokens from the same keys:

* :func:`sample_ref`, PyTorch: sort each row, read the thresholds off the sorted row and its
  cumulative sum, then the Gumbel-max over the kept tokens;
* :func:`sample`, a Triton kernel, one program per row: no sort. The thresholds are found by
  bisection on the bit patterns of e (positive floats order as their int32 bit patterns), 30
  passes over the row for tau_k and 30 for tau_p, each pass counting the kept tokens and their
  mass; then one pass draws the Gumbel-max. FlashInfer's sampling kernels also avoid the sort and
  give each row one thread block (flashinfer-ai/flashinfer@6b1a33f0, include/flashinfer/sampling.cuh:
  TopKTopPSamplingFromProbKernel, a pivot search over rounds).

``num_samples`` S > 1 draws S tokens from one row (counters s * V + i): that is how the tests
gather thousands of draws from one distribution for a chi-square test; the engine draws one per row
(a request with n > 1 choices has one row per choice, each with its own key).

Log-probabilities: :class:`Sampler` returns log_softmax of the raw logits (before temperature and
filtering, vLLM's default "raw_logprobs"), of the chosen token and the ``logprobs`` most likely.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import runtime

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5                         # temperatures below this are greedy (module docstring)
TOP_K_MAX = 2 ** 31 - 1                     # top_k travels as int32
_GREEDY_BELOW = tl.constexpr(GREEDY_BELOW)
ONE_BITS = 0x3F800000                       # the bit pattern of 1.0f
BISECT_STEPS = 30                           # 2**30 > ONE_BITS + 1: the bisection ends on one pattern
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping parameters (the engine's; the server maps OpenAI fields to them).

    temperature 0 (or below GREEDY_BELOW) is greedy. top_k None (or 0) keeps every token (at most
    TOP_K_MAX); top_p 1 and min_p 0 are off.
    seed None: the engine draws one from its own generator. n choices share the prompt's pages.
    stop_token_ids end a choice when sampled (the token is not part of the answer's text).
    logprobs None: none returned; k >= 0: the chosen token's and the k most likely.
    """
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"SamplingParams: {name} must be {want}, got {getattr(self, name)!r}")
        num = (int, float)
        if not isinstance(self.temperature, num) or isinstance(self.temperature, bool) or \
                not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "a finite number >= 0")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or not 0 <= self.top_k <= TOP_K_MAX):
            bad("top_k", f"None or an int in [0, {TOP_K_MAX}] (0: off)")
        if not isinstance(self.top_p, num) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not isinstance(self.min_p, num) or isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2 ** 63):
            bad("seed", "None or an int in [0, 2**63)")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", "an int >= 1")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "an int >= 1")
        if not isinstance(self.stop_token_ids, tuple) or not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a tuple of token ids")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


# ----------------------------------------------------------------------------------------------
# Keys and counter-based uniforms

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser (Steele et al. 2014): a bijection of 64-bit ints that scrambles every bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def row_key(seed: int, choice: int, step: int) -> int:
    """The Philox key of one draw: a request's ``seed``, its ``choice`` (0 .. n-1) and the ``step``
    (index of the token in the answer), mixed into 63 bits."""
    x = _mix64((seed * 0x9E3779B97F4A7C15 + choice) & _M64)
    return _mix64((x + step * 0xD1B54A32D192ED03) & _M64) >> 1


def philox_randint_ref(keys: torch.Tensor, n: int) -> np.ndarray:
    """Philox4x32-10 (Salmon et al. 2011) as tl.randint computes it: counter (i, 0, 0, 0) for
    i = 0 .. n-1, key (low, high 32 bits of each row's key); returns the first output word, (R, n) uint32."""
    k = keys.cpu().numpy().astype(np.uint64)
    m32 = np.uint64(0xFFFFFFFF)
    k0 = np.broadcast_to((k & m32)[:, None], (len(k), n)).copy()
    k1 = np.broadcast_to((k >> np.uint64(32))[:, None], (len(k), n)).copy()
    c0 = np.broadcast_to(np.arange(n, dtype=np.uint64)[None, :], (len(k), n)).copy()
    c1 = np.zeros_like(c0)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    A, B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    KA, KB = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    for _ in range(10):
        p0, p2 = A * c0, B * c2                        # 32 x 32 -> 64-bit products, exact in uint64
        c0, c1, c2, c3 = (p2 >> np.uint64(32)) ^ c1 ^ k0, p2 & m32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & m32
        k0, k1 = (k0 + KA) & m32, (k1 + KB) & m32
    return c0.astype(np.uint32)


def uniform_ref(keys: torch.Tensor, n: int) -> torch.Tensor:
    """(R, n) float32 uniforms in (0, 1): ((r >> 8) + 1/2) / 2**24 from :func:`philox_randint_ref`."""
    r = philox_randint_ref(keys, n) >> np.uint32(8)
    return (torch.from_numpy(r.astype(np.float32)) + 0.5) * (1.0 / 2 ** 24)


# ----------------------------------------------------------------------------------------------
# The PyTorch reference


def _row_params(params: list[SamplingParams], device=None):
    """Per-row tensors: temperature (0 for a greedy row), top_k (0 = off), top_p, min_p."""
    t = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32, device=device)
    k = torch.tensor([p.top_k or 0 for p in params], dtype=torch.int32, device=device)
    tp = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    mp = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    return t, k, tp, mp


def scaled_exp_ref(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z = logits / T (greedy rows, T < GREEDY_BELOW: logits) and e = exp(z - max z), both (R, V) float32,
    computed as the kernel computes them (a reciprocal, exp2), so both keep the same tokens."""
    hot = temperature >= GREEDY_BELOW
    inv_t = 1.0 / torch.where(hot, temperature, torch.ones_like(temperature))   # as the kernel: z = l * (1/T)
    z = logits.float() * inv_t[:, None]
    return z, torch.exp2((z - z.max(dim=-1, keepdim=True).values) * LOG2E)


def keep_threshold_ref(e: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """tau (R,): a token is kept iff e_i >= tau (module docstring), read off the sorted row."""
    R, V = e.shape
    s = e.sort(dim=-1, descending=True).values                               # (R, V) largest first
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V)).long()
    tau_k = s.gather(1, (k - 1)[:, None])[:, 0]                              # k-th largest
    top = torch.where(s >= tau_k[:, None], s, torch.zeros_like(s))           # the top-k row, sorted
    mass = top.cumsum(-1)                                                    # mass of the i+1 largest
    i_p = (mass < (top_p * mass[:, -1])[:, None]).sum(-1).clamp(max=V - 1)   # first i with mass_i >= p * total
    tau_p = torch.where(top_p < 1, s.gather(1, i_p[:, None])[:, 0], torch.zeros_like(tau_k))
    return torch.maximum(torch.maximum(tau_k, tau_p), min_p)


def processed_probs_ref(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution q each row samples from (R, V) float32: greedy rows one-hot at the argmax."""
    t, k, tp, mp = _row_params(params, logits.device)
    z, e = scaled_exp_ref(logits, t)
    kept = torch.where(e >= keep_threshold_ref(e, k, tp, mp)[:, None], e, torch.zeros_like(e))
    q = kept / kept.sum(-1, keepdim=True)
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.where((t < GREEDY_BELOW)[:, None], greedy, q)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, keys: torch.Tensor, *, num_samples: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``num_samples`` tokens per row: (tokens (R, S) int64, kept (R,) int32 tokens kept)."""
    R, V = logits.shape
    z, e = scaled_exp_ref(logits, temperature)
    tau = keep_threshold_ref(e, top_k, top_p, min_p)
    keep = e >= tau[:, None]                                                  # (R, V)
    u = uniform_ref(keys, num_samples * V).view(R, num_samples, V).to(logits.device)
    g = -torch.log(-torch.log(u))                                             # Gumbel(0, 1)
    scores = torch.where(keep[:, None, :], z[:, None, :] + g, torch.full_like(g, float("-inf")))
    tokens = scores.argmax(-1)                                                # (R, S)
    greedy = temperature < GREEDY_BELOW
    tokens = torch.where(greedy[:, None], logits.argmax(-1, keepdim=True).expand(R, num_samples), tokens)
    kept = torch.where(greedy, torch.ones_like(top_k), keep.sum(-1).int())
    return tokens, kept


# ----------------------------------------------------------------------------------------------
# The Triton kernel


@triton.jit
def _count_mass(row_ptr, V, m, inv_t, v, BLOCK_V: tl.constexpr):
    """Over the whole row: how many e_i >= v, and their sum, e_i = exp(z_i - m), z = logit * inv_t."""
    count = tl.zeros((), tl.int32)
    mass = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        i = start + tl.arange(0, BLOCK_V)
        ok = i < V
        z = tl.load(row_ptr + i, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        e = tl.exp2((z - m) * 1.4426950408889634)
        hit = ok & (e >= v)
        count += tl.sum(hit.to(tl.int32), axis=0)
        mass += tl.sum(tl.where(hit, e, 0.0), axis=0)
    return count, mass


@triton.jit
def _sample_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, key_ptr, tokens_ptr, kept_ptr,
    stride_row, V,
    NUM_SAMPLES: tl.constexpr, BLOCK_V: tl.constexpr, BISECT: tl.constexpr, SHORT_TOP_P: tl.constexpr,
):
    """One program per row: max and argmax, the thresholds by bisection, then NUM_SAMPLES Gumbel-max draws.
    ``SHORT_TOP_P`` is a deliberately broken variant: top-p keeps one token too few."""
    r = tl.program_id(0)
    row_ptr = logits_ptr + r.to(tl.int64) * stride_row            # r * stride passes 2**31 at real sizes
    T = tl.load(temp_ptr + r)
    greedy = T < _GREEDY_BELOW                                      # T = 0, or too small for 1/T in fp32
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, T))
    # pass 1: m = max z and the first index holding it (greedy's answer)
    m = tl.full((), float("-inf"), tl.float32)
    arg = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK_V):
        i = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + i, mask=i < V, other=float("-inf")).to(tl.float32) * inv_t
        tile_max = tl.max(z, axis=0)
        tile_arg = start + tl.argmax(z, axis=0, tie_break_left=True)
        arg = tl.where(tile_max > m, tile_arg, arg)                 # strictly greater: the first maximum wins
        m = tl.maximum(m, tile_max)
    s = tl.arange(0, NUM_SAMPLES)
    if greedy:
        tl.store(tokens_ptr + r.to(tl.int64) * NUM_SAMPLES + s, tl.zeros((NUM_SAMPLES,), tl.int64) + arg)
        tl.store(kept_ptr + r, 1)
    else:
        k = tl.load(topk_ptr + r)
        top_p = tl.load(topp_ptr + r)
        min_p = tl.load(minp_ptr + r)
        # tau_k: the largest bit pattern b with count(e >= float(b)) >= k. Invariant: lo passes, hi fails.
        tau_k = tl.zeros((), tl.float32)
        if (k > 0) & (k < V):
            lo = tl.zeros((), tl.int32)
            hi = tl.full((), 1065353217, tl.int32)                  # bits of 1.0f, plus 1: count 0
            for _ in range(BISECT):
                mid = lo + (hi - lo) // 2
                count, _mass = _count_mass(row_ptr, V, m, inv_t, mid.to(tl.float32, bitcast=True), BLOCK_V)
                ok = count >= k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            tau_k = lo.to(tl.float32, bitcast=True)
        # tau_p: the largest v >= tau_k with mass(e >= v) >= top_p * mass(e >= tau_k)
        tau_p = tau_k
        if top_p < 1.0:
            _count, top_mass = _count_mass(row_ptr, V, m, inv_t, tau_k, BLOCK_V)
            target = top_p * top_mass
            lo = tau_k.to(tl.int32, bitcast=True)
            hi = tl.full((), 1065353217, tl.int32)
            for _ in range(BISECT):
                mid = lo + (hi - lo) // 2
                _count, mass = _count_mass(row_ptr, V, m, inv_t, mid.to(tl.float32, bitcast=True), BLOCK_V)
                ok = mass >= target
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            if SHORT_TOP_P:
                lo = lo + 1                                          # broken: the boundary token dropped
            tau_p = lo.to(tl.float32, bitcast=True)
        tau = tl.maximum(tl.maximum(tau_k, tau_p), min_p)
        # the draw: argmax over kept i of z_i + g_i, g = -log(-log u), u from Philox(key, s * V + i)
        key = tl.load(key_ptr + r)
        best = tl.full((NUM_SAMPLES,), float("-inf"), tl.float32)
        best_i = tl.zeros((NUM_SAMPLES,), tl.int32)
        kept = tl.zeros((), tl.int32)
        for start in range(0, V, BLOCK_V):
            i = start + tl.arange(0, BLOCK_V)
            ok = i < V
            z = tl.load(row_ptr + i, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            keep = ok & (tl.exp2((z - m) * 1.4426950408889634) >= tau)
            kept += tl.sum(keep.to(tl.int32), axis=0)
            bits = tl.randint(key, s[:, None] * V + i[None, :])      # (NUM_SAMPLES, BLOCK_V) uint32
            u = ((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08   # / 2**24: strictly inside (0, 1)
            score = tl.where(keep[None, :], z[None, :] - tl.log(-tl.log(u)), float("-inf"))
            tile_best = tl.max(score, axis=1)
            tile_i = start + tl.argmax(score, axis=1, tie_break_left=True)
            best_i = tl.where(tile_best > best, tile_i, best_i)
            best = tl.maximum(best, tile_best)
        tl.store(tokens_ptr + r.to(tl.int64) * NUM_SAMPLES + s, best_i.to(tl.int64))
        tl.store(kept_ptr + r, kept)


# A row of 128256 fp32 logits (Llama 3's vocabulary) is 501 KiB: it does not fit in one program's
# registers, so the program walks it in tiles. 1024 logits per tile over 4 warps is 8 per thread.
GPU_BLOCK_V = 1024
INTERPRETER_BLOCK_V = 4096


def default_block_v(vocab: int) -> int:
    """Logits per tile: the whole row under the interpreter (up to 4096: few loop trips), GPU_BLOCK_V on a GPU."""
    if runtime.runtime().interpreted:
        return min(INTERPRETER_BLOCK_V, triton.next_power_of_2(vocab))
    return GPU_BLOCK_V


def check_sample_inputs(logits, temperature, top_k, top_p, min_p, keys, num_samples) -> None:
    """Validate :func:`sample`'s arguments; errors name the argument."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"sample: logits must be a (R, V) float32/float16/bfloat16 tensor, got "
                         f"{getattr(logits, 'shape', type(logits))} {getattr(logits, 'dtype', '')}")
    if logits.stride(1) != 1:
        raise ValueError("sample: logits rows must be contiguous (stride 1 along V)")
    R, V = logits.shape
    for name, t, dtypes in (("temperature", temperature, (torch.float32,)), ("top_k", top_k, (torch.int32,)),
                            ("top_p", top_p, (torch.float32,)), ("min_p", min_p, (torch.float32,)),
                            ("keys", keys, (torch.int64,))):
        if not isinstance(t, torch.Tensor) or t.shape != (R,) or t.dtype not in dtypes or t.device != logits.device:
            raise ValueError(f"sample: {name} must be a ({R},) {dtypes[0]} tensor on {logits.device}, got "
                             f"{getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')}")
    if not isinstance(num_samples, int) or num_samples < 1 or num_samples & (num_samples - 1):
        raise ValueError(f"sample: num_samples must be a power of two >= 1, got {num_samples!r}")
    if num_samples * V >= 2 ** 31:
        raise ValueError(f"sample: num_samples * V = {num_samples * V} must stay below 2**31 (Philox counters are 32-bit)")


def _sample_args(logits, temperature, top_k, top_p, min_p, keys, tokens, kept, *, num_samples: int,
                 block_v: int, short_top_p: bool = False, num_warps: int = 4):
    """(grid, args, kwargs) of one launch of :func:`_sample_kernel`, shared by :func:`sample` and
    :func:`compile_jobs`."""
    R, V = logits.shape
    args = (logits, temperature, top_k, top_p, min_p, keys, tokens, kept, logits.stride(0), V)
    kwargs = dict(NUM_SAMPLES=num_samples, BLOCK_V=block_v, BISECT=BISECT_STEPS, SHORT_TOP_P=short_top_p,
                  num_warps=num_warps)
    return (R,), args, kwargs


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, keys: torch.Tensor, *, num_samples: int = 1, block_v: int | None = None,
           short_top_p: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton sampler: same arguments and results as :func:`sample_ref` (tokens (R, S) int64,
    kept (R,) int32). ``short_top_p=True`` is the deliberately broken variant for the tests."""
    check_sample_inputs(logits, temperature, top_k, top_p, min_p, keys, num_samples)
    R, V = logits.shape
    tokens = torch.empty((R, num_samples), dtype=torch.int64, device=logits.device)
    kept = torch.empty((R,), dtype=torch.int32, device=logits.device)
    if R == 0:
        return tokens, kept
    grid, args, kwargs = _sample_args(logits, temperature, top_k, top_p, min_p, keys, tokens, kept,
                                      num_samples=num_samples, block_v=block_v or default_block_v(V),
                                      short_top_p=short_top_p)
    _sample_kernel[grid](*args, **kwargs)
    return tokens, kept


def compile_jobs() -> dict:
    """The sampler at real vocabularies (meta tensors, fp32 logits of a decode batch of 64)."""
    from kernels import inspect as ki

    jobs = {}
    for label, vocab in (("Llama-3-8B vocabulary 128256", 128256), ("Qwen2.5 vocabulary 152064", 152064)):
        R = 64
        logits = torch.empty(R, vocab, device="meta")
        f = torch.empty(R, device="meta")
        i32 = torch.empty(R, dtype=torch.int32, device="meta")
        keys = torch.empty(R, dtype=torch.int64, device="meta")
        tokens = torch.empty(R, 1, dtype=torch.int64, device="meta")
        grid, args, kwargs = _sample_args(logits, f, i32, f, f, keys, tokens, i32, num_samples=1, block_v=GPU_BLOCK_V)
        jobs[f"{label}, batch 64, one draw per row"] = ki.launch_job(_sample_kernel, *args, grid=grid, **kwargs)
    return jobs


def chi_square(samples: torch.Tensor, q: torch.Tensor, *, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit test of ``samples`` (1-D token ids) against the distribution ``q`` (V,).

    Tokens are pooled, least likely first, into bins of expected count >= ``min_expected`` (the
    usual condition for the chi-square approximation); a sample where q = 0 makes the p-value 0
    outright. Returns (statistic, degrees of freedom, p-value = P(chi2_dof >= statistic))."""
    q = q.double()
    n = samples.numel()
    counts = torch.bincount(samples.flatten(), minlength=q.numel()).double()
    if counts[q == 0].sum() > 0:
        return float("inf"), 0, 0.0
    order = torch.argsort(q[q > 0])
    exp_, obs_ = (n * q[q > 0])[order].tolist(), counts[q > 0][order].tolist()
    bins, e_acc, o_acc = [], 0.0, 0.0
    for e, o in zip(exp_, obs_):
        e_acc, o_acc = e_acc + e, o_acc + o
        if e_acc >= min_expected:
            bins.append((e_acc, o_acc))
            e_acc, o_acc = 0.0, 0.0
    if e_acc > 0:                                                  # the remainder joins the last bin
        e_last, o_last = bins.pop() if bins else (0.0, 0.0)
        bins.append((e_last + e_acc, o_last + o_acc))
    stat = sum((o - e) ** 2 / e for e, o in bins)
    dof = len(bins) - 1
    if dof < 1:
        return stat, 0, 1.0
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, p


# ----------------------------------------------------------------------------------------------
# The engine's sampling stage


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs to know about one logits row."""
    params: SamplingParams
    seed: int                    # the request's seed (drawn by the engine when the request gave none)
    choice: int                  # 0 .. n-1
    step: int                    # index of the token being drawn in this choice's answer


@dataclass
class SamplerOutput:
    tokens: list[int]
    logprobs: list[float | None] = field(default_factory=list)           # of the chosen token
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


class Sampler:
    """``Sampler(use_kernels)(logits (R, V), rows)`` -> one token per row, and log-probs where asked.

    A batch of greedy rows is torch.argmax (exactly the engine's greedy path); any other batch goes
    through :func:`sample` (``use_kernels``) or :func:`sample_ref`, greedy rows included (both give
    the argmax for T = 0)."""

    def __init__(self, use_kernels: bool = False):
        self.use_kernels = use_kernels

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        if logits.shape[0] != len(rows):
            raise ValueError(f"Sampler: {logits.shape[0]} logits rows for {len(rows)} sample rows")
        if torch.isnan(logits).any():
            raise FloatingPointError("Sampler: the model produced NaN logits")
        if all(r.params.greedy for r in rows):
            tokens = logits.argmax(-1).tolist()
        else:
            t, k, tp, mp = _row_params([r.params for r in rows], logits.device)
            keys = torch.tensor([row_key(r.seed, r.choice, r.step) for r in rows], dtype=torch.int64, device=logits.device)
            draw = sample if self.use_kernels else sample_ref
            tokens = draw(logits.float().contiguous(), t, k, tp, mp, keys)[0][:, 0].tolist()
        out = SamplerOutput(tokens, [None] * len(rows), [None] * len(rows))
        asked = [j for j, r in enumerate(rows) if r.params.logprobs is not None]
        if asked:
            lp = torch.log_softmax(logits[asked].float(), dim=-1)                # the engine's own log-softmax
            for a, j in enumerate(asked):
                out.logprobs[j] = float(lp[a, tokens[j]])
                top = lp[a].topk(rows[j].params.logprobs) if rows[j].params.logprobs else None
                out.top_logprobs[j] = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
        return out
