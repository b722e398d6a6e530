"""Online DPO and RLAIF: the pair is sampled from the current policy and labelled by a judge at every step.

Offline DPO (kernels.rl.preference) trains on pairs sampled once from the SFT model. Online DPO
(Guo et al. 2024) samples two answers y_a, y_b from the *current* policy for each prompt, asks a judge
for a score of each (s_a, s_b), and takes the DPO loss on the pair the judge orders:

    z = sign(s_a - s_b)                                   +1: a preferred, -1: b preferred, 0: tie
    h = beta * z * ((log pi(y_a) - log pi_ref(y_a)) - (log pi(y_b) - log pi_ref(y_b)))
    loss = sum_{z != 0} -log sigma(h) / #{z != 0}         a tie gives no pair: it is masked, not averaged in

Three judges here. ``verifier``: the exact reward of kernels.rl.task (1 if right, else 0), so two right or
two wrong answers tie. ``likelihood``: the frozen SFT model scoring each answer by its mean per-token
log-likelihood, a stand-in for an AI judge built from the tiny GPT (it cannot read a judge prompt); it never
ties unless the two answers are the same, and it is wrong wherever the model is confidently wrong.
``majority`` (measured against the verifier, not trained with): self-consistency, 1 for an answer equal to
the most common of MAJORITY_VOTES samples of the frozen SFT model, else 0.

The fused kernel turns the four summed log-probs and two judge scores of each pair into its label, its loss
and its gradients in one pass. Broken variants for the tests: MASK_TIES=False counts a tie as "a preferred",
SWAP=True trains towards the rejected answer.

``python -m kernels.rl.online_dpo --seeds 0 1 2`` trains four arms from the SFT checkpoint for each seed with
the same steps, pairs per step, beta and learning rate: offline DPO on models/rl/dpo/pairs.pt; fresh
verifier-labelled pairs sampled from the frozen SFT model (off-policy, as many distinct pairs as online);
online DPO judged by the verifier; online DPO judged by the likelihood judge. ``--judges`` measures the
likelihood and majority judges against the verifier on held-out prompts. Output: models/rl/online-dpo/.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels import runtime
from kernels.rl import sft, task
from kernels.rl.preference import _log_sigmoid, sequence_logprobs

BLOCK = 1024
JUDGES = ("verifier", "likelihood")


def online_dpo_loss_ref(pa, pb, qa, qb, sa, sb, *, beta: float = 0.1):
    """(mean DPO loss over the pairs the judge does not tie, labels z (P,)); all arguments (P,) float:
    policy (pa, pb) and reference (qa, qb) summed log-probs of answers a and b, judge scores (sa, sb)."""
    z = torch.sign(sa - sb)                                                    # (P,) +1, -1 or 0 (tie)
    keep = z != 0
    h = beta * z * ((pa - qa) - (pb - qb))                                     # the chosen-minus-rejected margin
    loss = -F.logsigmoid(h[keep]).sum() / keep.sum().clamp_min(1)
    return loss, z


@triton.jit
def _online_dpo_kernel(pa_ptr, pb_ptr, qa_ptr, qb_ptr, sa_ptr, sb_ptr,    # (P,) each
                       loss_ptr, dpa_ptr, dpb_ptr, z_ptr,                  # (P,) outputs, not yet divided by #pairs
                       P, beta,
                       BLOCK: tl.constexpr, MASK_TIES: tl.constexpr = True, SWAP: tl.constexpr = False):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < P
    sa = tl.load(sa_ptr + offs, mask=ok, other=0.0)
    sb = tl.load(sb_ptr + offs, mask=ok, other=0.0)
    z = tl.where(sa > sb, 1.0, tl.where(sb > sa, -1.0, 0.0))                  # the judge's label
    if not MASK_TIES:
        z = tl.where(z == 0.0, 1.0, z)                                       # broken: a tie becomes "a wins"
    if SWAP:
        z = -z                                                               # broken: chosen and rejected swapped
    ra = tl.load(pa_ptr + offs, mask=ok, other=0.0) - tl.load(qa_ptr + offs, mask=ok, other=0.0)
    rb = tl.load(pb_ptr + offs, mask=ok, other=0.0) - tl.load(qb_ptr + offs, mask=ok, other=0.0)
    h = beta * z * (ra - rb)                                                 # h = beta z (r_a - r_b)
    pair = z != 0.0
    loss = tl.where(pair, -_log_sigmoid(h), 0.0)                             # -log sigma(h), 0 on a tie
    d = tl.where(pair, -beta * z * tl.sigmoid(-h), 0.0)                      # dloss/d(r_a - r_b)
    tl.store(loss_ptr + offs, loss, mask=ok)
    tl.store(dpa_ptr + offs, d, mask=ok)
    tl.store(dpb_ptr + offs, -d, mask=ok)
    tl.store(z_ptr + offs, z, mask=ok)


def _launch_args(t: dict, out: dict, beta: float, variant: dict):
    """(grid, args, kwargs) of the kernel's launch over P pairs; shared by the autograd function and aot_job."""
    P = t["pa"].numel()
    args = (t["pa"], t["pb"], t["qa"], t["qb"], t["sa"], t["sb"], out["loss"], out["dpa"], out["dpb"], out["z"], P, beta)
    return (triton.cdiv(P, BLOCK),), args, dict(BLOCK=BLOCK, **variant)


def aot_job(pairs: int = 4096):
    """The launch :func:`online_dpo_loss` makes for ``pairs`` pairs (Guo et al. sample 2 answers for each prompt
    of a batch; 4096 is a large batch), built from meta tensors by :func:`kernels.inspect.launch_job`."""
    from kernels import inspect as ki

    x = torch.empty(pairs, dtype=torch.float32, device="meta")               # (P,) every input and output
    t = {k: x for k in ("pa", "pb", "qa", "qb", "sa", "sb")}
    grid, args, kwargs = _launch_args(t, {k: x for k in ("loss", "dpa", "dpb", "z")}, 0.1,
                                      {"MASK_TIES": True, "SWAP": False})
    return ki.launch_job(_online_dpo_kernel, *args, grid=grid, **kwargs)


class _OnlineDPOLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pa, pb, t, beta, variant):
        P = t["pa"].numel()
        out = {k: torch.empty(P, dtype=torch.float32, device=pa.device) for k in ("loss", "dpa", "dpb", "z")}
        if P:
            grid, args, kwargs = _launch_args(t, out, beta, variant)
            _online_dpo_kernel[grid](*args, **kwargs)
        n = (out["z"] != 0).sum().clamp_min(1).float()                          # pairs the judge did not tie
        ctx.save_for_backward(out["dpa"] / n, out["dpb"] / n)
        ctx.mark_non_differentiable(out["z"])
        return out["loss"].sum() / n, out["z"]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_z):
        dpa, dpb = ctx.saved_tensors
        return grad_out * dpa, grad_out * dpb, None, None, None


def online_dpo_loss(pa, pb, qa, qb, sa, sb, *, beta: float = 0.1, mask_ties: bool = True, swap: bool = False):
    """:func:`online_dpo_loss_ref` with the fused kernel, differentiable in pa and pb; returns (loss, z).
    ``mask_ties=False`` and ``swap=True`` are the broken variants."""
    name = "online_dpo_loss"
    if not beta > 0:
        raise ValueError(f"{name}: beta must be > 0, got {beta}")
    t = {}
    for k, v in (("pa", pa), ("pb", pb), ("qa", qa), ("qb", qb), ("sa", sa), ("sb", sb)):
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or not v.dtype.is_floating_point:
            raise ValueError(f"{name}: {k} must be a 1-D floating-point tensor")
        if v.shape != pa.shape:
            raise ValueError(f"{name}: {k} has shape {tuple(v.shape)}, pa has {tuple(pa.shape)}")
        if v.device.type != runtime.device().type:
            raise ValueError(f"{name}: {k} is on {v.device}; kernels run on {runtime.device()}")
        t[k] = v.detach().float().contiguous()
    if not bool(torch.isfinite(t["sa"]).all() & torch.isfinite(t["sb"]).all()):
        raise ValueError(f"{name}: judge scores sa, sb must be finite")
    return _OnlineDPOLoss.apply(pa, pb, t, float(beta), {"MASK_TIES": bool(mask_ties), "SWAP": bool(swap)})


# ---------------------------------------------------------------- the judges

def same_answer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(P,) bool: the two completions (P, L) are the same up to and including their first END."""
    ma, mb = task.completion_mask(a), task.completion_mask(b)
    return ((a * ma) == (b * mb)).all(1) & (ma == mb).all(1)


@torch.no_grad()
def judge_scores(judge: str, judge_model, a: torch.Tensor, b: torch.Tensor, pairs: torch.Tensor):
    """Scores (sa, sb) of answers a and b (P, L) to ``pairs`` (P, 2). ``verifier``: the task's 0/1 reward.
    ``likelihood``: ``judge_model``'s mean per-token log-likelihood of each answer, scored one answer at a time
    (the judge never sees the two together, so it cannot prefer a position); the same answer twice is a tie."""
    if judge == "verifier":
        return task.rewards(a, pairs), task.rewards(b, pairs)
    if judge != "likelihood":
        raise ValueError(f"judge_scores: judge must be one of {JUDGES}, got {judge!r}")
    la, na = sequence_logprobs(judge_model, a, pairs)
    lb, nb = sequence_logprobs(judge_model, b, pairs)
    sa, sb = la / na, lb / nb
    same = same_answer(a, b)
    return sa, torch.where(same, sa, sb)


MAJORITY_VOTES = 8


@torch.no_grad()
def majority_answers(model, pairs: torch.Tensor, votes: int, gen: torch.Generator) -> list[bytes | None]:
    """Self-consistency: ``votes`` answers from ``model`` to each of ``pairs`` (P, 2) at temperature 1, and the
    most common one per prompt (cut at its first END; the first sampled wins a tie of counts; None = no END)."""
    comp = task.sample(model, pairs.repeat_interleave(votes, 0), temperature=1.0, generator=gen)   # (P*votes, L)
    cut = [bytes(r[: r.index(task.END)]) if task.END in r else None for r in comp.tolist()]
    return [Counter(cut[i: i + votes]).most_common(1)[0][0] for i in range(0, len(cut), votes)]


def majority_scores(a: torch.Tensor, b: torch.Tensor, majority: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The majority-vote judge: score 1 for an answer (P, L) equal to its prompt's majority answer, else 0."""
    def score(c):
        return torch.tensor([float(m is not None and task.END in r and bytes(r[: r.index(task.END)]) == m)
                             for r, m in zip(c.tolist(), majority)])
    return score(a), score(b)


@torch.no_grad()
def judge_agreement(judge_model, policy, pairs: torch.Tensor, gen: torch.Generator, *, majority: bool = False) -> dict:
    """Two answers per prompt from ``policy``; the self-judge (and with ``majority``, the majority-vote judge of
    MAJORITY_VOTES samples of ``judge_model``, drawn after the pairs) against the verifier (exact counts)."""
    rep = pairs.repeat_interleave(2, 0)
    comp = task.sample(policy, rep, temperature=1.0, generator=gen)
    a, b = comp[0::2], comp[1::2]
    va, vb = judge_scores("verifier", None, a, b, pairs)
    zv = torch.sign(va - vb)
    decisive = zv != 0
    out = {"pairs": len(pairs), "verifier_decisive": int(decisive.sum()), "verifier_ties": int((~decisive).sum()),
           "both_right": int(((va == 1) & (vb == 1)).sum())}
    judges = {"likelihood": judge_scores("likelihood", judge_model, a, b, pairs)}
    if majority:
        votes = majority_answers(judge_model, pairs, MAJORITY_VOTES, gen)
        judges["majority"] = majority_scores(a, b, votes)
        out["majority_is_right"] = sum(m == str(x + y).encode() for m, (x, y) in zip(votes, pairs.tolist()))
    for name, (sa, sb) in judges.items():
        zs = torch.sign(sa - sb)
        out.update({f"{name}_ties": int((zs == 0).sum()), f"{name}_agrees": int((decisive & (zs == zv)).sum()),
                    f"{name}_disagrees": int((decisive & (zs == -zv)).sum()),
                    f"{name}_tied_on_decisive": int((decisive & (zs == 0)).sum())})
    return out


# ---------------------------------------------------------------- the three arms

ARMS = ("offline", "offpolicy-verifier", "online-verifier", "online-likelihood")


def _fresh_batch(policy, reference, judge: str, train_pairs, prompts: int, batch: int, gen, *, sampler=None):
    """Two answers from ``sampler`` (default: ``policy``) for ``prompts`` random training prompts, judged; the judge's decisive pairs
    beyond the first ``batch`` are made ties so that every arm trains on at most ``batch`` pairs a step. Returns
    (pairs, a, b, sa, sb, the number of prompts whose two answers the judge itself tied)."""
    pairs = train_pairs[torch.randint(0, len(train_pairs), (prompts,), generator=gen)]
    comp = task.sample(policy if sampler is None else sampler, pairs.repeat_interleave(2, 0), temperature=1.0, generator=gen)
    a, b = comp[0::2], comp[1::2]
    sa, sb = judge_scores(judge, reference, a, b, pairs)
    decisive = (sa != sb).nonzero().squeeze(1)
    sb = sb.clone()
    sb[decisive[batch:]] = sa[decisive[batch:]]
    return pairs, a, b, sa, sb, prompts - len(decisive)


@torch.no_grad()
def drift(policy, reference, old: dict, fresh_pairs: torch.Tensor, gen: torch.Generator, beta: float) -> dict:
    """On- vs off-policy: the policy's mean log-prob of the old pairs' answers and of its own fresh samples, and
    the implicit reward margin beta (r_c - r_r) on old pairs and on fresh verifier-labelled pairs."""
    pc, _ = sequence_logprobs(policy, old["chosen"], old["pairs"])
    pr, _ = sequence_logprobs(policy, old["rejected"], old["pairs"])
    qc, _ = sequence_logprobs(reference, old["chosen"], old["pairs"])
    qr, _ = sequence_logprobs(reference, old["rejected"], old["pairs"])
    comp = task.sample(policy, fresh_pairs.repeat_interleave(2, 0), temperature=1.0, generator=gen)
    a, b = comp[0::2], comp[1::2]
    pa, _ = sequence_logprobs(policy, a, fresh_pairs)
    pb, _ = sequence_logprobs(policy, b, fresh_pairs)
    qa, _ = sequence_logprobs(reference, a, fresh_pairs)
    qb, _ = sequence_logprobs(reference, b, fresh_pairs)
    va, vb = judge_scores("verifier", None, a, b, fresh_pairs)
    z = torch.sign(va - vb)
    keep = z != 0
    fresh_margin = (beta * z * ((pa - qa) - (pb - qb)))[keep]
    return {"logp_old_chosen": round(float(pc.mean()), 4), "logp_old_rejected": round(float(pr.mean()), 4),
            "logp_own_samples": round(float(torch.cat([pa, pb]).mean()), 4),
            "margin_old": round(float((beta * ((pc - qc) - (pr - qr))).mean()), 4),
            "margin_fresh": round(float(fresh_margin.mean()), 4) if bool(keep.any()) else "",
            "fresh_decisive": int(keep.sum())}


def train_arm(arm: str, old: dict, *, steps: int = 120, batch: int = 32, prompts: int = 256, beta: float = 0.1,
              lr: float = 1e-5, seed: int = 0, eval_every: int = 20, drift_pairs: int = 128, progress: bool = True,
              stop_after: int | None = None) -> dict:
    """Train the SFT checkpoint with ``arm`` (ARMS) for ``steps`` steps of at most ``batch`` pairs; {"log": rows}."""
    from tqdm import tqdm

    if arm not in ARMS:
        raise ValueError(f"train_arm: arm must be one of {ARMS}, got {arm!r}")
    policy, reference = sft.policy_and_reference(seed, 1)
    train_pairs, held_out = task.split_pairs()
    old_probe = {k: v[:drift_pairs] for k, v in old.items()}
    fresh_probe = train_pairs[-drift_pairs:]
    gen = torch.Generator().manual_seed(seed)
    probe_gen = lambda: torch.Generator().manual_seed(seed + 1)             # noqa: E731  same probe samples each eval
    opt = sft.adamw(policy.parameters(), lr)
    log = [{"step": 0, "loss": "", "pairs": "", "ties": "", "held_out_accuracy": task.accuracy(policy, held_out),
            **drift(policy, reference, old_probe, fresh_probe, probe_gen(), beta)}]
    for step in tqdm(range(1, (stop_after or steps) + 1), desc=arm, disable=not progress):
        if arm == "offline":
            idx = torch.randint(0, len(old["pairs"]), (batch,), generator=gen)
            pairs, a, b = old["pairs"][idx], old["chosen"][idx], old["rejected"][idx]
            sa, sb = torch.ones(batch), torch.zeros(batch)
            judge_ties = 0
        else:
            sampler = reference if arm.startswith("offpolicy") else policy      # offpolicy: fresh pairs, old sampler
            pairs, a, b, sa, sb, judge_ties = _fresh_batch(policy, reference, arm.split("-")[1], train_pairs, prompts,
                                                           batch, gen, sampler=sampler)
        with torch.no_grad():
            qa, _ = sequence_logprobs(reference, a, pairs)
            qb, _ = sequence_logprobs(reference, b, pairs)
        pa, _ = sequence_logprobs(policy, a, pairs)
        pb, _ = sequence_logprobs(policy, b, pairs)
        loss, z = online_dpo_loss(pa, pb, qa, qb, sa, sb, beta=beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        n = int((z != 0).sum())
        row = {"step": step, "loss": round(float(loss.detach()), 5), "pairs": n, "ties": judge_ties,
               "held_out_accuracy": ""}
        row.update({k: "" for k in log[0] if k not in row})
        if step % eval_every == 0 or step == steps:
            row["held_out_accuracy"] = task.accuracy(policy, held_out)
            row.update(drift(policy, reference, old_probe, fresh_probe, probe_gen(), beta))
        log.append(row)
    return {"log": log, "model": policy}


SEEDS = (0, 1, 2)


def run_seed(seed: int, out: Path, *, steps: int, lr: float, prompts: int, arms=ARMS) -> dict:
    """Train ``arms`` from the SFT checkpoint with ``seed``; write out/seed{seed}/{arm}.csv and its metrics.json."""
    import csv
    import json
    import time

    old = torch.load(sft.OUT_DIR / "dpo" / "pairs.pt")
    sft_model = sft.load_sft()
    _, held_out = task.split_pairs()
    d = out / f"seed{seed}"
    d.mkdir(parents=True, exist_ok=True)
    meta = {"seed": seed, "torch": torch.__version__}
    for arm in arms:
        start = time.perf_counter()
        log = (res := train_arm(arm, old, steps=steps, lr=lr, prompts=prompts, seed=seed))["log"]
        with open(d / f"{arm}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(log[0]))
            writer.writeheader()
            writer.writerows(log)
        meta[f"{arm}_seconds"] = round(time.perf_counter() - start, 1)
        meta[f"{arm}_held_out_accuracy"] = log[-1]["held_out_accuracy"]
        meta[f"{arm}_pairs_trained"] = sum(r["pairs"] for r in log[1:])
        meta[f"{arm}_judge_ties"] = sum(r["ties"] for r in log[1:])
        if arm == "online-likelihood":      # the judge against the verifier on the answers of the policy it trained
            meta["judge_trained_held_out"] = judge_agreement(sft_model, res["model"].eval(), held_out.repeat(4, 1),
                                                             torch.Generator().manual_seed(7))
        (d / "metrics.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    """python -m kernels.rl.online_dpo: the judges' agreement (--judges) or the four arms for --seeds;
    writes models/rl/online-dpo/ (metrics.json: settings and judges; seed{s}/: each seed's logs)."""
    import argparse
    import json
    import time

    p = argparse.ArgumentParser(prog="python -m kernels.rl.online_dpo")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--prompts", type=int, default=128, help="prompts sampled per step (two answers each)")
    p.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    p.add_argument("--judges", action="store_true", help="measure the judges on held-out pairs and write metrics.json")
    args = p.parse_args(argv)
    out = sft.OUT_DIR / "online-dpo"
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if args.judges:
        _, held_out = task.split_pairs()
        sft_model = sft.load_sft()
        meta = {"steps": args.steps, "batch": 32, "prompts_per_step": args.prompts, "beta": 0.1, "lr": args.lr,
                "seeds": list(SEEDS), "old_pairs": len(torch.load(sft.OUT_DIR / "dpo" / "pairs.pt")["pairs"]),
                "majority_votes": MAJORITY_VOTES, "torch": torch.__version__,
                "command": "python -m kernels.rl.online_dpo --judges; python -m kernels.rl.online_dpo --seeds S"}
        start = time.perf_counter()
        meta["judge_sft_held_out"] = judge_agreement(sft_model, sft_model, held_out.repeat(4, 1),
                                                     torch.Generator().manual_seed(7), majority=True)
        meta["judge_seconds"] = round(time.perf_counter() - start, 1)
        (out / "metrics.json").write_text(json.dumps(meta, indent=2) + "\n")
        print(meta)
    for seed in args.seeds:
        print(run_seed(seed, out, steps=args.steps, lr=args.lr, prompts=args.prompts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def compile_jobs() -> dict:
    """The online DPO loss over 4096 judged pairs."""
    return {"online DPO loss, 4096 pairs": aot_job()}
