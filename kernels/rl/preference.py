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

``python -m kernels.rl.preference`` builds pairs from the SFT model's own samples (the verifier of
kernels.rl.task labels them) and trains DPO, IPO and SimPO on them: models/rl/dpo/. With ``--kto-unpaired`` it
trains KTO on every sampled answer alone (``kto_unpaired_loss``: desirable or undesirable, weights lambda_D and
lambda_U, no pairs), three seeds, and DPO at seeds 1 and 2 beside seed 0: models/rl/dpo/kto-unpaired/.
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


def _preference_args(t: dict, loss, dpc, dpr, opts: dict, variant: dict):
    """(grid, args, kwargs) of the kernel's launch over P pairs; shared by the autograd function and
    :func:`aot_job`."""
    P = t["pc"].numel()
    args = (t["pc"], t["pr"], t["qc"], t["qr"], t["lc"], t["lr"], loss, dpc, dpr,
            P, opts["beta"], opts["gamma"], opts["z0"], 1.0 / P)
    return (triton.cdiv(P, BLOCK),), args, dict(BLOCK=BLOCK, KIND=KINDS[opts["kind"]], **variant)


def aot_job(kind: str = "dpo", pairs: int = 4096):
    """The launch :func:`preference_loss` makes for ``pairs`` pairs, built from meta tensors by
    :func:`kernels.inspect.launch_job` (Triton's own specialisation of the launch)."""
    from kernels import inspect as ki

    x = torch.empty(pairs, dtype=torch.float32, device="meta")               # (P,) every per-pair input and output
    t = {k: x for k in ("pc", "pr", "qc", "qr", "lc", "lr")}
    opts = {"beta": 0.1, "gamma": 0.5, "z0": 0.0, "kind": kind}
    grid, args, kwargs = _preference_args(t, x, x, x, opts, {"USE_REF": True, "NORMALIZE": True})
    return ki.launch_job(_preference_kernel, *args, grid=grid, **kwargs)


class _PreferenceLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pc, pr, t, opts, variant):
        P = t["pc"].numel()
        loss = torch.empty(P, dtype=torch.float32, device=pc.device)
        dpc, dpr = torch.empty_like(loss), torch.empty_like(loss)
        if P:
            grid, args, kwargs = _preference_args(t, loss, dpc, dpr, opts, variant)
            _preference_kernel[grid](*args, **kwargs)
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


def kto_unpaired_loss(logratio, desirable, *, beta=0.1, lam_d=1.0, lam_u=1.0):
    """KTO on single completions, no pairs (Ethayarajh et al. 2024; TRL 1.16 KTOTrainer._compute_loss):
    the mean over the batch of lam_D (1 - sigma(beta (r - z0))) for a desirable completion and
    lam_U (1 - sigma(beta (z0 - r))) for an undesirable one, r = log pi/pi_ref summed over the completion (N,),
    desirable (N,) bool, z0 = max(0, mean r of the batch), detached (the reference point of the kernel's KTO).
    On a batch of P desirable and P undesirable completions with lam_D = lam_U = 1 it is half the kernel's
    paired KTO loss over those P pairs (tests/test_preference.py); the weights are what pairs cannot express."""
    if logratio.dim() != 1 or desirable.shape != logratio.shape or desirable.dtype != torch.bool:
        raise ValueError("kto_unpaired_loss: logratio (N,) float and desirable (N,) bool of the same shape")
    if not (beta > 0 and lam_d > 0 and lam_u > 0):
        raise ValueError(f"kto_unpaired_loss: beta, lam_d, lam_u must be > 0, got {beta}, {lam_d}, {lam_u}")
    z0 = logratio.detach().mean().clamp_min(0.0)
    good = lam_d * (1 - torch.sigmoid(beta * (logratio - z0)))                 # desirable: pull r above z0
    bad = lam_u * (1 - torch.sigmoid(beta * (z0 - logratio)))                  # undesirable: push r below z0
    return torch.where(desirable, good, bad).mean()


# ---------------------------------------------------------------- pairs from the model's own samples, and the runs

def build_pairs(model, prompts_pairs: torch.Tensor, group_size: int, gen: torch.Generator) -> dict:
    """Sample ``group_size`` answers per prompt; where a group has a right and a wrong answer, the first right
    one is chosen and the first wrong one rejected (the verifier is the preference labeller)."""
    from kernels.rl import task

    rep = prompts_pairs.repeat_interleave(group_size, 0)
    comp = task.sample(model, rep, temperature=1.0, generator=gen)
    ok = task.rewards(comp, rep).view(-1, group_size)                       # (P, G)
    keep = (ok.max(1).values == 1) & (ok.min(1).values == 0)
    rows = keep.nonzero().squeeze(1)
    base = rows * group_size
    chosen = comp[base + ok[rows].argmax(1)]
    rejected = comp[base + (1 - ok[rows]).argmax(1)]
    return {"pairs": prompts_pairs[rows], "chosen": chosen, "rejected": rejected}


def build_unpaired(model, prompts_pairs: torch.Tensor, group_size: int, gen: torch.Generator) -> dict:
    """Every sampled answer alone, labelled desirable (right) or undesirable (wrong) by the verifier: KTO's data.
    Drawn exactly as :func:`build_pairs` draws (same generator, same calls), so with the same seed its
    completions are the ones the pairs were taken from, and the groups with no pair are kept too."""
    from kernels.rl import task

    rep = prompts_pairs.repeat_interleave(group_size, 0)
    comp = task.sample(model, rep, temperature=1.0, generator=gen)
    return {"pairs": rep, "completions": comp, "desirable": task.rewards(comp, rep) == 1}


def sequence_logprobs(model, completions: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each completion up to its END, its length in tokens)."""
    from kernels.rl import task

    mask = task.completion_mask(completions)
    return (task.completion_logprobs(model, completions, pairs) * mask).sum(1), mask.sum(1)


RUN_SETTINGS = {"dpo": {"beta": 0.1}, "ipo": {"beta": 0.1}, "simpo": {"beta": 2.0, "gamma": 1.0}}


def train_preference(kind: str, data: dict, *, steps: int = 60, batch: int = 32, lr: float = 1e-4, seed: int = 0,
                     eval_every: int = 20, progress: bool = True, stop_after: int | None = None) -> dict:
    """Train the SFT checkpoint on fixed preference pairs with ``kind``'s loss (RUN_SETTINGS); returns {"log"}."""

    from tqdm import tqdm

    from kernels.rl import sft, task

    policy, reference = sft.policy_and_reference(seed, 1)
    _, held_out = task.split_pairs()
    with torch.no_grad():
        qc_all, lc_all = sequence_logprobs(reference, data["chosen"], data["pairs"])
        qr_all, lr_all = sequence_logprobs(reference, data["rejected"], data["pairs"])
    gen = torch.Generator().manual_seed(seed)
    opt = sft.adamw(policy.parameters(), lr)
    log = [{"step": 0, "loss": "", "chosen_logratio": 0.0, "rejected_logratio": 0.0, "pair_accuracy": "",
            "held_out_accuracy": task.accuracy(policy, held_out)}]
    for step in tqdm(range(1, (stop_after or steps) + 1), desc=kind, disable=not progress):
        idx = torch.randint(0, len(data["pairs"]), (batch,), generator=gen)
        pc, _ = sequence_logprobs(policy, data["chosen"][idx], data["pairs"][idx])
        pr, _ = sequence_logprobs(policy, data["rejected"][idx], data["pairs"][idx])
        loss = preference_loss(kind, pc, pr, qc_all[idx], qr_all[idx], lc_all[idx], lr_all[idx], **RUN_SETTINGS[kind])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        rc, rr = (pc - qc_all[idx]).detach(), (pr - qr_all[idx]).detach()
        row = {"step": step, "loss": round(float(loss.detach()), 5), "chosen_logratio": round(float(rc.mean()), 5),
               "rejected_logratio": round(float(rr.mean()), 5), "pair_accuracy": round(float((rc > rr).float().mean()), 5),
               "held_out_accuracy": ""}
        if step % eval_every == 0 or step == steps:
            row["held_out_accuracy"] = task.accuracy(policy, held_out)
        log.append(row)
    return {"log": log}


KTO_UNPAIRED = {"beta": 0.1, "batch": 64, "steps": 120, "lr": 1e-5, "seeds": (0, 1, 2)}


def train_kto_unpaired(data: dict, *, steps: int = 120, batch: int = 64, lr: float = 1e-5, beta: float = 0.1,
                       lam_d: float = 1.0, lam_u: float = 1.0, seed: int = 0, eval_every: int = 20,
                       progress: bool = True, stop_after: int | None = None) -> dict:
    """KTO from the SFT checkpoint on single labelled completions (:func:`build_unpaired`): each step draws
    ``batch`` completions at random, whatever their prompt; returns {"log"}. The batch of 64 completions is
    the forward/backward work of DPO's batch of 32 pairs."""
    from tqdm import tqdm

    from kernels.rl import sft, task

    policy, reference = sft.policy_and_reference(seed, 1)
    _, held_out = task.split_pairs()
    with torch.no_grad():
        q_all, _ = sequence_logprobs(reference, data["completions"], data["pairs"])
    gen = torch.Generator().manual_seed(seed)
    opt = sft.adamw(policy.parameters(), lr)
    log = [{"step": 0, "loss": "", "desirable_logratio": 0.0, "undesirable_logratio": 0.0,
            "held_out_accuracy": task.accuracy(policy, held_out)}]
    for step in tqdm(range(1, (stop_after or steps) + 1), desc="kto", disable=not progress):
        idx = torch.randint(0, len(data["pairs"]), (batch,), generator=gen)
        p, _ = sequence_logprobs(policy, data["completions"][idx], data["pairs"][idx])
        r, good = p - q_all[idx], data["desirable"][idx]
        loss = kto_unpaired_loss(r, good, beta=beta, lam_d=lam_d, lam_u=lam_u)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        r = r.detach()
        row = {"step": step, "loss": round(float(loss.detach()), 5),
               "desirable_logratio": round(float(r[good].mean()), 5) if bool(good.any()) else "",
               "undesirable_logratio": round(float(r[~good].mean()), 5) if bool((~good).any()) else "",
               "held_out_accuracy": ""}
        if step % eval_every == 0 or step == steps:
            row["held_out_accuracy"] = task.accuracy(policy, held_out)
        log.append(row)
    return {"log": log}


def run_kto_unpaired() -> dict:
    """python -m kernels.rl.preference --kto-unpaired: KTO on every sampled answer (unpaired), three seeds, and
    DPO at seeds 1 and 2 beside the committed seed 0; writes models/rl/dpo/kto-unpaired/."""
    import csv
    import json
    import time

    from kernels.rl import sft, task

    torch.set_num_threads(1)
    out = sft.OUT_DIR / "dpo" / "kto-unpaired"
    out.mkdir(parents=True, exist_ok=True)
    train_pairs, _ = task.split_pairs()
    data = build_unpaired(sft.load_sft(), train_pairs[:1024], 8, torch.Generator().manual_seed(0))
    n_d = int(data["desirable"].sum())
    n_u = len(data["desirable"]) - n_d
    cfg = dict(KTO_UNPAIRED, lam_d=round(n_u / n_d, 4), lam_u=1.0)           # lam_D n_D / (lam_U n_U) = 1
    meta = {"completions": len(data["desirable"]), "desirable": n_d, "undesirable": n_u, **cfg,
            "torch": torch.__version__, "command": "python -m kernels.rl.preference --kto-unpaired"}

    def write(name, log):
        with open(out / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(log[0]))
            writer.writeheader()
            writer.writerows(log)

    pairs = torch.load(sft.OUT_DIR / "dpo" / "pairs.pt")
    dpo_meta = json.loads((sft.OUT_DIR / "dpo" / "metrics.json").read_text())
    for seed in cfg["seeds"]:
        start = time.perf_counter()
        log = train_kto_unpaired(data, steps=cfg["steps"], batch=cfg["batch"], lr=cfg["lr"], beta=cfg["beta"],
                                 lam_d=cfg["lam_d"], lam_u=cfg["lam_u"], seed=seed, progress=False)["log"]
        write(f"kto-seed{seed}.csv", log)
        meta[f"kto_seed{seed}_seconds"] = round(time.perf_counter() - start, 1)
        if seed != 0:                                                          # DPO seed 0 is models/rl/dpo/dpo.csv
            write(f"dpo-seed{seed}.csv", train_preference("dpo", pairs, steps=dpo_meta["steps"], lr=dpo_meta["lr"],
                                                          seed=seed, progress=False)["log"])
    (out / "metrics.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    """python -m kernels.rl.preference: pairs from the SFT model's samples, then DPO, IPO and SimPO runs on them;
    writes models/rl/dpo/{pairs.pt, <kind>.csv, metrics.json}."""
    import argparse
    import csv
    import json
    import time

    from kernels.rl import sft, task

    p = argparse.ArgumentParser(prog="python -m kernels.rl.preference")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--kto-unpaired", action="store_true", help="KTO on unpaired answers (three seeds) and DPO seeds 1, 2")
    args = p.parse_args(argv)
    if args.kto_unpaired:
        print(run_kto_unpaired())
        return 0
    out = sft.OUT_DIR / "dpo"
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    train_pairs, _ = task.split_pairs()
    gen = torch.Generator().manual_seed(0)
    data = build_pairs(sft.load_sft(), train_pairs[:1024], 8, gen)
    torch.save(data, out / "pairs.pt")
    meta = {"prompts": 1024, "group_size": 8, "pairs": len(data["pairs"]), "steps": args.steps, "batch": 32,
            "lr": args.lr, "settings": RUN_SETTINGS, "torch": torch.__version__, "command": "python -m kernels.rl.preference"}
    for kind in RUN_SETTINGS:
        start = time.perf_counter()
        log = train_preference(kind, data, steps=args.steps, lr=args.lr)["log"]
        with open(out / f"{kind}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(log[0]))
            writer.writeheader()
            writer.writerows(log)
        meta[f"{kind}_seconds"] = round(time.perf_counter() - start, 1)
        meta[f"{kind}_held_out_accuracy"] = log[-1]["held_out_accuracy"]
    (out / "metrics.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def compile_jobs() -> dict:
    """Each preference loss over 4096 pairs."""
    return {f"{kind} loss, 4096 pairs": aot_job(kind) for kind in KINDS}
