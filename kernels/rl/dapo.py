"""DAPO, GPG, GSPO and ASPO: switches on the GRPO path, one loss kernel for the four ways a ratio is taken.

DAPO (Yu et al. 2025, arXiv 2503.14476) changes four things in GRPO (kernels.rl.grpo):

* clip-higher: the PPO clip range is decoupled, clip(r, 1 - eps_low, 1 + eps_high), eps_low = 0.2 and
  eps_high = 0.28; only the upper bound widens, and it binds only where A > 0;
* dynamic sampling: a group whose G rewards are all equal has A = 0 for every answer and gives no
  gradient; such groups are dropped and more prompts are sampled until the batch is full again
  (the constraint 0 < |{o_i correct}| < G); the dropped rollouts are compute spent for nothing;
* token-level loss: sum_i sum_t l_{i,t} / sum_i |o_i| (kernels.rl.grpo.aggregation_weights "token");
* overlong reward shaping: with a generation budget L_max and a soft zone of L_cache tokens before it,

      R_len(y) = 0                               if |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
               = -1                              if |y| > L_max (truncated)

  added to the task reward.

GPG (Chu et al. 2025, arXiv 2504.02546) drops the surrogate: no ratio, no clip, no KL, no reference
model; the loss is -A_i log pi(o_{i,t}) averaged over all tokens, with A_i = alpha (r_i - mean_g r) / F_norm
and alpha = B / (B - M); here M counts the answers in groups whose rewards are all equal (they carry no
gradient; verl's implementation counts the zero rewards instead, see the chapter). F_norm = 1 here.

GSPO (Zheng et al. 2025, arXiv 2507.18071) replaces the token ratio by one ratio per answer, the
geometric mean of its token ratios,

      s_i = (pi(o_i) / pi_old(o_i)) ^ (1/|o_i|) = exp((1/|o_i|) sum_t (logp_{i,t} - old_{i,t})),

clipped per answer: loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)); where the
unclipped term is active, d loss_i / d logp_{i,t} = -A_i s_i / |o_i| for every token of the answer.

ASPO (Wang et al. 2025, arXiv 2510.06062; code: wizard-III/Archer2.0 at b08d963,
verl/trainer/ppo/core_algos.py, compute_policy_loss_archer) keeps token ratios r_t = pi / pi_old but flips
the ratio of positive-advantage tokens. Written as that code writes it, with p = min(r, 1 + eps_high) and
sg() a stop-gradient (the paper's form is pi_old pi / sg(pi^2)):

      A >= 0:  loss_t = -A (p / sg(p)) / sg(p)      value -A / p,  d/dlogp = -A / r  (0 where r > 1 + eps_high)
      A <  0:  loss_t = -A max(r, 1 - eps_low)      the PPO term,  d/dlogp = -A r    (0 where r < 1 - eps_low)

so a positive token that the update has already made likelier (r > 1) is pushed less, and one it made
less likely (r < 1) more. Soft dual clipping (c = 3) bounds both sides without cutting the gradient: where
the weight would pass c (A >= 0: 1/p > c; A < 0: max(r, 1 - eps_low) > c), loss_t = -A c logp_t, so
d/dlogp = -A c. Archer2.0 also widens the clip ranges (0.4) for each answer's top-20% entropy tokens; that
is a separate entropy-aware clipping, not the flip, and is not done here (one eps_low / eps_high for all tokens).

The kernel (:func:`policy_loss`) takes per-answer advantages and computes the policy term for the four
ratios, RATIO a constexpr: 0 token ratios (PPO/GRPO/DAPO), 1 sequence ratio (GSPO), 2 no ratio (GPG),
3 token ratios flipped where A >= 0 (ASPO), writing each row's loss and every token's gradient in one pass.
The BROKEN constexpr's values are the bugs the tests must catch: 1 drops GSPO's 1/|o_i| exponent, 2 widens
the lower clip bound with eps_high (clip-higher applied to negative advantages), 3 flips the ratio of
negative-advantage tokens too, 4 drops ASPO's stop-gradient (the flipped ratio's own derivative, +A/r, then
pushes a positive token down).

``python -m kernels.rl.dapo --arms A .. --seeds S ..`` trains the SFT checkpoint once per arm and seed (GRPO
baseline, each DAPO change alone, the full DAPO recipe, GSPO, GPG, ASPO) and writes
models/rl/dapo/<arm>/seed<S>/{log.csv, metrics.json}; ``--sweep`` runs the baseline's step-size check instead
(models/rl/dapo/lr_sweep/seed<S>.json).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable
from tqdm import tqdm

from kernels import runtime
from kernels.rl import sft, task
from kernels.rl.grpo import aggregation_weights, group_advantages
from kernels.rl.ppo import kl_estimate_ref

RATIOS = {"token": 0, "sequence": 1, "none": 2, "aspo": 3}
BROKEN = {None: 0, "no_length_exponent": 1, "clip_higher_on_negative": 2, "flip_on_negative": 3,
          "no_stop_gradient": 4}
DUAL_CLIP = 3.0            # ASPO's soft dual-clip bound c (Archer2.0's positive_/negative_clip_ratio_c)
TILE = 2048                # elements per program: BLOCK_B rows x BLOCK_T tokens
L_CACHE = 2                # the soft zone of the overlong shaping, in tokens
L_MAX = task.MAX_ANSWER + L_CACHE   # the generation budget of every arm: the answer's 4 tokens + the soft zone
OUT_DIR = sft.OUT_DIR / "dapo"


# ---------------------------------------------------------------- rewards and advantages

def overlong_penalty_ref(lengths: torch.Tensor, l_max: int, l_cache: int) -> torch.Tensor:
    """DAPO's soft overlong punishment R_len(|y|) for lengths (B,) (a length > l_max means truncated)."""
    if not 0 < l_cache <= l_max:
        raise ValueError(f"overlong_penalty_ref: need 0 < l_cache <= l_max, got {l_cache}, {l_max}")
    n = lengths.float()
    soft = ((l_max - l_cache) - n) / l_cache                                  # in (-1, 0) inside the zone
    return torch.where(n <= l_max - l_cache, torch.zeros_like(n), torch.where(n <= l_max, soft, -torch.ones_like(n)))


def completion_lengths(completions: torch.Tensor) -> torch.Tensor:
    """Tokens up to and including the first END; a row without END (truncated) counts as its width + 1."""
    has_end = (completions == task.END).any(1)
    n = task.completion_mask(completions).sum(1).long()
    return torch.where(has_end, n, torch.full_like(n, completions.shape[1] + 1))


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(P,) True where a group's rewards are not all equal (DAPO's 0 < #correct < G for 0/1 rewards)."""
    r = rewards.view(-1, group_size)
    return (r != r[:, :1]).any(1)


def gpg_advantages_ref(rewards: torch.Tensor, group_size: int, f_norm: float = 1.0) -> torch.Tensor:
    """GPG: alpha (r - group mean) / F_norm with alpha = B / (B - M), M answers in all-equal groups. (B,)."""
    r = rewards.float().view(-1, group_size)
    dead = (~informative_groups(rewards, group_size)).sum() * group_size          # M
    B = r.numel()
    alpha = B / max(B - int(dead), 1)
    return (alpha * (r - r.mean(1, keepdim=True)) / f_norm).reshape(-1)


# ---------------------------------------------------------------- the loss: reference

def policy_loss_ref(logp, old_logp, advantages, weights, mask, *, ratio="token", eps_low=0.2, eps_high=0.28,
                    dual_clip=DUAL_CLIP):
    """The policy term in PyTorch (autograd does the gradients).

    logp, old_logp, weights, mask: (B, T); advantages: (B,) one per answer. Padding (mask 0) never
    enters, whatever its values. ``ratio``: "token" (PPO/GRPO/DAPO), "sequence" (GSPO), "none" (GPG),
    "aspo" (token ratios, flipped where A >= 0, soft dual clip ``dual_clip`` on both sides)."""
    if ratio not in RATIOS:
        raise ValueError(f"ratio must be one of {tuple(RATIOS)}, got {ratio!r}")
    m = mask > 0
    A = advantages[:, None]                                                    # (B, 1)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    zero = torch.zeros_like(logp)
    if ratio == "none":
        per_token = -A * logp                                                  # GPG: -A log pi
        return torch.where(m, weights * per_token, zero).sum()
    if ratio == "token":
        r = torch.exp(torch.where(m, logp - old_logp, zero))                  # r_t = pi / pi_old
        pg = torch.maximum(-A * r, -A * r.clamp(lo, hi))
        return torch.where(m, weights * pg, zero).sum()
    if ratio == "aspo":
        lp = torch.where(m, logp, zero)
        r = torch.exp(torch.where(m, logp - old_logp, zero))                  # r_t = pi / pi_old
        c = dual_clip
        rn = r.clamp(min=lo)                                                   # A < 0: the PPO side, max(r, 1 - eps_low)
        neg = torch.where(rn > c, -A * c * lp, -A * rn)                        # soft dual clip: value c, gradient -A c
        p = r.clamp(max=hi)                                                    # A >= 0: p = min(r, 1 + eps_high)
        flip = (p / p.detach()) / p.detach()                                   # value 1/p, d/dlogp = 1/r: sg where ASPO puts it
        pos = torch.where(1.0 / p > c, -A * c * lp, -A * flip)                 # soft dual clip of the flipped weight
        pg = torch.where(A < 0, neg, pos)
        return torch.where(m, weights * pg, zero).sum()
    n = m.sum(1).clamp_min(1)                                                  # |o_i|
    s = torch.exp(torch.where(m, logp - old_logp, zero).sum(1) / n)           # s_i = exp(mean_t log r_t)
    pg = torch.maximum(-advantages * s, -advantages * s.clamp(lo, hi))         # (B,) per answer
    c = torch.where(m, weights, zero).sum(1)                                   # the answer's weight
    return (c * pg).sum()


# ---------------------------------------------------------------- the loss: kernel

@triton.jit
def _policy_loss_kernel(
    logp_ptr, old_ptr, w_ptr, mask_ptr, adv_ptr,                  # (B, T) rows with strides; adv (B,)
    loss_ptr, clipped_ptr, dlogp_ptr,                             # (B,), (B,), (B, T) contiguous outputs
    B, T, s_logp, s_old, s_w, s_mask, eps_low, eps_high, dual_clip,
    BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, RATIO: tl.constexpr, BROKEN: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    a = tl.load(adv_ptr + rows, mask=row_ok, other=0.0)          # A_i
    lo = 1.0 - eps_low
    if BROKEN == 2:
        lo = 1.0 - eps_high                                      # broken: the wider range on the negative side
    hi = 1.0 + eps_high
    cols0 = tl.arange(0, BLOCK_T)
    if RATIO == 1:
        # pass 1: sum_t log r_t, |o_i| and the answer's weight
        acc = tl.zeros((BLOCK_B,), tl.float32)
        n = tl.zeros((BLOCK_B,), tl.float32)
        c = tl.zeros((BLOCK_B,), tl.float32)
        for t0 in range(0, T, BLOCK_T):
            cols = t0 + cols0
            ok = row_ok[:, None] & (cols < T)[None, :]
            m = tl.load(mask_ptr + rows[:, None] * s_mask + cols[None, :], mask=ok, other=0.0) > 0
            lp = tl.load(logp_ptr + rows[:, None] * s_logp + cols[None, :], mask=ok, other=0.0)
            od = tl.load(old_ptr + rows[:, None] * s_old + cols[None, :], mask=ok, other=0.0)
            w = tl.load(w_ptr + rows[:, None] * s_w + cols[None, :], mask=ok, other=0.0)
            acc += tl.sum(tl.where(m, lp - od, 0.0), axis=1)
            n += tl.sum(tl.where(m, 1.0, 0.0), axis=1)
            c += tl.sum(tl.where(m, w, 0.0), axis=1)
        n = tl.maximum(n, 1.0)
        if BROKEN == 1:
            s = tl.exp(acc)                                      # broken: the full ratio, no 1/|o_i|
            inv_n = tl.full((BLOCK_B,), 1.0, tl.float32)
        else:
            s = tl.exp(acc / n)                                  # s_i = exp(mean_t log r_t)
            inv_n = 1.0 / n
        s1 = -a * s
        s2 = -a * tl.minimum(tl.maximum(s, lo), hi)
        tl.store(loss_ptr + rows, c * tl.maximum(s1, s2), mask=row_ok)
        tl.store(clipped_ptr + rows, tl.where(s2 > s1, n, 0.0), mask=row_ok)
        d_row = c * tl.where(s1 >= s2, s1, 0.0) * inv_n          # d loss_i / d logp_{i,t} = -c A s / |o_i|
        # pass 2: every real token of the answer gets the row's gradient
        for t0 in range(0, T, BLOCK_T):
            cols = t0 + cols0
            ok = row_ok[:, None] & (cols < T)[None, :]
            m = tl.load(mask_ptr + rows[:, None] * s_mask + cols[None, :], mask=ok, other=0.0) > 0
            d = tl.where(m, d_row[:, None], 0.0)
            tl.store(dlogp_ptr + rows[:, None] * T + cols[None, :], d, mask=ok)
    else:
        loss = tl.zeros((BLOCK_B,), tl.float32)
        clipped = tl.zeros((BLOCK_B,), tl.float32)
        for t0 in range(0, T, BLOCK_T):
            cols = t0 + cols0
            ok = row_ok[:, None] & (cols < T)[None, :]
            m = tl.load(mask_ptr + rows[:, None] * s_mask + cols[None, :], mask=ok, other=0.0) > 0
            lp = tl.load(logp_ptr + rows[:, None] * s_logp + cols[None, :], mask=ok, other=0.0)
            w = tl.load(w_ptr + rows[:, None] * s_w + cols[None, :], mask=ok, other=0.0)
            if RATIO == 0:
                od = tl.load(old_ptr + rows[:, None] * s_old + cols[None, :], mask=ok, other=0.0)
                r = tl.exp(tl.where(m, lp - od, 0.0))            # r_t = pi / pi_old
                s1 = -a[:, None] * r
                s2 = -a[:, None] * tl.minimum(tl.maximum(r, lo), hi)
                pg = tl.maximum(s1, s2)
                d = tl.where(s1 >= s2, s1, 0.0)                  # the clipped term is constant in logp
                clipped += tl.sum(tl.where(m & (s2 > s1), 1.0, 0.0), axis=1)
            elif RATIO == 3:
                od = tl.load(old_ptr + rows[:, None] * s_old + cols[None, :], mask=ok, other=0.0)
                r = tl.exp(tl.where(m, lp - od, 0.0))            # r_t = pi / pi_old
                lpz = tl.where(m, lp, 0.0)
                A2 = a[:, None] + tl.zeros((BLOCK_B, BLOCK_T), tl.float32)
                neg = A2 < 0
                if BROKEN == 3:
                    neg = A2 != A2                               # broken: the flip on negative advantages too
                # A < 0: PPO's term, max(r, 1 - eps_low); soft dual clip above c (value c, gradient -A c)
                rn = tl.maximum(r, lo)
                n_dual = rn > dual_clip
                pg_n = tl.where(n_dual, -A2 * dual_clip * lpz, -A2 * rn)
                d_n = tl.where(n_dual, -A2 * dual_clip, tl.where(r >= lo, -A2 * r, 0.0))
                # A >= 0: the flipped weight 1/p, p = min(r, 1 + eps_high); soft dual clip where 1/p > c
                p = tl.minimum(r, hi)
                inv = 1.0 / p
                p_dual = inv > dual_clip
                pg_p = tl.where(p_dual, -A2 * dual_clip * lpz, -A2 * inv)
                if BROKEN == 4:
                    d_flip = A2 * inv                            # broken: d(-A/r)/dlogp, no stop-gradient
                else:
                    d_flip = -A2 * inv                           # -A (p / sg p) / sg p: d/dlogp = -A / r
                d_p = tl.where(p_dual, -A2 * dual_clip, tl.where(r <= hi, d_flip, 0.0))
                pg = tl.where(neg, pg_n, pg_p)
                d = tl.where(neg, d_n, d_p)
                masked = tl.where(neg, r < lo, (A2 > 0) & (r > hi))   # hard-clipped tokens (A != 0): no gradient
                clipped += tl.sum(tl.where(m & masked, 1.0, 0.0), axis=1)
            else:
                pg = -a[:, None] * lp                            # GPG: -A log pi, no ratio, no clip
                d = -a[:, None] + tl.zeros((BLOCK_B, BLOCK_T), tl.float32)
            loss += tl.sum(tl.where(m, w * pg, 0.0), axis=1)
            tl.store(dlogp_ptr + rows[:, None] * T + cols[None, :], tl.where(m, w * d, 0.0), mask=ok)
        tl.store(loss_ptr + rows, loss, mask=row_ok)
        tl.store(clipped_ptr + rows, clipped, mask=row_ok)


def _blocks(B: int, T: int) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_T): a row chunk of at most 1024 tokens, and as many rows as fill TILE elements."""
    bt = min(1024, triton.next_power_of_2(max(T, 1)))
    bb = max(1, min(triton.next_power_of_2(max(B, 1)), TILE // bt))
    return bb, bt


def _loss_args(t: dict, out: dict, B: int, T: int, opts: dict, broken: int):
    """(grid, args, kwargs) of the launch; shared by :func:`_launch` and :func:`aot_job`."""
    bb, bt = _blocks(B, T)
    args = (t["logp"], t["old"], t["w"], t["mask"], t["adv"], out["loss"], out["clipped"], out["dlogp"],
            B, T, t["logp"].stride(0), t["old"].stride(0), t["w"].stride(0), t["mask"].stride(0),
            opts["eps_low"], opts["eps_high"], opts.get("dual_clip", DUAL_CLIP))
    return (triton.cdiv(B, bb),), args, dict(BLOCK_B=bb, BLOCK_T=bt, RATIO=RATIOS[opts["ratio"]], BROKEN=broken,
                                             num_warps=4)


def _launch(t: dict, opts: dict, broken: int) -> dict:
    B, T = t["logp"].shape
    dev = t["logp"].device
    out = {"loss": torch.empty(B, dtype=torch.float32, device=dev),
           "clipped": torch.empty(B, dtype=torch.float32, device=dev),
           "dlogp": torch.empty(B, T, dtype=torch.float32, device=dev)}
    if B and T:
        grid, args, kwargs = _loss_args(t, out, B, T, opts, broken)
        _policy_loss_kernel[grid](*args, **kwargs)
    else:
        out["loss"].zero_(), out["clipped"].zero_(), out["dlogp"].zero_()
    return out


def aot_job(ratio: str = "token", prompts: int = 512, group_size: int = 16, tokens: int = 8192):
    """The launch :func:`policy_loss` makes for prompts x group_size answers of ``tokens`` tokens, from meta
    tensors through :func:`kernels.inspect.launch_job` (Triton's own specialisation)."""
    from kernels import inspect as ki

    B = prompts * group_size
    x = torch.empty(B, tokens, dtype=torch.float32, device="meta")            # (B, T) every per-token input
    a = torch.empty(B, dtype=torch.float32, device="meta")                    # (B,) advantages, row outputs
    t = {"logp": x, "old": x, "w": x, "mask": x, "adv": a}
    grid, args, kwargs = _loss_args(t, {"loss": a, "clipped": a, "dlogp": x}, B, tokens,
                                    {"eps_low": 0.2, "eps_high": 0.28, "ratio": ratio, "dual_clip": DUAL_CLIP}, 0)
    return ki.launch_job(_policy_loss_kernel, *args, grid=grid, **kwargs)


class _PolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, t, opts, broken):
        out = _launch(t, opts, broken)
        ctx.save_for_backward(out["dlogp"])
        ctx.stats = out
        return out["loss"].sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (dlogp,) = ctx.saved_tensors
        return grad_out * dlogp, None, None, None


def policy_loss(logp, old_logp, advantages, weights, mask, *, ratio="token", eps_low=0.2, eps_high=0.28,
                dual_clip=None, broken=None, return_stats=False):
    """:func:`policy_loss_ref` as a Triton kernel, differentiable in ``logp``. (B, T) inputs may be row
    views (last-dimension stride 1); ``broken`` is one of the deliberately wrong variants in BROKEN;
    ``dual_clip`` (ASPO only; default DUAL_CLIP) is the soft dual-clip bound c > 1.
    ``return_stats`` adds {"clip_fraction"}: the share of real tokens whose term was clipped (for ASPO:
    hard-clipped, gradient 0; dual-clipped tokens keep their gradient and are not counted)."""
    name = "policy_loss"
    if ratio not in RATIOS:
        raise ValueError(f"{name}: ratio must be one of {tuple(RATIOS)}, got {ratio!r}")
    if broken not in BROKEN:
        raise ValueError(f"{name}: broken must be one of {tuple(BROKEN)}, got {broken!r}")
    if not (0 <= eps_low < 1) or eps_high < 0:
        raise ValueError(f"{name}: eps_low must be in [0, 1) and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and ratio != "aspo":
        raise ValueError(f"{name}: dual_clip applies to ratio='aspo' only, got ratio={ratio!r}")
    dual_clip = DUAL_CLIP if dual_clip is None else float(dual_clip)
    if not dual_clip > 1.0:
        raise ValueError(f"{name}: dual_clip must be > 1, got {dual_clip}")
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        raise ValueError(f"{name}: logp must be a (B, T) tensor")
    B, T = logp.shape
    t = {}
    for k, v in (("logp", logp), ("old", old_logp), ("w", weights), ("mask", mask)):
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            raise TypeError(f"{name}: {k} must be a float32 tensor")
        if v.shape != (B, T):
            raise ValueError(f"{name}: {k} has shape {tuple(v.shape)}, logp has {(B, T)}")
        if v.device.type != runtime.device().type:
            raise ValueError(f"{name}: {k} is on {v.device}; kernels run on {runtime.device()}")
        v = v.detach()
        t[k] = v if (T <= 1 or v.stride(1) == 1) else v.contiguous()
    if not isinstance(advantages, torch.Tensor) or advantages.shape != (B,) or not advantages.dtype.is_floating_point:
        raise ValueError(f"{name}: advantages must be a floating-point (B,) = ({B},) tensor, one per answer")
    t["adv"] = advantages.detach().float().contiguous()
    opts = {"eps_low": float(eps_low), "eps_high": float(eps_high), "ratio": ratio, "dual_clip": dual_clip}
    loss = _PolicyLoss.apply(logp, t, opts, BROKEN[broken])
    if not return_stats:
        return loss
    out = loss.grad_fn.stats if loss.grad_fn is not None else _launch(t, opts, BROKEN[broken])
    real = float((mask > 0).sum().clamp_min(1))
    return loss, {"clip_fraction": float(out["clipped"].sum()) / real}


# ---------------------------------------------------------------- the runs

ARMS = {
    # name: (what changes against the GRPO baseline); every arm runs the same seeds, prompts and budget
    "grpo": {},
    "no_kl": {"beta": 0.0},
    "clip_higher": {"eps_high": 0.28},
    "token_loss": {"aggregation": "token"},
    "dynamic_sampling": {"dynamic": True},
    "overlong_filter": {"overlong_filter": True},
    "overlong_shaping": {"overlong": True},
    # DAPO as the paper trains it: all four changes at once and no KL term (DAPO section 2.3)
    "dapo": {"eps_high": 0.28, "aggregation": "token", "dynamic": True, "overlong": True, "beta": 0.0},
    "gspo": {"ratio": "sequence", "eps_low": 3e-4, "eps_high": 4e-4},
    "aspo": {"ratio": "aspo"},
    "gpg": {"ratio": "none", "aggregation": "token", "beta": 0.0, "advantage": "gpg"},
}
BASE = {"eps_low": 0.2, "eps_high": 0.2, "aggregation": "sequence", "beta": 0.04, "ratio": "token",
        "dynamic": False, "overlong": False, "overlong_filter": False, "advantage": "grpo"}
LR = 2e-5                  # the baseline's step-size check (the chapter): 1e-4, with or without warm-up, lowers the score
WARMUP = 5                 # linear warm-up steps
SEEDS = (0, 1, 2)
STEPS = 30
PROMPTS = 16
EVAL_EVERY = 10


def sample(policy, pairs: torch.Tensor, group_size: int, gen: torch.Generator, l_max: int = L_MAX) -> dict:
    """G answers of up to ``l_max`` tokens for each pair, at temperature 1: completions, mask, rewards, lengths."""
    rep = pairs.repeat_interleave(group_size, 0)                              # (P*G, 2)
    was = policy.training
    policy.eval()
    with torch.no_grad():
        comp = policy.generate(task.prompts(rep), l_max, temperature=1.0, generator=gen)[:, task.PROMPT_LEN:]
    policy.train(was)
    return {"pairs": rep, "completions": comp, "mask": task.completion_mask(comp),
            "rewards": task.rewards(comp, rep), "lengths": completion_lengths(comp)}


HELD_OUT_SAMPLES = 4       # sampled answers per held-out prompt for the sampled score (2000 answers)


def held_out_scores(policy, held_out: torch.Tensor) -> dict:
    """Greedy accuracy on the 500 held-out prompts, and the mean reward of HELD_OUT_SAMPLES answers per prompt
    sampled at temperature 1 from a fixed generator (the same random stream at every evaluation)."""
    gen = torch.Generator().manual_seed(1234)
    rep = held_out.repeat_interleave(HELD_OUT_SAMPLES, 0)
    sampled = task.rewards(task.sample(policy, rep, temperature=1.0, generator=gen), rep).mean()
    return {"held_out_accuracy": task.accuracy(policy, held_out), "held_out_sampled": round(float(sampled), 5)}


@torch.no_grad()
def token_entropy(policy, completions: torch.Tensor, pairs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over real completion tokens of H_t = -sum_v pi(v | prefix) log pi(v | prefix), the whole
    next-byte distribution (not the sampled token's -log pi): what clip-higher and ASPO exist to protect."""
    seqs = torch.cat([task.prompts(pairs), completions], dim=1)               # (B, P + L)
    hidden = policy(seqs[:, :-1], return_hidden=True)[:, task.PROMPT_LEN - 1:]  # (B, L, C)
    logp = torch.log_softmax(hidden @ policy.wte.weight.T, -1)                # (B, L, V)
    h = -(logp.exp() * logp).sum(-1)                                          # (B, L)
    return float((h * mask).sum() / mask.sum().clamp_min(1))


def _cat(batches: list[dict]) -> dict:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def _take_groups(ro: dict, keep: torch.Tensor, group_size: int) -> dict:
    idx = keep.nonzero().flatten()
    rows = (idx[:, None] * group_size + torch.arange(group_size)).flatten()
    return {k: v[rows] for k, v in ro.items()}


def _rollouts(policy, train_pairs, cfg: dict, prompts_per_step: int, group_size: int, max_rounds: int,
              gen: torch.Generator) -> tuple[dict, int, int]:
    """One step's rollouts: (rollouts, groups kept, prompts drawn). With dynamic sampling, groups whose rewards
    are all equal are dropped and more prompts drawn, at most ``max_rounds`` times, until the batch is full."""
    batches, kept, drawn, rounds = [], 0, 0, 0
    while True:
        pick = train_pairs[torch.randint(0, len(train_pairs), (prompts_per_step,), generator=gen)]
        ro = sample(policy, pick, group_size, gen)
        rounds += 1
        drawn += prompts_per_step
        if not cfg["dynamic"]:
            return ro, prompts_per_step, drawn
        good = informative_groups(ro["rewards"], group_size)
        batches.append(_take_groups(ro, good, group_size))
        kept += int(good.sum())
        if kept >= prompts_per_step or rounds >= max_rounds:
            break
    ro = _cat(batches)
    if kept > prompts_per_step:                                               # refill to exactly the batch size
        ro = {k: v[: prompts_per_step * group_size] for k, v in ro.items()}
        kept = prompts_per_step
    return ro, kept, drawn


def train_arm(arm: str, out_dir: Path | None, *, steps: int = STEPS, prompts_per_step: int = PROMPTS,
              group_size: int = 8, inner_steps: int = 2, lr: float = LR, warmup: int = WARMUP,
              eval_every: int = EVAL_EVERY, max_rounds: int = 6, seed: int = 0, threads: int = 1,
              progress: bool = True, stop_after: int | None = None) -> dict:
    """One arm from the SFT checkpoint; same seed, prompts and budget as every other arm. Returns {"log", "model"}.

    The learning rate rises linearly over ``warmup`` steps to ``lr`` and stays there; the held-out score
    (greedy, 500 prompts) is logged before the first step (step 0) and every ``eval_every`` steps, except in a
    partial run (``stop_after``, the tests' and the chapter's re-run of a first step), which evaluates nothing."""
    cfg = dict(BASE, **ARMS[arm])
    policy, reference = sft.policy_and_reference(seed, threads)
    train_pairs, held_out = task.split_pairs()
    gen = torch.Generator().manual_seed(seed)
    opt = sft.adamw(policy.parameters(), lr)
    evaluate = stop_after is None                                             # a partial run (tests) skips them
    log = [{"step": 0, "reward": "", "entropy": "", "kl": "", "clip_fraction": "", "prompts_drawn": 0,
            "groups_used": 0, "rollouts_wasted": 0, "overlong_fraction": "",
            **(held_out_scores(policy, held_out) if evaluate else {"held_out_accuracy": "", "held_out_sampled": ""})}]
    start = time.perf_counter()
    bar = tqdm(range(1, (stop_after or steps) + 1), desc=arm, disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, step / max(warmup, 1))                # linear warm-up, then constant
        ro, kept, drawn = _rollouts(policy, train_pairs, cfg, prompts_per_step, group_size, max_rounds, gen)
        task_reward = ro["rewards"]
        shaped = task_reward + (overlong_penalty_ref(ro["lengths"], L_MAX, L_CACHE) if cfg["overlong"] else 0.0)
        if cfg["advantage"] == "gpg":
            adv = gpg_advantages_ref(shaped, group_size)
        else:
            adv = group_advantages(shaped, group_size) if len(shaped) else shaped
        mask = ro["mask"]
        if cfg["overlong_filter"]:                                            # truncated answers leave the loss
            mask = mask * (ro["lengths"] <= L_MAX).float()[:, None]
        w = aggregation_weights(mask, cfg["aggregation"])
        with torch.no_grad():
            old = task.completion_logprobs(policy, ro["completions"], ro["pairs"])
            ref = task.completion_logprobs(reference, ro["completions"], ro["pairs"]) if cfg["beta"] else None
        stats = {"clip_fraction": 0.0}
        kl = 0.0
        entropy = token_entropy(policy, ro["completions"], ro["pairs"], ro["mask"]) if len(shaped) else float("nan")
        if len(shaped):
            for _ in range(inner_steps):
                logp = task.completion_logprobs(policy, ro["completions"], ro["pairs"])
                loss, stats = policy_loss(logp, old, adv, w, mask, ratio=cfg["ratio"], eps_low=cfg["eps_low"],
                                          eps_high=cfg["eps_high"], return_stats=True)
                if cfg["beta"]:
                    k3 = torch.where(mask > 0, kl_estimate_ref(logp, ref, "k3"), torch.zeros_like(logp))
                    loss = loss + cfg["beta"] * (w * k3).sum()
                    kl = float((mask * k3.detach()).sum() / mask.sum().clamp_min(1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
        row = {"step": step, "reward": round(float(task_reward.mean()), 5) if len(task_reward) else "",
               "entropy": round(entropy, 5) if len(shaped) else "",
               "kl": round(kl, 6), "clip_fraction": round(stats["clip_fraction"], 5),
               "prompts_drawn": drawn, "groups_used": kept, "rollouts_wasted": (drawn - kept) * group_size,
               "overlong_fraction": round(float((ro["lengths"] > task.MAX_ANSWER).float().mean()), 5) if len(shaped) else "",
               "held_out_accuracy": "", "held_out_sampled": ""}
        if evaluate and (step % eval_every == 0 or step == steps):
            row.update(held_out_scores(policy, held_out))
        log.append(row)
        bar.set_postfix(reward=row["reward"], held_out=row["held_out_accuracy"])
    policy.eval()
    seconds = round(time.perf_counter() - start, 1)
    if out_dir is not None:
        sft.save_run(out_dir, policy, log, dict(cfg, arm=arm, steps=steps, prompts_per_step=prompts_per_step,
                                                group_size=group_size, inner_steps=inner_steps, lr=lr, warmup=warmup,
                                                max_rounds=max_rounds, l_max=L_MAX, l_cache=L_CACHE, seed=seed,
                                                threads=threads, train_seconds=seconds, torch=torch.__version__,
                                                command=f"python -m kernels.rl.dapo --arms {arm} --seeds {seed}"
                                                + (f" --prompts {prompts_per_step} --steps {steps}"
                                                   if (prompts_per_step, steps) != (PROMPTS, STEPS) else "")),
                     checkpoint=False)
    return {"log": log, "model": policy, "seconds": seconds}


SWEEP = ((1e-4, 1), (1e-4, WARMUP))   # (lr, warm-up steps) beside the chosen LR: the old setting, then with warm-up


def sweep_lr(out: Path, seed: int, settings=SWEEP) -> None:
    """The baseline's step-size check: the GRPO arm at each (lr, warm-up) of ``settings`` (the chosen LR is the
    ``grpo`` arm itself), held-out score every EVAL_EVERY steps; writes <out>/lr_sweep/seed<seed>.json."""
    rows = []
    for lr, wu in settings:
        run = train_arm("grpo", None, lr=lr, warmup=wu, seed=seed, progress=False)
        rows.append({"lr": lr, "warmup": wu, "seed": seed, "seconds": run["seconds"],
                     "curve": [(r["step"], r["held_out_accuracy"]) for r in run["log"] if r["held_out_accuracy"] != ""],
                     "reward": [r["reward"] for r in run["log"][1:]]})
        print(lr, wu, seed, rows[-1]["curve"], flush=True)
    (out / "lr_sweep").mkdir(parents=True, exist_ok=True)
    (out / "lr_sweep" / f"seed{seed}.json").write_text(json.dumps(
        {"steps": STEPS, "prompts_per_step": PROMPTS, "runs": rows,
         "command": f"python -m kernels.rl.dapo --sweep --seeds {seed}"}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.rl.dapo", description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--sweep", action="store_true", help="the baseline's learning-rate sweep instead of the arms")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--prompts", type=int, default=PROMPTS, help="training prompts per step (8 answers each)")
    p.add_argument("--steps", type=int, default=STEPS)
    args = p.parse_args(argv)
    if args.sweep:
        for seed in args.seeds:
            sweep_lr(args.out, seed)
        return 0
    for arm in args.arms:
        for seed in args.seeds:
            train_arm(arm, args.out / arm / f"seed{seed}", seed=seed, prompts_per_step=args.prompts, steps=args.steps,
                      progress=False)
            print(arm, seed, json.loads((args.out / arm / f"seed{seed}" / "metrics.json").read_text())["held_out_accuracy"],
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def compile_jobs() -> dict:
    """The policy loss for 512 prompts x 16 answers x 8192 tokens with each ratio."""
    return {f"policy loss, {r} ratio, 512 x 16 answers x 8192 tokens": aot_job(r) for r in RATIOS}
