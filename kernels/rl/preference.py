"""Preference losses without a reward model: DPO, IPO, SimPO and KTO, one fused kernel over pairs.

Each pair has the policy's summed log-probs of the chosen and rejected completions (pc, pr), the
frozen reference's (qc, qr) and the completions' lengths (lc, lr). With the log-ratios
rc = pc - qc and rr = pr - qr (the implicit rewards divided by beta):

    DPO   (Rafailov et al. 2023)   h = beta (rc - rr),                   loss = -log sigma(h)
    IPO   (Azar et al. 2024)       h = rc - rr,                          loss = (h - 1 / (2 beta))^2
    SimPO (Meng et al. 2024)       h = beta (pc / lc - pr / lr) - gamma, loss = -log sigma(h)   (no reference)
    KTO   (Ethayarajh et al. 2024) loss = (1 - sigma(beta (rc - z0))) + (1 - sigma(beta (z0 - rr)))

KTO scores each completion alone against z0, an estimate of KL(pi || pi_ref) taken over the batch and
not differentiated (here: max(0, mean of the batch's log-ratios), a cruder estimate than the paper's
mismatched pairs; the chosen completion is the desirable example, the rejected one the undesirable).
The kernel writes each pair's loss and its gradients in pc and pr in one pass; the losses are averaged
over pairs. Broken variants for the tests: USE_REF=False drops the reference log-probs (DPO, IPO, KTO),
NORMALIZE=False makes SimPO use summed instead of length-averaged log-probs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels import runtime

KINDS = {"dpo": 0, "ipo": 1, "simpo": 2, "kto": 3}
BLOCK = 1024


def kto_reference_point(pc, pr, qc, qr) -> torch.Tensor:
    """z0 = max(0, mean log-ratio over the batch's completions), detached."""
    return torch.cat([pc - qc, pr - qr]).detach().mean().clamp_min(0.0)


def preference_loss_ref(kind, pc, pr, qc, qr, lc, lr, *, beta=0.1, gamma=0.5):
    """Mean over pairs of the ``kind`` loss above, in PyTorch; all arguments (P,) float."""
    if kind == "dpo":
        return -F.logsigmoid(beta * ((pc - qc) - (pr - qr))).mean()
    if kind == "ipo":
        return (((pc - qc) - (pr - qr)) - 1 / (2 * beta)).pow(2).mean()
    if kind == "simpo":
        return -F.logsigmoid(beta * (pc / lc - pr / lr) - gamma).mean()
    if kind == "kto":
        z0 = kto_reference_point(pc, pr, qc, qr)
        return ((1 - torch.sigmoid(beta * ((pc - qc) - z0))) + (1 - torch.sigmoid(beta * (z0 - (pr - qr))))).mean()
    raise ValueError(f"kind must be one of {tuple(KINDS)}, got {kind!r}")


@triton.jit
def _log_sigmoid(x):
    """log sigma(x) = min(x, 0) - log(1 + exp(-|x|)), without overflow for either sign."""
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _preference_kernel(pc_ptr, pr_ptr, qc_ptr, qr_ptr, lc_ptr, lr_ptr,   # (P,) each
                       loss_ptr, dpc_ptr, dpr_ptr,                         # (P,) outputs
                       P, beta, gamma, z0, scale,                          # scale = 1 / P (the mean)
                       BLOCK: tl.constexpr, KIND: tl.constexpr,
                       USE_REF: tl.constexpr = True, NORMALIZE: tl.constexpr = True):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < P
    pc = tl.load(pc_ptr + offs, mask=ok, other=0.0)
    pr = tl.load(pr_ptr + offs, mask=ok, other=0.0)
    rc = pc
    rr = pr
    if USE_REF:
        rc = pc - tl.load(qc_ptr + offs, mask=ok, other=0.0)     # log pi/pi_ref of the chosen
        rr = pr - tl.load(qr_ptr + offs, mask=ok, other=0.0)
    if KIND == 0:                                              # DPO: -log sigma(beta (rc - rr))
        h = beta * (rc - rr)
        loss = -_log_sigmoid(h)
        d = -beta * tl.sigmoid(-h)                             # dloss/d(rc - rr)
        dpc = d
        dpr = -d
    elif KIND == 1:                                            # IPO: (rc - rr - 1/(2 beta))^2
        e = rc - rr - 0.5 / beta
        loss = e * e
        dpc = 2.0 * e
        dpr = -2.0 * e
    elif KIND == 2:                                            # SimPO: -log sigma(beta (pc/lc - pr/lr) - gamma)
        lc = tl.load(lc_ptr + offs, mask=ok, other=1.0)
        lr = tl.load(lr_ptr + offs, mask=ok, other=1.0)
        if not NORMALIZE:
            lc = tl.full((BLOCK,), 1.0, tl.float32)
            lr = tl.full((BLOCK,), 1.0, tl.float32)
        h = beta * (pc / lc - pr / lr) - gamma
        loss = -_log_sigmoid(h)
        d = -beta * tl.sigmoid(-h)
        dpc = d / lc
        dpr = -d / lr
    else:                                                      # KTO, z0 fixed (no gradient through it)
        sc = tl.sigmoid(beta * (rc - z0))
        sr = tl.sigmoid(beta * (z0 - rr))
        loss = (1.0 - sc) + (1.0 - sr)
        dpc = -beta * sc * (1.0 - sc)
        dpr = beta * sr * (1.0 - sr)
    tl.store(loss_ptr + offs, loss * scale, mask=ok)
    tl.store(dpc_ptr + offs, dpc * scale, mask=ok)
    tl.store(dpr_ptr + offs, dpr * scale, mask=ok)


def aot_job(kind: str = "dpo"):
    """The kernel as :func:`preference_loss` launches it, for ahead-of-time compiling."""
    from kernels.inspect import TritonJob

    sig = {n: "*fp32" for n in ("pc_ptr", "pr_ptr", "qc_ptr", "qr_ptr", "lc_ptr", "lr_ptr",
                                "loss_ptr", "dpc_ptr", "dpr_ptr")}
    sig.update({"P": "i64", "beta": "fp32", "gamma": "fp32", "z0": "fp32", "scale": "fp32"})
    return TritonJob(_preference_kernel, sig, constexprs={"BLOCK": BLOCK, "KIND": KINDS[kind], "USE_REF": True,
                                                        "NORMALIZE": True}, num_warps=4)


class _PreferenceLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pc, pr, t, opts, variant):
        P = t["pc"].numel()
        loss = torch.empty(P, dtype=torch.float32, device=pc.device)
        dpc, dpr = torch.empty_like(loss), torch.empty_like(loss)
        if P:
            _preference_kernel[(triton.cdiv(P, BLOCK),)](
                t["pc"], t["pr"], t["qc"], t["qr"], t["lc"], t["lr"], loss, dpc, dpr,
                P, opts["beta"], opts["gamma"], opts["z0"], 1.0 / P, BLOCK=BLOCK, KIND=KINDS[opts["kind"]], **variant)
        ctx.save_for_backward(dpc, dpr)
        ctx.shapes = (pc.shape, pr.shape)
        return loss.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        dpc, dpr = ctx.saved_tensors
        return (grad_out * dpc).reshape(ctx.shapes[0]), (grad_out * dpr).reshape(ctx.shapes[1]), None, None, None


def preference_loss(kind, pc, pr, qc, qr, lc=None, lr=None, *, beta=0.1, gamma=0.5, use_ref=True, normalize=True):
    """:func:`preference_loss_ref` with the fused kernel, differentiable in pc and pr (the policy's
    summed log-probs, (P,) each); lc, lr (lengths) are needed by SimPO only. ``use_ref`` and
    ``normalize`` False are the broken variants."""
    name = "preference_loss"
    if kind not in KINDS:
        raise ValueError(f"{name}: kind must be one of {tuple(KINDS)}, got {kind!r}")
    if not beta > 0:
        raise ValueError(f"{name}: beta must be > 0, got {beta}")
    if kind == "simpo" and (lc is None or lr is None):
        raise ValueError(f"{name}: SimPO needs the lengths lc and lr")
    lc = torch.ones_like(pc) if lc is None else lc
    lr = torch.ones_like(pr) if lr is None else lr
    t = {}
    for k, v in (("pc", pc), ("pr", pr), ("qc", qc), ("qr", qr), ("lc", lc), ("lr", lr)):
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or not v.dtype.is_floating_point:
            raise ValueError(f"{name}: {k} must be a 1-D floating-point tensor")
        if v.shape != pc.shape:
            raise ValueError(f"{name}: {k} has shape {tuple(v.shape)}, pc has {tuple(pc.shape)}")
        if v.device.type != runtime.device().type:
            raise ValueError(f"{name}: {k} is on {v.device}; kernels run on {runtime.device()}")
        t[k] = v.detach().float().contiguous()
    if kind == "simpo" and bool((t["lc"] <= 0).any() | (t["lr"] <= 0).any()):
        raise ValueError(f"{name}: lengths must be > 0")
    z0 = float(kto_reference_point(t["pc"], t["pr"], t["qc"], t["qr"])) if kind == "kto" and use_ref else 0.0
    opts = {"kind": kind, "beta": float(beta), "gamma": float(gamma), "z0": z0}
    return _PreferenceLoss.apply(pc, pr, t, opts, {"USE_REF": bool(use_ref), "NORMALIZE": bool(normalize)})
