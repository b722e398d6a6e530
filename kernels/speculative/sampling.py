"""Speculative sampling: accept a draft token x with probability min(1, p(x)/q(x)), else resample.

A cheap draft model proposes gamma tokens d_1..d_gamma, drawn one after another from its
distributions q_1..q_gamma; the target model scores all of them in one forward, giving p_1..p_{gamma+1}
(p_j is the target's distribution for position j given the prefix and d_<j). Then, for j = 1, 2, ...:

    accept d_j  iff  u_j * q_j(d_j) < p_j(d_j),   u_j uniform in (0, 1)   (probability min(1, p_j/q_j))
    at the first rejection j: emit a token from r_j = norm(max(0, p_j - q_j)) and stop;
    if all gamma are accepted: emit a bonus token from p_{gamma+1}.

(Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2.) One step emits n + 1 tokens,
n the number accepted. Why the output is distributed as p:  P(emit x) = q(x) min(1, p(x)/q(x))
+ (1 - sum_y min(p(y), q(y))) r(x) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x), because
sum_y max(0, p(y) - q(y)) = 1 - sum_y min(p(y), q(y)). :func:`step_distribution` enumerates the
whole step exactly (in rationals) to check this for several positions at once.

Randomness is explicit so that the kernel and the reference make the same choices: ``u`` (B, gamma)
the acceptance uniforms, and one Philox key per sequence for the residual draw, done by the
Gumbel-max trick as in the course's sampler (kernels.serving.sampling): the token is
argmax_i log r_i - log(-log u_i), u_i = uniform(key, i). The normalisation of r does not change
the argmax, so no sum over the vocabulary is needed to draw from it.

Shapes: B sequences, G = gamma draft tokens, V vocabulary.
    p      (B, G+1, V) float32   target probabilities (rows sum to 1)
    q      (B, G, V)   float32   draft probabilities
    draft  (B, G)      int64     the draft tokens (q[b, j, draft[b, j]] > 0)
    u      (B, G)      float32   acceptance uniforms in (0, 1)
    keys   (B,)        int64     Philox keys of the residual draw
returns
    n_accepted (B,) int32;  tokens (B, G+1) int64: the n accepted drafts, then the resampled or
    bonus token, then -1 padding.

The rules: ``"exact"`` is the rule above; two plausible-looking wrong ones are kept to be caught:
``"biased"`` accepts d iff p(d) >= q(d) and otherwise resamples from p, ``"resample_p"`` accepts with
min(1, p/q) but resamples from p instead of the residual.
"""
from __future__ import annotations

from fractions import Fraction
from itertools import product

import torch
import triton
import triton.language as tl

from kernels.serving.sampling import GPU_BLOCK_V, default_block_v, uniform_ref   # the sampler's row tiles

RULES = ("exact", "biased", "resample_p")


# ---------------------------------------------------------------- the rule, exactly

def _accept_prob(p: Fraction, q: Fraction, rule: str) -> Fraction:
    if rule == "biased":
        return Fraction(1) if p >= q else Fraction(0)
    return min(Fraction(1), p / q)


def _resample_dist(p: list, q: list, rule: str) -> list:
    """The distribution drawn from after a rejection: norm(max(0, p - q)), or p for the wrong rules."""
    if rule != "exact":
        return list(p)
    r = [max(pi - qi, 0) for pi, qi in zip(p, q)]
    z = sum(r)
    return [ri / z for ri in r] if z > 0 else list(p)


def step_distribution(p_fn, q_fn, prefix: tuple, gamma: int, rule: str = "exact") -> dict:
    """Exact distribution of what one speculative step emits: {emitted tuple: probability}.

    p_fn(prefix) and q_fn(prefix) give the target's and the draft's next-token distribution (lists of
    Fractions over the vocabulary) after ``prefix``. Enumerates every draft sequence and every
    accept/reject outcome; the arithmetic is whatever p_fn returns (Fractions: exact)."""
    if rule not in RULES:
        raise ValueError(f"step_distribution: rule must be one of {RULES}, got {rule!r}")
    out: dict = {}

    def add(seq, w):
        out[seq] = out.get(seq, 0) + w

    def walk(seq: tuple, weight, j: int):
        p, q = p_fn(prefix + seq), q_fn(prefix + seq)
        if j == gamma:                                     # all accepted: the bonus token from p
            for x, px in enumerate(p):
                if px:
                    add(seq + (x,), weight * px)
            return
        reject = 0
        for d, qd in enumerate(q):
            if qd == 0:
                continue
            a = _accept_prob(p[d], qd, rule)
            if a:
                walk(seq + (d,), weight * qd * a, j + 1)
            reject += qd * (1 - a)
        if reject:
            for x, rx in enumerate(_resample_dist(p, q, rule)):
                if rx:
                    add(seq + (x,), weight * reject * rx)

    walk((), Fraction(1), 0)
    return out


def output_distribution(p_fn, q_fn, prefix: tuple, gamma: int, length: int, rule: str = "exact", *,
                        step=step_distribution) -> dict:
    """Exact distribution of the first ``length`` tokens that repeated speculative steps emit. ``step``
    computes one step's distribution with :func:`step_distribution`'s arguments (another one:
    ``kernels.speculative.serving.engine_step_distribution``, the engine's verification enumerated)."""
    if length <= 0:
        return {(): Fraction(1)}
    out: dict = {}
    for seq, w in step(p_fn, q_fn, prefix, gamma, rule).items():
        if len(seq) >= length:
            out[seq[:length]] = out.get(seq[:length], 0) + w
        else:
            for rest, w2 in output_distribution(p_fn, q_fn, prefix + seq, gamma, length - len(seq), rule,
                                                step=step).items():
                out[seq + rest] = out.get(seq + rest, 0) + w * w2
    return out


def target_distribution(p_fn, prefix: tuple, vocab: int, length: int) -> dict:
    """p(t_1..t_L | prefix) = prod_i p(t_i | prefix, t_<i) for every sequence of ``length`` tokens."""
    out = {}
    for seq in product(range(vocab), repeat=length):
        w = Fraction(1)
        for i, t in enumerate(seq):
            w *= p_fn(prefix + seq[:i])[t]
        out[seq] = w
    return out


def accept_probability_ref(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """a(x) = min(1, p(x) / q(x)) where q(x) > 0, else 0: the chance that a drafted x is kept. (..., V)"""
    return torch.where(q > 0, torch.clamp(p / q.clamp_min(1e-300), max=1.0), torch.zeros_like(q))


def residual_ref(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """r = max(0, p - q) / sum max(0, p - q) over the last dim, the distribution drawn after a rejection;
    p itself where p <= q everywhere (p = q: then every draft is accepted and r is never drawn). (..., V)"""
    r = (p - q).clamp_min(0)
    z = r.sum(-1, keepdim=True)
    return torch.where(z > 0, r / torch.where(z > 0, z, torch.ones_like(z)), p)


def emitted_distribution(a: torch.Tensor, r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What one step emits first, in closed form, from the acceptance a and the resampling
    distribution r: P(x) = q(x) a(x) + (1 - sum_y q(y) a(y)) r(x). (..., V)"""
    kept = q * a
    return kept + (1 - kept.sum(-1, keepdim=True)) * r


def one_step_output(p: torch.Tensor, q: torch.Tensor, rule: str = "exact") -> torch.Tensor:
    """The distribution of the first emitted token in closed form (float64), for (V,) p and q, under
    ``rule``: :func:`emitted_distribution` of its acceptance and its resampling distribution."""
    p, q = p.double(), q.double()
    if rule not in RULES:
        raise ValueError(f"one_step_output: rule must be one of {RULES}, got {rule!r}")
    a = (p >= q).double() if rule == "biased" else accept_probability_ref(p, q)
    r = residual_ref(p, q) if rule == "exact" else p
    return emitted_distribution(a, r, q)


def expected_tokens(alpha, gamma: int):
    """Tokens one step emits on average when each draft is accepted with probability alpha, i.i.d.:
    E = sum_{k=0}^{gamma} alpha^k = (1 - alpha^(gamma+1)) / (1 - alpha)   (Leviathan et al. 2023, eq. 1)."""
    alpha = torch.as_tensor(alpha, dtype=torch.float64)
    return torch.where(alpha < 1, (1 - alpha ** (gamma + 1)) / (1 - alpha).clamp_min(1e-300),
                       torch.full_like(alpha, gamma + 1.0))


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = E_{x~q} min(1, p(x)/q(x)) = sum_x min(p(x), q(x)) = 1 - TV(p, q), over the last dim."""
    return torch.minimum(p, q).sum(-1)


# ---------------------------------------------------------------- rejection sampling, the general idea

def rejection_sample(p: torch.Tensor, q: torch.Tensor, n: int, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """Classic rejection sampling of p (V,) from proposals of q (V,): draw x ~ q, keep it with
    probability p(x) / (M q(x)), M = max_x p(x)/q(x). Returns (the kept samples, the fraction kept = 1/M).
    A rejected proposal is thrown away; speculative sampling instead draws from the residual."""
    M = float((p / q).max())
    x = torch.multinomial(q, n, replacement=True, generator=generator)
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    keep = u * M * q[x].double() < p[x].double()
    return x[keep], float(keep.double().mean())


# ---------------------------------------------------------------- the batched verification, PyTorch

def check_verify_inputs(p, q, draft, u, keys, name: str = "verify") -> None:
    if not isinstance(p, torch.Tensor) or p.dim() != 3 or p.dtype != torch.float32:
        raise ValueError(f"{name}: p must be a (B, gamma+1, V) float32 tensor, got "
                         f"{getattr(p, 'shape', type(p))} {getattr(p, 'dtype', '')}")
    B, G1, V = p.shape
    G = G1 - 1
    if G < 1:
        raise ValueError(f"{name}: p must hold gamma+1 >= 2 positions, got {G1}")
    if not isinstance(q, torch.Tensor) or q.shape != (B, G, V) or q.dtype != torch.float32:
        raise ValueError(f"{name}: q must be a ({B}, {G}, {V}) float32 tensor, got "
                         f"{getattr(q, 'shape', type(q))} {getattr(q, 'dtype', '')}")
    for arg, t, shape, dtype in (("draft", draft, (B, G), torch.int64), ("u", u, (B, G), torch.float32),
                                 ("keys", keys, (B,), torch.int64)):
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != p.device:
            raise ValueError(f"{name}: {arg} must be a {shape} {dtype} tensor on {p.device}, got "
                             f"{getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')}")
    if B and (int(draft.min()) < 0 or int(draft.max()) >= V):
        raise ValueError(f"{name}: draft tokens must lie in [0, V={V})")
    if B and not bool(((u > 0) & (u < 1)).all()):
        raise ValueError(f"{name}: u must lie strictly inside (0, 1)")
    if p.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError(f"{name}: p and q must be contiguous along V")


def verify_ref(p, q, draft, u, keys, *, rule: str = "exact",
               residual_u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept, find the first rejection, draw the residual (or bonus) token: (n_accepted, tokens).
    ``residual_u`` (B, V) float64 uniforms replace the Philox uniforms of ``keys`` in the Gumbel-max
    draw (the exact enumeration chooses them: kernels.speculative.serving.engine_step_distribution)."""
    check_verify_inputs(p, q, draft, u, keys, "verify_ref")
    B, G1, V = p.shape
    if residual_u is not None and (not isinstance(residual_u, torch.Tensor) or residual_u.shape != (B, V)
                                   or residual_u.dtype != torch.float64):
        raise ValueError(f"verify_ref: residual_u must be a ({B}, {V}) float64 tensor, got "
                         f"{getattr(residual_u, 'shape', type(residual_u))} {getattr(residual_u, 'dtype', '')}")
    if rule not in RULES:
        raise ValueError(f"verify_ref: rule must be one of {RULES}, got {rule!r}")
    G = G1 - 1
    pd = p[:, :G].gather(2, draft[:, :, None])[:, :, 0]                     # (B, G) p_j(d_j)
    qd = q.gather(2, draft[:, :, None])[:, :, 0]                            # (B, G) q_j(d_j)
    accept = pd >= qd if rule == "biased" else u * qd < pd                  # (B, G)
    n = torch.where(accept.all(1), G, (~accept).int().argmax(1))            # (B,) first rejection
    b = torch.arange(B, device=p.device)
    p_n = p[b, n]                                                           # (B, V)
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[b, n]               # (B, V); zeros at the bonus row
    r = (p_n - q_n).clamp_min(0) if rule == "exact" else p_n
    r = torch.where((r > 0).any(1, keepdim=True), r, p_n)                   # empty residual (p <= q everywhere): p
    uu = uniform_ref(keys, V).to(p.device) if residual_u is None else residual_u
    g = -torch.log(-torch.log(uu))                                          # (B, V) Gumbel(0, 1)
    last = torch.where(r > 0, torch.log(r) + g, torch.full_like(r, float("-inf"))).argmax(1)
    j = torch.arange(G1, device=p.device)[None, :]
    d_pad = torch.cat([draft, draft[:, :1]], 1)
    tokens = torch.where(j < n[:, None], d_pad, torch.where(j == n[:, None], last[:, None], -1))
    return n.int(), tokens


# ---------------------------------------------------------------- the batched verification, Triton

@triton.jit
def _verify_kernel(
    p_ptr, q_ptr, draft_ptr, u_ptr, key_ptr, n_ptr, tok_ptr,
    stride_pb, stride_pj, stride_qb, stride_qj, V,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_V: tl.constexpr,
    RULE: tl.constexpr,
):
    """One program per sequence b: the G acceptance tests at once, the first rejection n, then one
    pass over the vocabulary in tiles for the Gumbel-max draw from max(0, p_n - q_n) (or p_G).
    RULE 0 is the exact rule; 1 ("biased") and 2 ("resample_p") are the broken variants."""
    b = tl.program_id(0).to(tl.int64)                    # b * stride_pb passes 2**31 at large B*(G+1)*V
    p_row = p_ptr + b * stride_pb
    q_row = q_ptr + b * stride_qb
    j = tl.arange(0, BLOCK_G)
    jm = j < G
    d = tl.load(draft_ptr + b * G + j, mask=jm, other=0)                 # (BLOCK_G,) int64
    pd = tl.load(p_row + j * stride_pj + d, mask=jm, other=0.0)
    qd = tl.load(q_row + j * stride_qj + d, mask=jm, other=1.0)
    u = tl.load(u_ptr + b * G + j, mask=jm, other=0.5)
    if RULE == 1:
        accept = pd >= qd
    else:
        accept = u * qd < pd
    n = tl.min(tl.where(jm & (accept == 0), j, G), axis=0)             # first rejection, G if none
    # the residual row: r_i = max(0, p_n,i - q_n,i) (n < G) or p_G,i (all accepted)
    key = tl.load(key_ptr + b)
    has_q = n < G
    pn_row = p_row + n.to(tl.int64) * stride_pj
    qn_row = q_row + n.to(tl.int64) * stride_qj
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.zeros((), tl.int32)
    best_p = tl.full((), float("-inf"), tl.float32)              # the same draw from p_n: empty-residual fallback
    best_pi = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK_V):
        i = start + tl.arange(0, BLOCK_V)
        ok = i < V
        pv = tl.load(pn_row + i, mask=ok, other=0.0)
        qv = tl.load(qn_row + i, mask=ok & has_q, other=0.0)
        if RULE == 0:
            r = tl.maximum(pv - qv, 0.0)
        else:
            r = pv
        bits = tl.randint(key, i)
        uu = ((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08   # / 2**24: strictly inside (0, 1)
        g = -tl.log(-tl.log(uu))
        s = tl.where(ok & (r > 0), tl.log(r) + g, float("-inf"))
        sp = tl.where(ok & (pv > 0), tl.log(pv) + g, float("-inf"))
        tb = tl.max(s, axis=0)
        ti = start + tl.argmax(s, axis=0, tie_break_left=True)
        best_i = tl.where(tb > best, ti, best_i)
        best = tl.maximum(best, tb)
        tpb = tl.max(sp, axis=0)
        tpi = start + tl.argmax(sp, axis=0, tie_break_left=True)
        best_pi = tl.where(tpb > best_p, tpi, best_pi)
        best_p = tl.maximum(best_p, tpb)
    last = tl.where(best > float("-inf"), best_i, best_pi).to(tl.int64)
    jj = tl.arange(0, BLOCK_G * 2)
    jjm = jj < G + 1
    dd = tl.load(draft_ptr + b * G + jj, mask=jj < G, other=0)
    out = tl.where(jj < n, dd, tl.where(jj == n, last, -1))
    tl.store(tok_ptr + b * (G + 1) + jj, out, mask=jjm)
    tl.store(n_ptr + b, n)


def _verify_args(p, q, draft, u, keys, n, tokens, *, block_v: int, rule: str = "exact", num_warps: int = 4):
    """(grid, args, kwargs) of one launch of :func:`_verify_kernel`, shared by :func:`verify` and
    :func:`launch_job`."""
    B, G1, V = p.shape
    G = G1 - 1
    args = (p, q, draft, u, keys, n, tokens, p.stride(0), p.stride(1), q.stride(0), q.stride(1), V)
    kwargs = dict(G=G, BLOCK_G=triton.next_power_of_2(G), BLOCK_V=block_v, RULE=RULES.index(rule),
                  num_warps=num_warps)
    return (B,), args, kwargs


def verify(p, q, draft, u, keys, *, rule: str = "exact", block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton verification: same arguments and results as :func:`verify_ref`; ``rule`` other
    than "exact" selects a deliberately broken variant, for the tests."""
    check_verify_inputs(p, q, draft, u, keys)
    if rule not in RULES:
        raise ValueError(f"verify: rule must be one of {RULES}, got {rule!r}")
    B, G1, V = p.shape
    draft, u, keys = draft.contiguous(), u.contiguous(), keys.contiguous()
    n = torch.empty(B, dtype=torch.int32, device=p.device)
    tokens = torch.empty(B, G1, dtype=torch.int64, device=p.device)
    if B == 0:
        return n, tokens
    grid, args, kwargs = _verify_args(p, q, draft, u, keys, n, tokens, block_v=block_v or default_block_v(V),
                                      rule=rule)
    _verify_kernel[grid](*args, **kwargs)
    return n, tokens


LLAMA3_VOCAB = 128256


def launch_job(batch: int, gamma: int, vocab: int = LLAMA3_VOCAB, *, target: str = "sm90"):
    """The GPU launch of :func:`verify` on meta tensors (fp32 probabilities)."""
    from kernels import inspect as ki

    p = torch.empty(batch, gamma + 1, vocab, device="meta")
    q = torch.empty(batch, gamma, vocab, device="meta")
    draft = torch.empty(batch, gamma, dtype=torch.int64, device="meta")
    u = torch.empty(batch, gamma, device="meta")
    keys = torch.empty(batch, dtype=torch.int64, device="meta")
    n = torch.empty(batch, dtype=torch.int32, device="meta")
    tokens = torch.empty(batch, gamma + 1, dtype=torch.int64, device="meta")
    grid, args, kwargs = _verify_args(p, q, draft, u, keys, n, tokens, block_v=GPU_BLOCK_V)
    return ki.launch_job(_verify_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """Llama 3's vocabulary (128256), gamma 4 and 8, batch 1 and 64."""
    return {f"V 128256, gamma {g}, batch {b}": launch_job(b, g) for g in (4, 8) for b in (1, 64)}
