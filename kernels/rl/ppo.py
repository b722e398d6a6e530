"""The PPO objective per token: clipped surrogate, clipped value loss and a KL estimator, in one kernel.

For token t of a sampled completion, with r_t = pi_theta / pi_old = exp(logp_t - old_t), advantage A_t,
reference log-prob ref_t and the log-ratio u_t = ref_t - logp_t (Schulman 2017; Schulman 2020 for k1-k3):

    pg_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))        (the pessimistic bound)
    dpg_t/dlogp_t = -A_t r_t where the unclipped term is the max, else 0   (clipped tokens get no gradient)
    k1 = -u,    k2 = u^2 / 2,    k3 = e^u - 1 - u                          (estimators of KL(pi_theta || pi_ref))
    dk1/dlogp = 1,   dk2/dlogp = -u,   dk3/dlogp = 1 - e^u
    vf_t = max((V_t - R_t)^2, (V_old + clip(V_t - V_old, -c, c) - R_t)^2) / 2

The loss is sum_t w_t (pg_t + beta k_t + vf_coef vf_t), where the weights w (B, T) say how tokens are
averaged (token mean, per-sequence mean: kernels.rl.grpo.aggregation_weights). The kernel reads each
token's inputs once and writes its loss terms and both gradients in the same pass, so backward is a
multiply by the incoming scalar. Constexpr switches give the broken variants the tests must catch:
PESSIMISTIC=False takes the min of the two terms (the clip on the wrong side), REF_KL=False measures the
KL against pi_old instead of pi_ref (the reference model's log-probs forgotten).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels import runtime

KL_ESTIMATORS = {"k1": 1, "k2": 2, "k3": 3}
BLOCK = 1024          # tokens per program: elementwise work, 8 values a thread at 4 warps


def kl_estimate_ref(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimator of KL(pi || pi_ref) from samples of pi, u = ref_logp - logp (Schulman's note)."""
    u = ref_logp - logp
    if kind == "k1":
        return -u
    if kind == "k2":
        return 0.5 * u ** 2
    if kind == "k3":
        return torch.expm1(u) - u
    raise ValueError(f"kl must be one of {tuple(KL_ESTIMATORS)}, got {kind!r}")


def ppo_loss_ref(logp, old_logp, ref_logp, advantages, weights, *, clip_eps=0.2, clip_eps_high=None,
                 beta=0.0, kl="k3", values=None, old_values=None, returns=None, value_clip=0.2, vf_coef=0.5):
    """The objective above in PyTorch (autograd does the gradients); every tensor (B, T) fp32."""
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_eps, 1 + hi))
    per_token = pg + beta * kl_estimate_ref(logp, ref_logp, kl)
    loss = (weights * per_token).sum()
    if values is not None:
        v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        vf = 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
        loss = loss + vf_coef * (weights * vf).sum()
    return loss


@triton.jit
def _ppo_token_kernel(
    logp_ptr, old_ptr, ref_ptr, adv_ptr, w_ptr,          # (N,) each: the policy side
    v_ptr, vold_ptr, ret_ptr,                            # (N,) each: the value side (read only when VALUE)
    loss_ptr, dlogp_ptr, dv_ptr, clipped_ptr, kl_ptr,    # (N,) outputs
    N, eps_low, eps_high, beta, value_clip, vf_coef,
    BLOCK: tl.constexpr, KL: tl.constexpr, VALUE: tl.constexpr,
    PESSIMISTIC: tl.constexpr = True, REF_KL: tl.constexpr = True,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    logp = tl.load(logp_ptr + offs, mask=ok, other=0.0)
    old = tl.load(old_ptr + offs, mask=ok, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=ok, other=0.0)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    if REF_KL:
        ref = tl.load(ref_ptr + offs, mask=ok, other=0.0)
    else:
        ref = old                                        # broken: the KL to pi_old, not to pi_ref

    r = tl.exp(logp - old)                               # r_t = pi / pi_old
    s1 = -adv * r                                        # unclipped term
    s2 = -adv * tl.minimum(tl.maximum(r, 1.0 - eps_low), 1.0 + eps_high)
    if PESSIMISTIC:
        pg = tl.maximum(s1, s2)                          # pg_t = max(s1, s2)
        d_pg = tl.where(s1 >= s2, s1, 0.0)               # d s1 / dlogp = -A r; the clipped term is constant
    else:
        pg = tl.minimum(s1, s2)                          # broken: the optimistic bound
        d_pg = tl.where(s1 <= s2, s1, 0.0)

    u = ref - logp                                       # log(pi_ref / pi)
    if KL == 1:
        kl = -u
        d_kl = tl.full((BLOCK,), 1.0, tl.float32)
    elif KL == 2:
        kl = 0.5 * u * u
        d_kl = -u
    else:
        e = tl.exp(u)
        kl = e - 1.0 - u                                 # k3 >= 0 for every sample
        d_kl = 1.0 - e

    loss = w * (pg + beta * kl)
    d_logp = w * (d_pg + beta * d_kl)
    if VALUE:
        v = tl.load(v_ptr + offs, mask=ok, other=0.0)
        v_old = tl.load(vold_ptr + offs, mask=ok, other=0.0)
        ret = tl.load(ret_ptr + offs, mask=ok, other=0.0)
        delta = v - v_old
        v_clip = v_old + tl.minimum(tl.maximum(delta, -value_clip), value_clip)
        e1 = (v - ret) * (v - ret)
        e2 = (v_clip - ret) * (v_clip - ret)
        loss += vf_coef * w * 0.5 * tl.maximum(e1, e2)
        inside = (delta > -value_clip) & (delta < value_clip)
        d_v = tl.where(e1 >= e2, v - ret, tl.where(inside, v_clip - ret, 0.0))
        tl.store(dv_ptr + offs, vf_coef * w * d_v, mask=ok)
    tl.store(loss_ptr + offs, loss, mask=ok)
    tl.store(dlogp_ptr + offs, d_logp, mask=ok)
    tl.store(clipped_ptr + offs, tl.where(s2 > s1, 1.0, 0.0), mask=ok)
    tl.store(kl_ptr + offs, kl, mask=ok)


def aot_job(kl: str = "k3", value: bool = True, tokens: int = 512 * 1024):
    """The launch :func:`ppo_loss` makes over ``tokens`` flattened tokens, built from meta tensors by
    :func:`kernels.inspect.launch_job` (Triton's own specialisation of the launch)."""
    from kernels import inspect as ki

    x = torch.empty(tokens, dtype=torch.float32, device="meta")              # (N,) every per-token input
    t = {k: x for k in ("logp", "old", "ref", "adv", "w")}
    t.update({k: x if value else None for k in ("values", "old_values", "returns")})
    opts = {"eps_low": 0.2, "eps_high": 0.28, "beta": 0.04, "value_clip": 0.2, "vf_coef": 0.5, "kl": kl}
    out = {k: x for k in ("loss", "dlogp", "dv", "clipped", "kl")}
    grid, args, kwargs = _ppo_args(t, out, opts, {"PESSIMISTIC": True, "REF_KL": True})
    return ki.launch_job(_ppo_token_kernel, *args, grid=grid, **kwargs)


def _ppo_args(t: dict, out: dict, opts: dict, variant: dict):
    """(grid, args, kwargs) of the kernel's launch over the N flattened tokens; shared by :func:`_launch`
    and :func:`aot_job`. Without values the value pointers are the log-probabilities' (unused)."""
    N = t["logp"].numel()
    value = t["values"] is not None
    dummy = t["logp"]
    args = (t["logp"], t["old"], t["ref"], t["adv"], t["w"],
            t["values"] if value else dummy, t["old_values"] if value else dummy, t["returns"] if value else dummy,
            out["loss"], out["dlogp"], out["dv"], out["clipped"], out["kl"],
            N, opts["eps_low"], opts["eps_high"], opts["beta"], opts["value_clip"], opts["vf_coef"])
    return (triton.cdiv(N, BLOCK),), args, dict(BLOCK=BLOCK, KL=KL_ESTIMATORS[opts["kl"]], VALUE=value, **variant)


def _launch(t: dict, opts: dict, variant: dict) -> dict:
    """Run the kernel over the N flattened tokens; returns its (N,) outputs."""
    N = t["logp"].numel()
    out = {k: torch.empty(N, dtype=torch.float32, device=t["logp"].device)
           for k in ("loss", "dlogp", "dv", "clipped", "kl")}
    if N:
        grid, args, kwargs = _ppo_args(t, out, opts, variant)
        _ppo_token_kernel[grid](*args, **kwargs)
    return out


class _PPOLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, values, t, opts, variant):
        out = _launch(t, opts, variant)
        ctx.shape = logp.shape
        ctx.save_for_backward(out["dlogp"], out["dv"])
        ctx.has_values = values is not None
        ctx.stats = out
        return out["loss"].sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        dlogp, dv = ctx.saved_tensors
        g_v = (grad_out * dv).reshape(ctx.shape) if ctx.has_values else None
        return (grad_out * dlogp).reshape(ctx.shape), g_v, None, None, None


def _prepare(name: str, **tensors) -> dict:
    shape = tensors["logp"].shape
    out = {}
    for k, v in tensors.items():
        if v is None:
            out[k] = None
            continue
        if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
            raise TypeError(f"{name}: {k} must be a floating-point tensor")
        if v.shape != shape:
            raise ValueError(f"{name}: {k} has shape {tuple(v.shape)}, logp has {tuple(shape)}")
        if v.device.type != runtime.device().type:
            raise ValueError(f"{name}: {k} is on {v.device}; kernels run on {runtime.device()}")
        out[k] = v.detach().float().contiguous().reshape(-1)
    return out


def ppo_loss(logp, old_logp, ref_logp, advantages, weights, *, clip_eps=0.2, clip_eps_high=None, beta=0.0,
             kl="k3", values=None, old_values=None, returns=None, value_clip=0.2, vf_coef=0.5,
             return_stats=False, pessimistic=True, ref_kl=True):
    """:func:`ppo_loss_ref` with the fused kernel: differentiable in ``logp`` and ``values``.

    All tensors (B, T) (or any one shape). ``weights`` are the per-token averaging weights (zero on
    padding). ``return_stats`` also returns {"clip_fraction", "kl"} (weighted means, detached).
    ``pessimistic`` and ``ref_kl`` False are the broken variants."""
    name = "ppo_loss"
    if kl not in KL_ESTIMATORS:
        raise ValueError(f"{name}: kl must be one of {tuple(KL_ESTIMATORS)}, got {kl!r}")
    if not (0 <= clip_eps < 1) or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError(f"{name}: clip_eps must be in [0, 1) and clip_eps_high >= 0, got {clip_eps}, {clip_eps_high}")
    if (values is None) != (old_values is None) or (values is None) != (returns is None):
        raise ValueError(f"{name}: values, old_values and returns go together (all or none)")
    t = _prepare(name, logp=logp, old=old_logp, ref=ref_logp, adv=advantages, w=weights, values=values,
                 old_values=old_values, returns=returns)
    opts = {"eps_low": float(clip_eps), "eps_high": float(clip_eps if clip_eps_high is None else clip_eps_high),
            "beta": float(beta), "value_clip": float(value_clip), "vf_coef": float(vf_coef), "kl": kl}
    variant = {"PESSIMISTIC": bool(pessimistic), "REF_KL": bool(ref_kl)}
    loss = _PPOLoss.apply(logp, values, t, opts, variant)
    if not return_stats:
        return loss
    # the stats come from the same launch (kept on the autograd node); without a graph, launch again
    out = loss.grad_fn.stats if loss.grad_fn is not None else _launch(t, opts, variant)
    w = t["w"]
    total = w.sum().clamp_min(1e-12)
    return loss, {"clip_fraction": float((w * out["clipped"]).sum() / total), "kl": float((w * out["kl"]).sum() / total)}


def compile_jobs() -> dict:
    """The token loss over 512 x 1024 tokens with each KL estimator and a value head, and k3 without one."""
    jobs = {f"PPO token loss, KL {kl}, value head": aot_job(kl) for kl in KL_ESTIMATORS}
    jobs["PPO token loss, KL k3, no value head (GRPO)"] = aot_job("k3", value=False)
    return jobs
